"""The agent's opening chat: a system message and the task as a user message.

The reference (NeMo-RL's Qwen3.5 benchmark README, "NeMo Gym and OpenHands
configuration") runs OpenHands' ``CodeActAgent`` through NeMo Gym with the prompt pair
``responses_api_agents/swe_agents/prompts/openhands/{system,user}_prompt.j2`` of NeMo Gym
revision ``610a08ab5fe9f8f5fb5fff36b170429ea67f0f92``, to be used byte for byte
(SHA-256 in :data:`REFERENCE_SHA256`). They are Jinja2 templates over ``instance`` (the
task row: ``problem_statement``, ``repo_language``, ``base_commit``, ...) and
``workspace_path`` (the repository inside the container, ``/testbed``); the system one
``{% include %}``s OpenHands' ``security_risk_assessment.j2``. :func:`load_templates`
reads such files (with folders to resolve includes from) and :func:`agent_messages`
renders them unchanged, with exactly those variables. Shipped here:

- ``reference``: our wording of that pair, section by section. User message: the
  repository in ``<uploaded_files>``, the issue in ``<issue_description>``, "minimal
  changes to non-test files", the eight phases (reading, running, exploration, test
  creation, fix analysis, implementation, verification, final review against the base
  commit). System message: the role, efficiency, file-system, code-quality,
  version-control, problem-solving, troubleshooting and process rules; the sections
  about pull requests, credentials, external services, installing packages,
  documentation files, the security-risk include and the ``task_tracker`` tool are left
  out (no network, nothing to install, and that tool is not among ours:
  ``agent/tools.py``).
- ``compact``: the same task in a few lines, for the tiny suite's small byte-level model
  and context.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.swe.task import SweTask

WORKSPACE_PATH = "/testbed"
"""Where the repository is inside the sandbox (R2E-Gym images; ``sandbox.inside_workdir``)."""
REFERENCE_SHA256 = {"system": "8aff26bf83a11605ca9bab0336804d56d202f1555b0a073d21db21e4e41b8b9a",
                    "user": "0b0489b934d2c229c439b7af2f588fe404a6327be9da3c12d4c7c9efd3cf1c03"}
"""SHA-256 of the reference's ``system_prompt.j2`` and ``user_prompt.j2`` (NeMo-RL README)."""


@dataclass(frozen=True)
class PromptTemplates:
    """Jinja2 sources of the system and user messages (variables ``instance``,
    ``workspace_path``); ``search_path``: folders ``{% include %}`` reads from."""

    system: str
    user: str
    search_path: tuple[str, ...] = ()

    @property
    def is_reference(self) -> bool:
        """Both sources are the reference's files, byte for byte."""
        digests = {k: hashlib.sha256(getattr(self, k).encode("utf-8")).hexdigest() for k in REFERENCE_SHA256}
        return digests == REFERENCE_SHA256


_REFERENCE_SYSTEM = """\
You are a software engineering agent that works on a computer to solve tasks: you run commands, read and edit code.

<ROLE>
Your job is to carry out the user's request by running commands, changing code and solving technical problems. \
Be thorough and systematic; quality matters more than speed.
* When the user only asks a question (for example why something happens), answer it instead of changing code.
</ROLE>

<EFFICIENCY>
* Every action has a cost. Combine several steps into one action where you can, for instance several shell \
commands joined together, or grep and sed to look at or change several files at once.
* Explore the code base with targeted tools (find, grep, git) and narrow filters.
</EFFICIENCY>

<FILE_SYSTEM_GUIDELINES>
* A path the user gives may not be relative to the working directory: find the file before working on it.
* Edit the file you were asked to edit; do not write a copy under another name, and do not keep several versions \
of one file. Delete temporary files once they have served their purpose.
* For a search-and-replace across a file, sed is often simpler than many editor calls.
</FILE_SYSTEM_GUIDELINES>

<CODE_QUALITY>
* Write clean, efficient code with few comments; do not comment what the code already says.
* Make the smallest change that solves the problem, after understanding the code around it.
* Keep imports at the top of a file unless there is a reason not to.
</CODE_QUALITY>

<VERSION_CONTROL>
* Be careful with git: nothing destructive (no force pushes, no deleted branches) unless asked.
* Use `git status` to see what you changed; keep build outputs, caches and large files out of commits.
</VERSION_CONTROL>

<PROBLEM_SOLVING_WORKFLOW>
1. Explore the relevant files and their context before proposing a solution.
2. Weigh several approaches and choose the most promising one.
3. For a bug, first write a test or script that shows it.
4. Make focused, minimal changes to existing files.
5. Verify the change, edge cases included.
</PROBLEM_SOLVING_WORKFLOW>

<TROUBLESHOOTING>
* When several attempts have failed, step back: list five to seven possible causes, judge how likely each is, \
and work through them from the most likely one, writing down your reasoning.
* When the plan runs into a major obstacle, do not work around it silently: describe a new plan.
</TROUBLESHOOTING>

<PROCESS_MANAGEMENT>
* Never stop processes by broad patterns (such as `pkill -f python`): find the exact process id first, for \
example with `ps aux`, and stop only that process.
</PROCESS_MANAGEMENT>
"""

_REFERENCE_USER = """\
<uploaded_files>
{{ workspace_path }}
</uploaded_files>

{% set language = instance.repo_language | default('python') %}
The directory {{ workspace_path }} holds a {{ language }} code repository. Here is an issue about it:

<issue_description>
{{ instance.problem_statement }}
</issue_description>

Please change the repository so that the requirements in the <issue_description> are met.
Any test changes the <issue_description> describes are already made: do not change the tests or the testing logic.
The environment is ready (all dependencies are installed); do not install packages.
Make the smallest changes to non-test files in {{ workspace_path }} that satisfy the <issue_description>.

Work in these phases:

Phase 1. READING: restate the problem clearly: the code or configuration it shows, the error messages, names \
and files it mentions, how to reproduce it, and what to keep in mind when testing and fixing it.
Phase 2. RUNNING: find out how to run the repository's tests.
Phase 3. EXPLORATION: search (for example with `grep`) for the methods, classes and messages involved, list the \
related files and choose the most likely place for the fix, saying why.
Phase 4. TEST CREATION: before fixing, write a minimal script that reproduces the issue, in the style of the \
existing tests, and run it.
Phase 5. FIX ANALYSIS: state what the problem is, where it is, how the script shows it, and how to fix it.
Phase 6. FIX IMPLEMENTATION: make minimal, focused changes to the source code.
Phase 7. VERIFICATION: run your script again, add edge cases, and run the existing tests of the code you changed.
Phase 8. FINAL REVIEW: re-read the issue{% if instance.base_commit %} and compare your changes with the base \
commit {{ instance.base_commit }}{% endif %}; make sure every requirement is met and the related tests pass, and \
revise until they do.

Be thorough in exploring, testing and reasoning: completeness matters more than brevity.
"""

_COMPACT_SYSTEM = ("You are a software engineering agent. You work in a repository by calling tools: "
                   "execute_bash runs a shell command, str_replace_editor views and edits files, finish ends the task.")

_COMPACT_USER = """\
Repository: {{ workspace_path }}
<issue_description>
{{ instance.problem_statement }}
</issue_description>
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
    return [{"role": role, "content": _render(source, templates.search_path, instance, workspace_path).strip()}
            for role, source in (("system", templates.system), ("user", templates.user))]


def load_templates(system_path: Path, user_path: Path, include_dirs: tuple[Path, ...] = ()) -> PromptTemplates:
    """Jinja2 prompt files (the reference's ``system_prompt.j2`` / ``user_prompt.j2``).

    Args:
        include_dirs: more folders for ``{% include %}`` (the reference's system prompt
            includes OpenHands' ``codeact_agent/prompts/security_risk_assessment.j2``);
            the two files' own folders are searched first.
    Raises:
        TaskError: a file that cannot be read.
    """
    texts = []
    for path in (system_path, user_path):
        try:
            texts.append(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as err:
            raise TaskError(f"cannot read swe prompt template {path}: {err}") from None
    folders = dict.fromkeys(str(p) for p in (Path(system_path).parent, Path(user_path).parent, *include_dirs))
    return PromptTemplates(texts[0], texts[1], tuple(folders))


def _render(source: str, search_path: tuple[str, ...], instance: dict, workspace_path: str) -> str:
    from jinja2 import FileSystemLoader, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        environment = ImmutableSandboxedEnvironment(loader=FileSystemLoader(list(search_path)),
                                                    keep_trailing_newline=True)
        return environment.from_string(source).render(instance=instance, workspace_path=workspace_path)
    except TemplateError as err:
        raise TaskError(f"swe prompt template does not render: {type(err).__name__}: {err}") from None
