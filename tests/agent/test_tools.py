"""The agent's tools in a real sandbox: the editor's commands, the shell tool's
observations, clipping, and the model's mistakes as error observations."""

from __future__ import annotations

import pytest
from sandbox_helpers import make_repo, require_bwrap

from mlperf_grpo.agent.tools import TOOL_SCHEMAS, ToolCall, clip, execute
from mlperf_grpo.sandbox import Sandbox, SandboxLimits

EDIT = "str_replace_editor"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    require_bwrap()
    tmp = tmp_path_factory.mktemp("tools")
    box = Sandbox(make_repo(tmp / "repo"), SandboxLimits(command_timeout_s=5), tmp / "sandboxes")
    yield box
    box.close()


def run(sandbox, name, limit=10_000, **arguments):
    return execute(ToolCall(name, arguments), sandbox, limit)


def test_schemas_name_the_reference_tools():
    names = [schema["function"]["name"] for schema in TOOL_SCHEMAS]
    assert names == ["execute_bash", "str_replace_editor", "finish"]
    editor = TOOL_SCHEMAS[1]["function"]["parameters"]
    assert set(editor["properties"]) == {"command", "path", "file_text", "old_str", "new_str", "insert_line",
                                         "view_range"}
    assert editor["required"] == ["command", "path"]


def test_view_with_line_numbers_and_a_range(sandbox):
    seen = run(sandbox, EDIT, command="view", path="/testbed/calc.py")
    assert not seen.error and "     1\tdef add(a, b):\n     2\t    return a - b\n" in seen.text
    seen = run(sandbox, EDIT, command="view", path="/testbed/calc.py", view_range=[2, -1])
    assert "     2\t    return a - b" in seen.text and "     1\t" not in seen.text
    run(sandbox, "execute_bash", command="mkdir -p a/b/c .hidden && touch a/b/c/deep.py a/b/two.py .hidden/x")
    listing = run(sandbox, EDIT, command="view", path="/testbed")
    assert "/testbed/calc.py" in listing.text and "/testbed/README" in listing.text
    assert "/testbed/a/b\n" in listing.text and "two.py" not in listing.text and ".hidden" not in listing.text
    bad = run(sandbox, EDIT, command="view", path="/testbed/calc.py", view_range=[5, 9])
    assert bad.error and "start must be in [1, 2]" in bad.text


def test_create_str_replace_and_insert_change_the_copy(sandbox):
    created = run(sandbox, EDIT, command="create", path="/testbed/pkg/new.py", file_text="a = 1\nb = 2\n")
    assert not created.error and (sandbox.workdir / "pkg" / "new.py").read_text() == "a = 1\nb = 2\n"
    again = run(sandbox, EDIT, command="create", path="/testbed/pkg/new.py", file_text="x")
    assert again.error and "already exists" in again.text
    replaced = run(sandbox, EDIT, command="str_replace", path="/testbed/calc.py", old_str="a - b", new_str="a + b")
    assert not replaced.error and "     2\t    return a + b" in replaced.text
    assert (sandbox.workdir / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    inserted = run(sandbox, EDIT, command="insert", path="pkg/new.py", insert_line=1, new_str="c = 3")
    assert not inserted.error and (sandbox.workdir / "pkg" / "new.py").read_text() == "a = 1\nc = 3\nb = 2\n"
    top = run(sandbox, EDIT, command="insert", path="/testbed/pkg/new.py", insert_line=0, new_str="# top\n")
    assert not top.error and (sandbox.workdir / "pkg" / "new.py").read_text().startswith("# top\na = 1\n")


def test_str_replace_needs_one_exact_match(sandbox):
    run(sandbox, EDIT, command="create", path="/testbed/twice.py", file_text="x = 1\nx = 1\n")
    twice = run(sandbox, EDIT, command="str_replace", path="/testbed/twice.py", old_str="x = 1", new_str="y")
    assert twice.error and "occurs 2 times" in twice.text and "[1, 2]" in twice.text
    missing = run(sandbox, EDIT, command="str_replace", path="/testbed/twice.py", old_str="zzz", new_str="y")
    assert missing.error and "does not occur" in missing.text
    assert (sandbox.workdir / "twice.py").read_text() == "x = 1\nx = 1\n"


def test_the_editor_cannot_reach_host_files_through_links(sandbox, tmp_path):
    secret = tmp_path / "secret.py"
    secret.write_text("SECRET = 1\n")
    run(sandbox, "execute_bash", command=f"ln -s {secret} leak.py")
    seen = run(sandbox, EDIT, command="view", path="/testbed/leak.py")
    assert seen.error and "SECRET" not in seen.text
    wrote = run(sandbox, EDIT, command="str_replace", path="/testbed/leak.py", old_str="SECRET", new_str="X")
    assert wrote.error and secret.read_text() == "SECRET = 1\n"


def test_repository_modules_named_like_the_standard_library_do_not_break_the_editor(sandbox):
    """The editor runs with /testbed as its working folder: without ``python3 -I`` a
    repository's own ``json.py`` (or ``re.py``, ``enum.py``) was imported in its place."""
    shadows = "json.py re.py enum.py functools.py types.py".split()
    for name in shadows:
        run(sandbox, EDIT, command="create", path=f"/testbed/{name}", file_text="raise SystemExit('shadowed')\n")
    try:
        seen = run(sandbox, EDIT, command="view", path="/testbed/calc.py")
        assert not seen.error and "def add(a, b):" in seen.text, seen.text
    finally:
        run(sandbox, "execute_bash", command="rm -f " + " ".join(shadows))


def test_files_that_are_not_utf8_text_are_shown_but_not_edited(sandbox):
    (sandbox.workdir / "latin1.py").write_bytes(b"name = 'caf\xe9'\n")
    seen = run(sandbox, EDIT, command="view", path="/testbed/latin1.py")
    assert not seen.error and "caf\ufffd" in seen.text
    edit = run(sandbox, EDIT, command="str_replace", path="/testbed/latin1.py", old_str="name", new_str="n")
    assert edit.error and "not UTF-8" in edit.text
    assert (sandbox.workdir / "latin1.py").read_bytes() == b"name = 'caf\xe9'\n"
    binary = run(sandbox, EDIT, command="view", path="/usr/bin/true")
    assert binary.error and "binary" in binary.text


def test_commands_reading_stdin_get_end_of_file(sandbox):
    result = run(sandbox, "execute_bash", command="cat; read line; python3; echo done")
    assert result.text == "done\n[The command completed with exit code 0.]"


def test_bad_calls_are_error_observations(sandbox):
    cases = [
        (ToolCall("rm_rf", {}), "unknown tool 'rm_rf'"),
        (ToolCall(EDIT, {"command": "view"}), "missing required argument 'path'"),
        (ToolCall(EDIT, {"command": "delete", "path": "/testbed"}), "must be one of view, create"),
        (ToolCall(EDIT, {"command": "insert", "path": "/testbed/calc.py", "insert_line": "2", "new_str": "x"}),
         "'insert_line' must be a integer"),
        (ToolCall(EDIT, {"command": "insert", "path": "/testbed/calc.py", "insert_line": 99, "new_str": "x"}),
         "Invalid `insert_line` 99"),
        (ToolCall(EDIT, {"command": "view", "path": "/testbed/nope.py"}), "does not exist"),
        (ToolCall(EDIT, {"command": "create", "path": "/testbed/x.py"}), "needs `file_text`"),
        (ToolCall("execute_bash", {"command": "ls", "timeout": 5}), "unknown argument 'timeout'"),
        (ToolCall("execute_bash", {"command": "  "}), "empty command"),
        (ToolCall("execute_bash", {"command": "echo a\x00b"}), "holds a NUL character"),
        (ToolCall("execute_bash", {"command": "true " + "#" * 140_000}), "140005 bytes, over the 131071"),  # E2BIG
        (ToolCall(EDIT, {"command": "create", "path": "/testbed/s.py", "file_text": "x = '\ud800'"}),
         "not valid Unicode"),
    ]
    for call, message in cases:
        observation = execute(call, sandbox, 10_000)
        assert observation.error and not observation.finished and message in observation.text, (call, observation)


def test_shell_observations_say_how_the_command_ended(sandbox):
    done = run(sandbox, "execute_bash", command="echo hi; exit 3")
    assert done.text == "hi\n[The command completed with exit code 3.]" and not done.error
    slow = run(sandbox, "execute_bash", command="sleep 30")
    assert slow.text == "[The command was killed after 5 seconds (timeout).]"
    finish = run(sandbox, "finish", message="fixed")
    assert finish.finished and finish.text == "fixed"


def test_long_observations_are_clipped_in_the_middle(sandbox):
    long = run(sandbox, "execute_bash", limit=300, command="seq 1 5000")
    assert len(long.text) <= 300 and long.text.startswith("1\n2\n") and "<response clipped:" in long.text
    assert long.text.endswith("[The command completed with exit code 0.]")
    text = "".join(chr(65 + i % 26) for i in range(1000))
    assert clip(text, 1000) == text
    for limit in (999, 200, 120):
        clipped = clip(text, limit)
        head, rest = clipped.split("\n<response clipped: ", 1)
        cut, tail = rest.split(" characters of 1000 left out here>\n")
        assert len(clipped) <= limit and text.startswith(head) and text.endswith(tail)
        assert int(cut) == 1000 - len(head) - len(tail) and abs(len(head) - len(tail)) <= 1
