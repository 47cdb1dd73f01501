"""A stand-in for the model that writes scripted turns (tests and ``benchmarks/agent.py``):
the sandbox, tools, tests and scoring stay real, only the policy is a script.

A script is ``(task_id, turn_index, conversation_text) -> turn text``; the engine finds
each row's task by its problem statement in the conversation, encodes the turn followed
by ``<|im_end|>`` and returns it as sampled tokens with log-probability ``LOGPROB`` each.
"""

from __future__ import annotations

from collections.abc import Callable

from mlperf_grpo.inference.base import Completion, SamplingParams
from mlperf_grpo.tasks.swe import SweTask, known_fix

LOGPROB = -0.25
Script = Callable[[str, int, str], str]


def call_text(name: str, **arguments: object) -> str:
    """One call in the Qwen3 XML syntax, as the chat template writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def known_fix_script(task_id: str, turn: int, conversation: str) -> str:
    """Turn 0: look at the repository; turn 1: the task's known fix with the editor (one
    call per edit, in one turn); turn 2: finish."""
    if turn == 0:
        return "Let me look.\n" + call_text("execute_bash", command="ls -R /testbed | head -50")
    if turn == 1:
        return "\n".join(call_text("str_replace_editor", command="str_replace", path=f"/testbed/{e.path}",
                                   old_str=e.old.removesuffix("\n"), new_str=e.new.removesuffix("\n"))
                         for e in known_fix(task_id))
    return call_text("finish", message="fixed")


def do_nothing_script(task_id: str, turn: int, conversation: str) -> str:
    """Finishes at once: the repository stays at its base commit."""
    return call_text("finish", message="nothing to do")


def sleeper_script(seconds: float) -> Script:
    """Runs ``sleep seconds`` every turn and never finishes (for trajectory timeouts)."""
    def script(task_id: str, turn: int, conversation: str) -> str:
        return call_text("execute_bash", command=f"sleep {seconds:g}")
    return script


class ScriptedEngine:
    """``generate_ids`` of a scripted policy over ``tasks`` (the loop's ``TurnEngine``)."""

    def __init__(self, tokenizer, tasks: list[SweTask], script: Script) -> None:
        self.tokenizer = tokenizer
        self.tasks = tasks
        self.script = script
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate_ids(self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        out = []
        for ids in prompt_token_ids:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            task = next(t for t in self.tasks if t.problem_statement in text)
            turn = text.count("<|im_start|>assistant") - 1
            turn_ids = self.tokenizer(self.script(task.task_id, turn, text), add_special_tokens=False)["input_ids"]
            turn_ids = (turn_ids + [self.end_of_turn])[:params.max_new_tokens]
            out.append(Completion(list(ids), turn_ids, [LOGPROB] * len(turn_ids), ""))
        return out
