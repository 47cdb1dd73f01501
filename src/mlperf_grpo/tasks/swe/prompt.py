"""The agent's opening chat: a system message and the task as a user message.

The reference runs OpenHands' CodeAct agent through NeMo Gym with the prompt pair of
``responses_api_agents/swe_agents/prompts/openhands/{system,user}_prompt.j2`` (selected by
``configs/swebench_openhands_training.yaml``'s ``agent_prompt_overrides``). They are Jinja2
templates over ``instance`` (the task row: ``problem_statement``, ``repo_language``, ...)
and ``workspace_path`` (the repository inside the container, ``/testbed`` for R2E-Gym
images). :func:`agent_messages` renders templates with exactly those variables, so the
reference's own files can be used unchanged (:func:`load_templates`). Shipped here:

- ``reference``: our wording of the reference pair, section by section (the system
  message's role, efficiency, troubleshooting and process rules; the user message's
  issue in ``<issue_details>``, the path in ``<workspace_path>`` and the eight-step
  workflow). The reference's ``task_tracker`` section is left out: that tool is not
  among ours (``agent/tools.py``: ``execute_bash``, ``str_replace_editor``, ``finish``).
- ``compact``: the same task in a few lines, for the tiny suite's small byte-level model
  and context.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.swe.task import SweTask

WORKSPACE_PATH = "/testbed"
"""Where the repository is inside the sandbox (R2E-Gym images; ``sandbox.inside_workdir``)."""


@dataclass(frozen=True)
class PromptTemplates:
    """Jinja2 sources of the system and user messages (variables ``instance``, ``workspace_path``)."""

    system: str
    user: str


_REFERENCE_SYSTEM = """\
You are a software engineering agent: you solve tasks by running commands, reading and editing code in a computer.

<ROLE>
Your job is to carry out the user's request by executing commands, changing code and solving technical problems. \
Be careful and systematic; quality matters more than speed.
* When the user only asks a question (for example why something happens), answer it instead of changing code.
</ROLE>

<EFFICIENCY>
* Every action has a cost. Combine several steps into one action where you can, for instance several shell \
commands joined together, or grep and sed to look at or change several files at once.
* Explore the code base with targeted tools (find, grep, git) and narrow filters.
</EFFICIENCY>

<TROUBLESHOOTING>
* When several attempts have failed, stop and list five to seven possible causes, judge how likely each is, and \
work through them from the most likely one, writing down your reasoning.
* When the plan runs into a major obstacle, do not work around it silently: describe a new plan.
</TROUBLESHOOTING>

<PROCESS_MANAGEMENT>
* Never stop processes by broad patterns (such as `pkill -f python`); find the exact process id first and stop \
only that process.
</PROCESS_MANAGEMENT>
"""

_REFERENCE_USER = """\
Make the changes to the repository ( {{ workspace_path }} ) that the requirements in <issue_details> ask for.
Everything the repository needs is already installed; do not install other packages.

I've uploaded a {{ instance.repo_language | default('') }} repository in the directory {{ workspace_path }}.

<issue_details>
{{ instance.problem_statement }}
</issue_details>

<workspace_path>
{{ workspace_path }}
</workspace_path>

A good way to fix a bug:
1. Explore the code: find the files and functions involved, understand how they work, which behaviour and \
edge cases are expected, and what may cause the issue.
2. Reproduce the issue: write a small script that shows the wrong behaviour and asserts the right one, and run it.
3. Find the root cause: weigh several possible fixes and pick the simplest correct one; read the existing tests \
to learn the expected behaviour.
4. Implement the fix with focused changes in the style of the code base.
5. Verify: run your script again until it passes.
6. Run the relevant existing unit tests; do not change existing tests.
7. Try edge cases and refine the fix if one fails.
8. Check with `git status` that only the intended changes are left: restore unrelated files and delete \
temporary ones before you finish.
"""

_COMPACT_SYSTEM = ("You are a software engineering agent. You work in a repository by calling tools: "
                   "execute_bash runs a shell command, str_replace_editor views and edits files, finish ends the task.")

_COMPACT_USER = """\
Repository: {{ workspace_path }}
<issue_details>
{{ instance.problem_statement }}
</issue_details>
Fix the issue by editing the source code (not the tests), then call finish.
"""

STYLES = {"reference": PromptTemplates(_REFERENCE_SYSTEM, _REFERENCE_USER),
          "compact": PromptTemplates(_COMPACT_SYSTEM, _COMPACT_USER)}
"""The shipped prompt styles (module docstring)."""


def agent_messages(task: SweTask, workspace_path: str = WORKSPACE_PATH,
                   templates: PromptTemplates | str = "reference") -> list[dict]:
    """``[{"role": "system", ...}, {"role": "user", ...}]`` opening ``task``'s trajectory.

    Args:
        workspace_path: the repository as the sandboxed commands see it.
        templates: a style name of :data:`STYLES` or user templates (:func:`load_templates`).
    Raises:
        TaskError: an unknown style, or a template that does not render.
    """
    if isinstance(templates, str):
        if templates not in STYLES:
            raise TaskError(f"unknown swe prompt style {templates!r}; use one of {', '.join(STYLES)}")
        templates = STYLES[templates]
    instance = {**task.metadata, "instance_id": task.task_id, "problem_statement": task.problem_statement}
    return [{"role": "system", "content": _render(templates.system, instance, workspace_path).strip()},
            {"role": "user", "content": _render(templates.user, instance, workspace_path).strip()}]


def load_templates(system_path: Path, user_path: Path) -> PromptTemplates:
    """Jinja2 prompt files (e.g. the reference's ``system_prompt.j2`` / ``user_prompt.j2``).

    Raises:
        TaskError: a file that cannot be read.
    """
    texts = []
    for path in (system_path, user_path):
        try:
            texts.append(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as err:
            raise TaskError(f"cannot read swe prompt template {path}: {err}") from None
    return PromptTemplates(*texts)


def _render(source: str, instance: dict, workspace_path: str) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        template = ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(source)
        return template.render(instance=instance, workspace_path=workspace_path)
    except TemplateError as err:
        raise TaskError(f"swe prompt template does not render: {err}") from None
