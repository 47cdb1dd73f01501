"""Direct tests of step_dirs.py: the checkpoint directory names, their patterns, and the
published steps of a checkpoint root (names only; a ``tmp_step_N/`` is not published)."""

import pytest

from mlperf_grpo.step_dirs import CHECKPOINT_DIR, published_steps, step_dir_name, step_of, tmp_step_dir_name


@pytest.mark.parametrize("step", [0, 7, 18, 1000])
def test_names_round_trip_through_their_pattern(step):
    assert step_dir_name(step) == f"step_{step}" and step_of(step_dir_name(step)) == step
    assert tmp_step_dir_name(step) == f"tmp_step_{step}" and step_of(tmp_step_dir_name(step)) is None
    assert CHECKPOINT_DIR.match(step_dir_name(step)) and CHECKPOINT_DIR.match(tmp_step_dir_name(step))


@pytest.mark.parametrize("name", ["step_", "step_1a", "step_-1", "step_1/", "xstep_1", "step_1.bak", "Step_1", "step_ 1", "step_1\n"])
def test_other_names_are_not_checkpoints(name):
    assert step_of(name) is None and not CHECKPOINT_DIR.match(name)


def test_published_steps_are_the_step_directories_in_numeric_order(tmp_path):
    root = tmp_path / "checkpoints"
    assert published_steps(root) == []  # absent
    for name in ("step_9", "step_10", "step_100", "tmp_step_101", "step_x"):
        (root / name).mkdir(parents=True)
    (root / "step_11").write_text("a file, not a checkpoint")
    assert published_steps(root) == [9, 10, 100]  # numeric, not by name ("step_10" < "step_9")
