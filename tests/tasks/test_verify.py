"""Final answers (issue 8, part 4): only the final answer earns the reward, compared exactly."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

from mlperf_grpo.tasks import arithmetic
from mlperf_grpo.tasks.base import Task
from mlperf_grpo.tasks.verify import _decimal_places, _parse, answers_match, final_answer, math_reward, verify_answer

TASK_12_34 = Task("add-12-34", "12+34=", "46")


@pytest.mark.parametrize("completion, want", [
    ("46", 1.0), (" 46\n", 1.0), ("046", 1.0),
    ("99=46", 0.0),   # an equation: math-verify alone read its right-hand side (scored 1.0)
    ("12+34", 0.0),   # the question restated: math-verify evaluated it to 46 (scored 1.0)
    ("46+0", 0.0), ("4 6", 0.0), ("46.0", 0.0), ("", 0.0), ("45", 0.0), ("=46", 0.0),
])
def test_arithmetic_rewards_only_the_number_written(completion, want):
    assert arithmetic.reward(completion, TASK_12_34) == want


def test_arithmetic_final_answer():
    assert arithmetic.final_answer("154") == 154
    assert arithmetic.final_answer("1+53") is None and arithmetic.final_answer("99=46") is None


@pytest.mark.parametrize("text, want", [
    ("so \\boxed{1} and then \\boxed{\\frac{3}{4}} ok", "\\frac{3}{4}"),  # the last boxed, braces balanced
    ("\\boxed{x^{2}+1}", "x^{2}+1"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),                 # GSM8K
    ("#### 1,000\nthe end 5", "1,000"),
    ("\\frac{1}{2}", "\\frac{1}{2}"), ("$-3/4$", "-3/4"),             # a lone number is the answer
    ("12 then 13", "13"), ("it costs 2.50.", "2.50"), ("x=3, y=-4", "-4"),
    ("no number here", None), ("\\boxed{", None), ("", None),
])
def test_final_answer_of_free_text(text, want):
    assert final_answer(text) == want


@pytest.mark.parametrize("answer, gold, want", [
    ("0.1234567", "0.1234568", False),   # math-verify's float rounding called these equal
    ("0.333333333", "1/3", False),       # ... and these
    ("100000000000000000001", "100000000000000000000", False),
    ("1/2", "0.5", True), ("\\frac{1}{2}", "0.50", True), ("1,000", "1000", True), ("-0", "0", True),
    ("\\sqrt{2}", "\\sqrt{2}", True), ("x^2+1", "1+x^{2}", True), ("\\sqrt{2}", "1.41421356", False),
    ("2", "\\sqrt{4}", True),            # symbolic gold: math-verify
])
def test_answers_match_numbers_exactly_and_symbols_by_math_verify(answer, gold, want):
    assert answers_match(answer, gold) is want


@pytest.mark.parametrize("completion, gold, want", [
    ("so 70 + 2 = 72.\n#### 72.", "72", 1.0),  # sentence punctuation after the number (issue 44)
    ("#### 72,", "72", 1.0),
    ("#### 72?", "72", 1.0),  # the references' regex reads 72 (breaker finding)
    ("#### 5!", "120", 1.0),  # but ! is a factorial, kept
    ("#### 72 .", "72", 1.0),
    ("#### $72$.", "72", 1.0),
    ("#### 1,000.", "1000", 1.0),
    ("#### 72.", "#### 72.", 1.0),  # a gold answer written the same way
    ("#### 73.", "72", 0.0),  # and the other direction: the number still decides
    ("#### 72.5", "72", 0.0),
    ("#### 72.5.", "72.5", 1.0),
    ("#### 7.2", "72", 0.0),
    ("#### 72,5", "72", 0.0),
    ("#### .", "72", 0.0),
])
def test_gsm8k_answers_ignore_the_punctuation_that_ends_the_sentence(completion, gold, want):
    assert math_reward(completion, Task("t", "q", final_answer(gold))) == want


def test_math_reward_reads_the_final_answer_only():
    task = Task("t", "q", "46")
    assert math_reward("12+34 gives \\boxed{46}", task) == 1.0
    assert math_reward("\\boxed{46} no wait \\boxed{45}", task) == 0.0
    assert math_reward("I think 46, no: 47", task) == 0.0


VERIFY_CASES = [("154", "154", True), ("the answer is 48", "48", True), ("144", "154", False),
                ("", "5", False), ("\\frac{1}{2}", "0.5", True), ("12 then 13", "13", True)]


def test_verify_answer_from_threads_and_spawned_processes():
    completions, golds, want = zip(*VERIFY_CASES)
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(verify_answer, completions * 4, golds * 4)) == list(want) * 4
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert list(pool.map(verify_answer, completions, golds)) == list(want)


@pytest.mark.parametrize("completion, gold, want", [
    # a parse that drops part of the answer is not credited (math-verify read 4\sqrt(2) as 4,
    # huggingface/Math-Verify#41; 1 - \frac{1}{\mathrm{e}} as 1; 4 \\ 5 as 5)
    ("\\boxed{4\\sqrt(2)}", "4", False), ("\\boxed{4\\sqrt(2)+1}", "4", False),
    ("\\boxed{1 - \\frac{1}{\\mathrm{e}}}", "1", False), ("\\boxed{4 \\\\ 5}", "5", False),
    ("\\boxed{4\\sqrt{2}}", "4\\sqrt{2}", True), ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),
    # small values compare relatively: math-verify's 15-digit chop made these equal
    ("\\boxed{10^{-30}}", "2\\cdot 10^{-30}", False), ("\\boxed{e^{-101}}", "e^{-100}", False),
    ("\\boxed{x = 10^{-30}}", "x = 2\\cdot 10^{-30}", False),        # inside an equation
    ("\\boxed{[0, 10^{-30}]}", "[0, 2\\cdot 10^{-30}]", False),      # an interval's end
    ("\\boxed{[0, 0.0000001]}", "[0, 0.0000002]", False),            # floats rounded to 6 places
    ("\\boxed{\\frac{2}{10^{30}}}", "2\\cdot 10^{-30}", True), ("\\boxed{[0, 0.1]}", "[0, \\frac{1}{10}]", True),
    ("\\boxed{e^{-100}\\sqrt{3+2\\sqrt{2}}}", "e^{-100}(1+\\sqrt{2})", True),  # equal at any precision
    ("\\boxed{\\frac{\\pi}{3}}", "1.0471975511966", False),          # as \sqrt{2} != 1.41421356
    # \fbox is a box (the final-answer rule read "last number" 2, OpenRLHF#1285)
    ("\\fbox{\\frac{1}{2}}", "\\frac{1}{2}", True), ("so \\boxed{3} no, \\fbox{x^2}", "x^{2}", True),
    ("\\fbox{3} no, \\boxed{4}", "4", True),
])
def test_verifier_credits_only_the_whole_answer_exactly(completion, gold, want):
    assert verify_answer(completion, gold) is want


def test_fbox_is_a_final_answer():
    assert final_answer("first \\fbox{\\frac{1}{2}} then") == "\\frac{1}{2}"
    assert final_answer("\\fbox{a{b}c}") == "a{b}c" and final_answer("\\fbox{") is None


@pytest.mark.parametrize("text", ["\\boxed{4^{", "12 then \\boxed{13", "\\boxed{4} or \\fbox{4\\sqrt{2", "#### 4\n\\boxed{4+"])
def test_a_box_never_closed_is_no_answer(text):
    assert final_answer(text) is None and verify_answer(text, "4") is False


@pytest.mark.parametrize("answer, gold, places", [
    ("x^2+1", "1+x^{2}", 15), ("10^{30}", "10^{30}+1", 15),     # math-verify's default for magnitudes >= 1
    ("10^{-30}", "2\\cdot 10^{-30}", 45),                        # 15 significant digits of 1e-30
    ("[0, 0.0000001]", "[0, 0.0000002]", 22), ("x = 3\\cdot 10^{-9}", "x", 24),
    ("10^{-10^{6}}", "2\\cdot 10^{-10^{6}}", 10_015),            # bounded: a million places took 42 s
])
def test_comparison_places_follow_the_smallest_constant(answer, gold, places):
    assert _decimal_places(*_parse(answer), *_parse(gold)) == places
