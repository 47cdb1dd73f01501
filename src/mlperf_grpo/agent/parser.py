"""Tool calls in a model turn, in the Qwen3.5 / Qwen3-Coder XML syntax::

    optional text
    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Read as vLLM's ``qwen3_xml`` / ``qwen3_coder`` tool parsers read it
(``vllm/entrypoints/openai/tool_parsers/qwen3coder_tool_parser.py``): every
``<tool_call>`` block of the turn is one call, in order (several per turn); a last block
left unclosed counts; a turn with ``<function=`` blocks and no ``<tool_call>`` at all is read
as its bare blocks; a parameter ends at ``</parameter>``, the next ``<parameter=`` or
``</function>``; one leading and one trailing newline of a value are dropped (the template
writes them). Values are typed by the tool's JSON schema: ``string`` as written,
``integer``/``number``, ``boolean`` (``true``/``false``), ``array``/``object`` (JSON, then a
Python literal), ``null`` -> None. Where vLLM keeps a value that does not convert as a
string, this parser reports a :class:`CallError` the model reads as the call's observation
(a malformed turn never raises).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from mlperf_grpo.agent.tools import ToolCall

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)
FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)


@dataclass(frozen=True)
class CallError:
    """A ``<tool_call>`` block that does not parse; ``message`` is the observation the
    model reads in place of the call's output."""

    message: str


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn: ``content`` (the text before the first call, stripped) and its
    ``calls`` in order, each a :class:`ToolCall` or a :class:`CallError`."""

    content: str
    calls: list[ToolCall | CallError]


def parse_tool_calls(text: str, schemas: list[dict]) -> ParsedTurn:
    """The tool calls of one model turn's decoded text (``<|im_end|>`` removed).

    Args:
        text: the turn's text.
        schemas: OpenAI-style function schemas (``{"type": "function", "function":
            {"name", "parameters": {"properties": {ARG: {"type": ...}}}}}`` or the inner
            ``function`` object); they type the arguments. A call to a name not among them
            is a :class:`CallError` naming the tools there are.
    """
    by_name = {s.get("function", s)["name"]: s.get("function", s) for s in schemas}
    start = _first_call_at(text)
    if start is None:
        return ParsedTurn(text.strip(), [])
    blocks = [m.group(1) if m.group(1) is not None else m.group(2) for m in TOOL_CALL.finditer(text)]
    if not blocks:  # bare <function=...> blocks (qwen3_coder reads the whole text then)
        blocks = [text[start:]]
    calls: list[ToolCall | CallError] = []
    for block in blocks:
        functions = list(FUNCTION.finditer(block))
        if not functions:
            calls.append(CallError("tool call without <function=NAME>: write <tool_call>\\n<function=NAME>\\n"
                                   "<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>"))
        for match in functions:
            calls.append(_call(match.group(1) if match.group(1) is not None else match.group(2), by_name))
    return ParsedTurn(text[:start].strip(), calls)


def _first_call_at(text: str) -> int | None:
    found = [i for i in (text.find("<tool_call>"), text.find("<function=")) if i >= 0]
    return min(found) if found else None


def _call(body: str, by_name: dict[str, dict]) -> ToolCall | CallError:
    name, sep, rest = body.partition(">")
    name = name.strip()
    if not sep or not name:
        return CallError("malformed <function=NAME>: the name must end with '>'")
    if name not in by_name:
        return CallError(f"unknown tool {name!r}; the tools are: {', '.join(sorted(by_name))}")
    properties = by_name[name].get("parameters", {}).get("properties", {})
    arguments: dict[str, object] = {}
    for match in PARAMETER.finditer(rest):
        arg, sep, value = match.group(1).partition(">")
        arg = arg.strip()
        if not sep or not arg:
            return CallError(f"malformed <parameter=NAME> in a call to {name}: the name must end with '>'")
        value = value.removeprefix("\n").removesuffix("\n")
        typed = _typed(value, properties.get(arg, {}).get("type", "string"))
        if isinstance(typed, CallError):
            return CallError(f"parameter {arg} of {name}: {typed.message}")
        arguments[arg] = typed
    return ToolCall(name, arguments)


def _typed(value: str, kind: object) -> object:
    """``value`` converted to the JSON-schema ``kind`` (a name or a list of names)."""
    kinds = kind if isinstance(kind, list) else [kind]
    if value.strip().lower() == "null" and ("string" not in kinds or "null" in kinds):
        return None
    if any(k in ("string", "str", "text") for k in kinds):
        return value
    k = str(kinds[0])
    text = value.strip()
    if k in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            return CallError(f"{text!r} is not an integer")
    if k in ("number", "float"):
        try:
            number = float(text)
        except ValueError:
            return CallError(f"{text!r} is not a number")
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    if k in ("boolean", "bool"):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        return CallError(f"{text!r} is not true or false")
    if k in ("array", "object"):
        expected = list if k == "array" else dict
        for load in (json.loads, ast.literal_eval):
            try:
                parsed = load(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(parsed, expected):
                return parsed
        return CallError(f"{text!r} is not a JSON {k}")
    return value
