"""Answer checking with ``math-verify`` (Hugging Face), safe to call from any thread.

``math-verify``'s own timeouts use ``signal.alarm``, which only works in the main
thread, so they are turned off here; our answers are short, so parsing is bounded.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from math_verify import parse, verify

# math-verify warns on every call that its signal-based timeout is off; we turn it off
# on purpose (see above), so keep only its errors.
logging.getLogger("math_verify").setLevel(logging.ERROR)


@lru_cache(maxsize=65536)
def _parse(text: str) -> tuple:
    return tuple(parse(text, parsing_timeout=None))


def verify_answer(completion: str, gold: str) -> bool:
    """True when the final answer in ``completion`` is mathematically equal to ``gold``.

    Both strings are parsed by ``math_verify.parse`` (LaTeX and plain numbers; the last
    number of free text) and compared by ``math_verify.verify``. A completion with no
    parsable answer is wrong.
    """
    answer = _parse(completion)
    if not answer:
        return False
    return bool(verify(list(_parse(gold)), list(answer), timeout_seconds=None))
