"""Software-repair tasks (``task.name: swe``): rows, the tiny suite, prompts and grading.

The benchmark's workload (DESIGN.md, "The benchmark's workload"): an agent edits a
repository at a commit to resolve an issue; the task's hidden tests give reward 1 or 0.
"""

from mlperf_grpo.tasks.swe.grade import Grade, grade
from mlperf_grpo.tasks.swe.task import Grading, SweTask
from mlperf_grpo.tasks.swe.tiny import Edit, apply_edits, known_fix, tiny_suite

__all__ = ["Edit", "Grade", "Grading", "SweTask", "apply_edits", "grade", "known_fix", "tiny_suite"]
