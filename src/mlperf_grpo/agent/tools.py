"""The agent's tools: their schemas (what the model is shown) and their execution in the
trajectory's sandbox. Torch-free.

The reference's agent is OpenHands' CodeAct agent as NeMo Gym runs it on R2E-Gym tasks
(``responses_api_agents/swe_agents`` in NVIDIA-NeMo/Gym); its tools are
``execute_bash`` (``command``), ``str_replace_editor`` (``command`` view | create |
str_replace | insert | undo_edit, ``path``, ``file_text``, ``old_str``, ``new_str``,
``insert_line``, ``view_range``) and ``finish`` (``message``): OpenHands
``openhands/agenthub/codeact_agent/tools/{bash,str_replace_editor,finish}.py``; R2E-Gym's
own editor (``src/r2egym/agenthub/tools/str_replace_editor.py``) takes the same parameters
and by default leaves ``undo_edit`` out. We keep those names, parameters and types and
say what our implementation does in the descriptions. Deviations: no ``is_input`` (each
command is its own process tree, as R2E-Gym's runtime runs each as its own ``docker exec``
under ``timeout`` (``src/r2egym/agenthub/runtime/docker.py``): nothing keeps running
between commands to send input to; the working directory resets to /testbed for each
command, files persist), no
``undo_edit`` (R2E-Gym's default set), no ``safety_risk`` (OpenHands' confirmation mode).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.sandbox import MAX_COMMAND_BYTES, CommandResult, Sandbox

EXECUTE_BASH, STR_REPLACE_EDITOR, FINISH = "execute_bash", "str_replace_editor", "finish"
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert")
EDITOR_SCRIPT = (Path(__file__).parent / "editor_inside.py").read_text()
EDITOR_REFUSED_EXIT = 3
CLIPPED = "\n<response clipped: {cut} characters of {total} left out here>\n"
"""Marker put where an observation was cut (its head and tail are kept)."""


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }}


TOOL_SCHEMAS: list[dict] = [
    _function(EXECUTE_BASH, (
        "Execute a bash command in the repository's sandbox (working directory /testbed).\n"
        "* Each call runs in a fresh shell: files persist between calls, the working directory, "
        "environment variables and background processes do not.\n"
        "* A command is killed after 60 seconds; there is no network.\n"
        "* One command per call; chain several with `&&` or `;`.\n"
        "* Long output is clipped in the middle."
    ), {"command": {"type": "string", "description": "The bash command to execute."}}, ["command"]),
    _function(STR_REPLACE_EDITOR, (
        "Custom editing tool for viewing, creating and editing files.\n"
        "* If `path` is a file, `view` displays the result of applying `cat -n`. If `path` is a directory, "
        "`view` lists non-hidden files and directories up to 2 levels deep.\n"
        "* The `create` command cannot be used if the specified `path` already exists.\n"
        "* Long output is clipped and marked with `<response clipped>`.\n"
        "Notes for the `str_replace` command:\n"
        "* `old_str` must match EXACTLY one or more consecutive lines of the file, whitespace included.\n"
        "* If `old_str` is not unique in the file, no replacement is made: include enough context to make it unique.\n"
        "* `new_str` holds the edited lines that replace `old_str`."
    ), {
        "command": {"type": "string", "enum": list(EDITOR_COMMANDS),
                    "description": "The command to run: `view`, `create`, `str_replace` or `insert`."},
        "path": {"type": "string", "description": "Absolute path to a file or directory, e.g. `/testbed/file.py` or `/testbed`."},
        "file_text": {"type": "string", "description": "Required for `create`: the content of the file to create."},
        "old_str": {"type": "string", "description": "Required for `str_replace`: the text in `path` to replace."},
        "new_str": {"type": "string", "description": (
            "Optional for `str_replace`: the replacement text (none: `old_str` is deleted). "
            "Required for `insert`: the text to insert.")},
        "insert_line": {"type": "integer", "description": (
            "Required for `insert`: `new_str` is inserted AFTER line `insert_line` of `path` (0: at the top).")},
        "view_range": {"type": "array", "items": {"type": "integer"}, "description": (
            "Optional for `view` of a file: the line range to show, e.g. [11, 12] shows lines 11 and 12; "
            "lines count from 1; [start_line, -1] shows from start_line to the end.")},
    }, ["command", "path"]),
    _function(FINISH, (
        "Signals that the task is done (or cannot be done): the trajectory ends and the repository's "
        "final state is graded."
    ), {"message": {"type": "string", "description": "A short summary of what was done."}}, []),
]
"""OpenAI-style function schemas of the three tools, in the order the prompt lists them."""

_SCHEMA_BY_NAME = {schema["function"]["name"]: schema["function"]["parameters"] for schema in TOOL_SCHEMAS}
_JSON_TYPES = {"string": (str,), "integer": (int,), "array": (list,), "boolean": (bool,)}


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model wrote: the tool's name and its arguments (typed by the parser)."""

    name: str
    arguments: dict[str, object]


@dataclass(frozen=True)
class Observation:
    """What goes back to the model. finished: the call was ``finish``. error: the call was
    refused (unknown tool, bad arguments, the editor refused) or the tool failed."""

    text: str
    finished: bool = False
    error: bool = False


def clip(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters, else its head and tail around
    :data:`CLIPPED` so that the whole has at most ``max_chars`` characters (the marker's
    length counts; a limit below the marker's length keeps the marker only)."""
    if len(text) <= max_chars:
        return text
    marker = CLIPPED.format(cut=len(text), total=len(text))
    room = max(0, max_chars - len(marker))
    head, tail = room - room // 2, room // 2
    marker = CLIPPED.format(cut=len(text) - head - tail, total=len(text))
    return text[:head] + marker + (text[len(text) - tail:] if tail else "")


def argument_errors(call: ToolCall) -> list[str]:
    """What is wrong with ``call`` against its schema (unknown tool, missing, unknown or
    mistyped arguments); empty when it is well-formed."""
    schema = _SCHEMA_BY_NAME.get(call.name)
    if schema is None:
        return [f"unknown tool {call.name!r}; the tools are {', '.join(_SCHEMA_BY_NAME)}"]
    if not isinstance(call.arguments, dict):
        return [f"the arguments of {call.name} must be an object"]
    properties = schema["properties"]
    errors = [f"missing required argument {name!r}" for name in schema["required"] if name not in call.arguments]
    for name, value in call.arguments.items():
        spec = properties.get(name)
        if spec is None:
            errors.append(f"unknown argument {name!r}; {call.name} takes {', '.join(properties)}")
            continue
        types = _JSON_TYPES[spec["type"]]
        if not isinstance(value, types) or (spec["type"] == "integer" and isinstance(value, bool)):
            errors.append(f"argument {name!r} must be a {spec['type']}, got {type(value).__name__}")
        elif "enum" in spec and value not in spec["enum"]:
            errors.append(f"argument {name!r} must be one of {', '.join(spec['enum'])}, got {value!r}")
        elif spec["type"] == "array" and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            errors.append(f"argument {name!r} must be a list of integers")
        elif spec["type"] == "string" and not _is_text(value):
            errors.append(f"argument {name!r} holds a NUL character or text that is not valid Unicode")
    return errors


def _is_text(value: str) -> bool:
    """No NUL (a command line cannot carry one) and encodable as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


def execute(call: ToolCall, sandbox: Sandbox, max_observation_chars: int) -> Observation:
    """Run ``call`` in ``sandbox``; the observation's text has at most
    ``max_observation_chars`` characters (:func:`clip`). Never raises for the model's
    mistakes: they come back as ``Observation(error=True)`` with a message it can read."""
    errors = argument_errors(call)
    if errors:
        return Observation(clip(f"ERROR: {'; '.join(errors)}.", max_observation_chars), error=True)
    if call.name == FINISH:
        return Observation(str(call.arguments.get("message", "")), finished=True)
    if call.name == EXECUTE_BASH:
        command = str(call.arguments["command"])
        if not command.strip():
            return Observation("ERROR: empty command.", error=True)
        size = len(command.encode("utf-8"))
        if size > MAX_COMMAND_BYTES:
            return Observation(f"ERROR: the command is {size} bytes, over the {MAX_COMMAND_BYTES} a command line "
                               "holds; write a long script to a file with str_replace_editor create, then run it.",
                               error=True)
        return Observation(clip(format_command_result(sandbox.run(command), sandbox), max_observation_chars))
    return _edit(call, sandbox, max_observation_chars)


def format_command_result(result: CommandResult, sandbox: Sandbox) -> str:
    """The shell tool's observation: the output, then one line on how the command ended."""
    text = result.output
    if result.kill_reason == "timeout":
        end = f"[The command was killed after {sandbox.limits.command_timeout_s:g} seconds (timeout).]"
    elif result.kill_reason == "output":
        end = (f"[The command was killed: it wrote more than {sandbox.limits.output_drain_bytes} bytes "
               "of output.]")
    elif result.kill_reason == "disk":
        end = "[The command was killed: the disk is nearly full. Remove large files you made.]"
    elif result.kill_reason:
        end = f"[The command was killed ({result.kill_reason}).]"
    else:
        end = f"[The command completed with exit code {result.exit_code}.]"
    return f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{end}"


def _edit(call: ToolCall, sandbox: Sandbox, max_observation_chars: int) -> Observation:
    """The editor runs inside the sandbox (``editor_inside.py``): links resolve there."""
    request = json.dumps(call.arguments).encode("utf-8")
    quoted = "'" + EDITOR_SCRIPT.replace("'", "'\"'\"'") + "'"
    command = (f"if command -v python3 >/dev/null; then exec python3 -I -c {quoted}; "
               f"else exec python -I -c {quoted}; fi")
    result = sandbox.run(command, input_bytes=request)
    if result.exit_code == 0:
        return Observation(clip(result.output, max_observation_chars))
    if result.exit_code == EDITOR_REFUSED_EXIT:
        return Observation(clip(result.output.strip(), max_observation_chars), error=True)
    return Observation(clip("ERROR: the editor failed:\n" + format_command_result(result, sandbox),
                            max_observation_chars), error=True)
