"""Software-repair tasks (``task.name: swe``): rows, the tiny suite, prompts and grading.

The benchmark's workload (DESIGN.md, "The benchmark's workload"): an agent edits a
repository at a commit to resolve an issue; the task's hidden tests give reward 1 or 0,
and a test run cut by its timeout makes the trajectory an invalid sample (:mod:`.grade`).
"""

from mlperf_grpo.tasks.swe.grade import Grade, grade, pristine_base_files
from mlperf_grpo.tasks.swe.prompt import PromptTemplates, agent_messages, load_templates
from mlperf_grpo.tasks.swe.rows import load_swe_rows
from mlperf_grpo.tasks.swe.task import Grading, SweTask
from mlperf_grpo.tasks.swe.tiny import Edit, apply_edits, known_fix, tiny_suite

__all__ = ["Edit", "Grade", "Grading", "PromptTemplates", "SweTask", "agent_messages", "apply_edits", "grade",
           "known_fix", "load_swe_rows", "load_templates", "pristine_base_files", "tiny_suite"]
