"""Sandboxes for model-written commands: one per trajectory, with its own writable copy of
the task's repository, no network, resource limits, and nothing left behind. Torch-free."""

from mlperf_grpo.sandbox.leftovers import cleanup_leftovers, root_problem
from mlperf_grpo.sandbox.limits import MAX_COMMAND_BYTES, CommandResult, SandboxLimits
from mlperf_grpo.sandbox.sandbox import INSIDE_WORKDIR, Sandbox, backend_name, close_all

__all__ = ["CommandResult", "INSIDE_WORKDIR", "MAX_COMMAND_BYTES", "Sandbox", "SandboxLimits", "backend_name",
           "cleanup_leftovers", "close_all", "root_problem"]
