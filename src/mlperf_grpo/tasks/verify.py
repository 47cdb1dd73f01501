"""The math final-answer rule: which part of a completion is its answer, and how it is compared.

A reward must judge the final answer only: for ``12+34=`` with gold 46, neither ``99=46``
nor ``12+34`` may score (``math-verify`` alone reduces an equation to its right-hand side
and evaluates expressions, so it scored both 1.0). Tasks whose answers are free text (a
JSONL/GSM8K task) use the rule here; a task with a stricter format (``arithmetic``) defines
its own final answer and may reuse :func:`answers_match`.

Final answer of free text, :func:`final_answer`, the first that applies:

1. the content of the last ``\\boxed{...}`` (braces balanced);
2. the text after the last ``####`` up to the end of its line (GSM8K);
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
from math_verify import parse, verify

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
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None  # unbalanced: no answer


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
        return after[0].strip() if after and after[0].strip() else None
    if as_number(text) is not None:
        return text.strip().strip("$").strip()
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else None


@lru_cache(maxsize=65536)
def _parse(text: str) -> tuple:
    return tuple(parse(f"${text}$", parsing_timeout=None))


def answers_match(answer: str, gold: str) -> bool:
    """True when a final ``answer`` equals ``gold``: exactly for numbers, else by math-verify.

    Two numbers (see :func:`as_number`) compare as exact rationals. Otherwise both are
    parsed as LaTeX by ``math_verify.parse`` and compared by ``math_verify.verify``
    (symbolic equality); an answer it cannot parse is wrong. This call may take long on
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
    return bool(verify(list(_parse(gold)), list(parsed), timeout_seconds=None))


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
