"""parse_tool_calls: the Qwen3 XML tool-call syntax, several calls a turn, schema types,
malformed input as an error the model reads."""

from __future__ import annotations

import pytest

from mlperf_grpo.agent.parser import CallError, ToolCall, parse_tool_calls

SCHEMAS = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "editor", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "path": {"type": "string"}, "insert_line": {"type": "integer"},
        "view_range": {"type": "array"}, "dry_run": {"type": "boolean"}, "scale": {"type": "number"},
        "options": {"type": "object"}}}}},
    {"name": "finish", "parameters": {"type": "object", "properties": {}}},  # the inner function object works too
]


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_one_call_with_text_before_it():
    turn = parse_tool_calls("Let me look.\n\n" + call("bash", command="ls -la"), SCHEMAS)
    assert turn.content == "Let me look."
    assert turn.calls == [ToolCall("bash", {"command": "ls -la"})]


def test_several_calls_in_one_turn_in_order():
    text = call("bash", command="cat a.py") + "\n" + call("editor", command="view", path="/testbed/a.py") + "\n" + call("finish")
    assert parse_tool_calls(text, SCHEMAS).calls == [
        ToolCall("bash", {"command": "cat a.py"}),
        ToolCall("editor", {"command": "view", "path": "/testbed/a.py"}),
        ToolCall("finish", {}),
    ]


def test_arguments_are_typed_by_the_schema_and_strings_keep_inner_newlines():
    text = call("editor", command="insert", path="a.py", insert_line="12", view_range="[3, -1]", dry_run="False",
                scale="2.5", options='{"a": 1}')
    (parsed,) = parse_tool_calls(text, SCHEMAS).calls
    assert parsed.arguments == {"command": "insert", "path": "a.py", "insert_line": 12, "view_range": [3, -1],
                                "dry_run": False, "scale": 2.5, "options": {"a": 1}}
    code = "def f():\n    return 1\n\n"
    (parsed,) = parse_tool_calls(call("bash", command=code), SCHEMAS).calls
    assert parsed.arguments["command"] == code  # one leading and one trailing newline dropped, no more


def test_an_unclosed_last_call_and_parameters_without_their_closing_tag_parse():
    text = "<tool_call>\n<function=editor>\n<parameter=command>\nview\n<parameter=path>\na.py\n</function>"
    assert parse_tool_calls(text, SCHEMAS).calls == [ToolCall("editor", {"command": "view", "path": "a.py"})]


def test_bare_function_blocks_without_tool_call_tags_parse():
    text = "<function=bash>\n<parameter=command>\npwd\n</parameter>\n</function>"
    assert parse_tool_calls(text, SCHEMAS).calls == [ToolCall("bash", {"command": "pwd"})]


def test_a_turn_without_calls_is_content_only():
    turn = parse_tool_calls("  I think the bug is in a.py.  ", SCHEMAS)
    assert turn.content == "I think the bug is in a.py." and turn.calls == []


@pytest.mark.parametrize(("text", "words"), [
    (call("editor", command="insert", insert_line="twelve"), "insert_line of editor: 'twelve' is not an integer"),
    (call("editor", view_range="3-5"), "view_range of editor: '3-5' is not a JSON array"),
    (call("editor", dry_run="maybe"), "'maybe' is not true or false"),
    (call("rm_rf", path="/"), "unknown tool 'rm_rf'; the tools are: bash, editor, finish"),
    ("<tool_call>\nbash ls\n</tool_call>", "tool call without <function=NAME>"),
    ("<tool_call>\n<function=bash\n</function>\n</tool_call>", "the name must end with '>'"),
])
def test_malformed_calls_are_errors_the_model_reads_not_exceptions(text, words):
    turn = parse_tool_calls("ok " + text + "\n" + call("finish"), SCHEMAS)
    assert isinstance(turn.calls[0], CallError) and words in turn.calls[0].message
    assert turn.calls[1] == ToolCall("finish", {})  # the next call of the turn still parses


def test_null_is_none_except_for_a_string():
    (parsed,) = parse_tool_calls(call("editor", insert_line="null", command="null"), SCHEMAS).calls
    assert parsed.arguments == {"insert_line": None, "command": "null"}
