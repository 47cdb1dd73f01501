"""The math final-answer rule: which part of a completion is its answer, and how it is compared.

A reward must judge the final answer only: for ``12+34=`` with gold 46, neither ``99=46``
nor ``12+34`` may score (``math-verify`` alone reduces an equation to its right-hand side
and evaluates expressions, so it scored both 1.0). Tasks whose answers are free text (a
JSONL/GSM8K task) use the rule here; a task with a stricter format (``arithmetic``) defines
its own final answer and may reuse :func:`answers_match`.

Final answer of free text, :func:`final_answer`, the first that applies:

1. the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (braces balanced; one never
   closed, ``\\boxed{4^{``, gives no answer: rule 4 read 4 in it);
2. the text after the last ``####`` up to the end of its line (GSM8K), less the sentence
   punctuation (``.``, ``,``, ``;``, ``:``, ``?``; not ``!``, a factorial) that ends it: ``#### 72.`` and ``#### 72,``
   give ``72``, as the GSM8K references extract it (openai/grade-school-math
   ``grade_school_math/dataset.py``: ``ANS_RE = r"#### (\\-?[0-9\\.\\,]+)"`` with the
   commas removed; EleutherAI lm-evaluation-harness ``lm_eval/tasks/gsm8k/gsm8k.yaml``:
   the same regex, and ``regexes_to_ignore`` ``","`` and ``"\\.$"``: a final period
   ignored). ``#### 72.5`` stays ``72.5`` and ``#### 1,000`` ``1,000``;
3. the whole text, when it is one number (``-12``, ``1,000``, ``2.50``, ``3/4``,
   ``\\frac{3}{4}``; ``$...$`` around it allowed);
4. the last number in the text.

Comparison, :func:`answers_match`: when both the answer and the gold are numbers (forms as
in 3), they are compared **exactly** as rationals (``0.5 == 1/2 == \\frac{1}{2}``, but
``0.1234567 != 0.1234568``: no float tolerance). A number against a symbolic form
(``\\sqrt{4}``) is equal only when their difference simplifies to 0 (``sympy``), so
``\\sqrt{2} != 1.41421356``. Two symbolic answers (``x^2+1``) are parsed and compared by
``math_verify``. Symbolic answers
must be boxed (or follow ``####``); rule 4 reads only numbers.

Two ways ``math-verify``'s defaults credit a wrong answer, closed here:

- **A parse that drops part of the answer.** ``parse``'s default extractors include a
  plain-expression one that, where the LaTeX parse fails, picks a number out of the
  formula: ``4\\sqrt(2)`` (not valid LaTeX) parsed as 4 (huggingface/Math-Verify#41).
  The answer is already isolated, so it is parsed as LaTeX only, with no fallback to the
  raw string: an answer the LaTeX parser cannot read whole is wrong.
- **An absolute tolerance.** ``verify`` rounds floats to ``float_rounding`` decimal places
  (6) and counts a difference whose ``evalf(numeric_precision)`` (15 digits) chops to 0
  as equal, so ``10^{-30}`` equalled ``2\\cdot 10^{-30}``, in an interval's end or an
  equation's side too. Both are set from the smallest nonzero constant in either answer
  (:func:`_decimal_places`): 15 significant digits of it, a relative tolerance of about
  ``1e-15`` down to magnitudes of ``1e-10000``.

``math-verify``'s own timeouts use ``signal.alarm``, which only works in the main
thread, so they are turned off here; bound the time of a call from outside
(:mod:`mlperf_grpo.tasks.scoring` runs rewards in worker processes it can kill).
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from functools import lru_cache

import sympy
from math_verify import LatexExtractionConfig, parse, verify

from mlperf_grpo.tasks.base import Task

# math-verify warns on every call that its signal-based timeout is off; we turn it off
# on purpose (see above), so keep only its errors.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_INTEGER = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)"
_DECIMAL = rf"{_INTEGER}(?:\.\d+)?|[+-]?\.\d+"
_NUMBER = re.compile(rf"^(?:(?P<num>{_INTEGER})\s*/\s*(?P<den>{_INTEGER})|(?P<dec>{_DECIMAL})"
                     rf"|\\[dt]?frac\{{\s*(?P<fnum>{_INTEGER})\s*\}}\{{\s*(?P<fden>{_INTEGER})\s*\}})$")
_NUMBER_IN_TEXT = re.compile(rf"(?<![\w.])(?:{_INTEGER}(?:\.\d+)?)(?![\w])")
_GSM8K_MARK = "####"
_SENTENCE_END = ".,;:?"
"""Punctuation that ends a sentence after a ``####`` answer, never part of it."""
_BOXED = re.compile(r"\\(?:boxed|fbox)\{")
_LATEX_ONLY = (LatexExtractionConfig(),)
_SIGNIFICANT_DIGITS = 15
"""Digits of the smallest constant that must agree (``math-verify``'s default 15, made relative)."""
_MAX_DECIMAL_PLACES = 10_015
"""Bound on the places (and the cost): constants below ``1e-10000`` compare to ``1e-10015``
absolutely. Measured on a loaded 2-core machine: ``10^{-10000}`` against
``2\\cdot 10^{-10000}`` 0.05-1 s; ``10^{-10^{6}}`` unbounded (a million places) 42 s, past
the reward timeout, and 0.3 s bounded."""


def as_number(text: str) -> Fraction | None:
    """The exact value of ``text`` when it is one number, else None.

    Accepted: integers (``-12``, ``1,000`` with thousands separators), decimals
    (``2.50``, ``.5``), fractions ``a/b`` and ``\\frac{a}{b}`` (``\\dfrac``, ``\\tfrac``),
    optionally inside ``$...$`` and surrounded by spaces. A zero denominator is not a number.
    """
    text = text.strip()
    if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text.strip("$").strip()
    match = _NUMBER.match(text)
    if not match:
        return None
    groups = {k: (v.replace(",", "") if v else v) for k, v in match.groupdict().items()}
    if groups["dec"] is not None:
        return Fraction(groups["dec"])
    num, den = (groups["num"], groups["den"]) if groups["num"] is not None else (groups["fnum"], groups["fden"])
    return None if int(den) == 0 else Fraction(int(num), int(den))


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}``; None without one, ``""``
    when it is not closed (a completion cut inside its box has no answer)."""
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    depth, i = 0, starts[-1].end() - 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return ""


def final_answer(text: str) -> str | None:
    """The final answer of a free-text completion by the rule in the module docstring.

    Returns:
        The answer's text (stripped), or None when the completion has none.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed or None
    if _GSM8K_MARK in text:
        after = text.rsplit(_GSM8K_MARK, 1)[1].strip().splitlines()
        answer = after[0].strip().rstrip(_SENTENCE_END).rstrip() if after else ""
        return answer or None
    if as_number(text) is not None:
        return text.strip().strip("$").strip()
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else None


@lru_cache(maxsize=65536)
def _parse(text: str) -> tuple:
    return tuple(parse(f"${text}$", extraction_config=_LATEX_ONLY, fallback_mode="no_fallback", parsing_timeout=None))


def _decimal_places(*parsed: object) -> int:
    """Decimal places for ``math_verify.verify``'s ``float_rounding`` and ``numeric_precision``:
    :data:`_SIGNIFICANT_DIGITS` significant digits of the smallest nonzero finite constant
    (a sub-expression without free symbols) in ``parsed``; at least 15, at most
    :data:`_MAX_DECIMAL_PLACES`.

    ``10^{-30}`` against ``2\\cdot 10^{-30}``: 45 places, so their difference (1e-30) is no
    longer rounded to 0 (with the default 15 it was).
    """
    smallest_exponent = 0
    for expression in parsed:
        if not isinstance(expression, sympy.Basic):
            continue
        for node in sympy.preorder_traversal(expression):
            if not (isinstance(node, sympy.Expr) and node.is_number):
                continue
            magnitude = abs(node.evalf(_SIGNIFICANT_DIGITS))
            if magnitude.is_Float and magnitude.is_finite and not magnitude.is_zero:
                smallest_exponent = min(smallest_exponent, int(sympy.floor(sympy.log(magnitude, 10))))
    return min(_SIGNIFICANT_DIGITS - smallest_exponent, _MAX_DECIMAL_PLACES)


def answers_match(answer: str, gold: str) -> bool:
    """True when a final ``answer`` equals ``gold``: exactly for numbers, else by math-verify.

    Two numbers (see :func:`as_number`) compare as exact rationals. Otherwise both are
    parsed as LaTeX by ``math_verify.parse`` and compared by ``math_verify.verify``
    (symbolic equality, numbers to 15 significant digits: :func:`_decimal_places`); an
    answer the LaTeX parser cannot read whole is wrong. This call may take long on
    adversarial input (``9^{9^{9}}``): bound it from outside.
    """
    answer_value, gold_value = as_number(answer), as_number(gold)
    if answer_value is not None and gold_value is not None:
        return answer_value == gold_value
    parsed = _parse(answer)
    if not parsed:
        return False
    if answer_value is not None or gold_value is not None:  # a number against a symbolic form
        value = answer_value if answer_value is not None else gold_value
        expression = (_parse(gold) if answer_value is not None else parsed)[:1]
        return bool(expression) and _equals_exactly(expression[0], value)
    gold_parsed = _parse(gold)
    places = _decimal_places(*gold_parsed, *parsed)
    return bool(verify(list(gold_parsed), list(parsed), float_rounding=places, numeric_precision=places,
                       timeout_seconds=None))


def _equals_exactly(expression: object, value: Fraction) -> bool:
    """``expression - value`` simplifies to 0 (no float rounding: ``\\sqrt{2} != 1.41421356``)."""
    if not isinstance(expression, sympy.Expr):
        return False
    return sympy.simplify(expression - sympy.Rational(value.numerator, value.denominator)) == 0


def verify_answer(completion: str, gold: str) -> bool:
    """True when the final answer of free text ``completion`` (:func:`final_answer`) equals ``gold``."""
    answer = final_answer(completion)
    return answer is not None and answers_match(answer, gold)


def math_reward(completion: str, task: Task) -> float:
    """1.0 when the free-text ``completion``'s final answer equals ``task.answer``, else 0.0.

    The reward of a free-text math task (module-level, so a scoring worker can import it).
    """
    return 1.0 if verify_answer(completion, task.answer) else 0.0
