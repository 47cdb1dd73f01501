"""`mlperf-grpo run` under torchrun with a tensor-parallel ``hf`` engine (2 ranks, T = 2:
one engine split over both, each rank writing its share of every checkpoint, one
evaluation worker spanning both ranks) against the same run in one process at T = 1."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import ENV, TORCHRUN
from test_tensor_parallel import _training_model_dir

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import read_log

pytestmark = pytest.mark.slow

CONFIG = """\
model: {{path: {model}}}
grpo: {{num_prompts_per_step: 4, num_generations_per_prompt: 4, max_steps: 3, micro_batch_size: 4, first_eval_step: 2}}
validation: {{generations_per_task: 4, temperature: 1.0, top_p: 1.0}}
task: {{num_train_tasks: 64}}
inference: {{tensor_parallel_size: {t}}}
"""


def _accuracies(log) -> list:
    return [(e.metadata["samples_count"], e.value) for e in read_log(log).events if e.key == "eval_accuracy"]


def test_a_t2_run_under_torchrun_trains_writes_and_evaluates_what_one_process_at_t1_does(tmp_path):
    model = _training_model_dir(tmp_path)
    for t in (1, 2):
        (tmp_path / f"t{t}.yaml").write_text(CONFIG.format(model=model, t=t))
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["run", "--config", str(tmp_path / "t1.yaml"), "--output", str(one), "--retain-checkpoints"]) == 0
    proc = subprocess.run([*TORCHRUN, "run", "--config", str(tmp_path / "t2.yaml"), "--output", str(two),
                           "--retain-checkpoints"], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _accuracies(two / "mlperf.log") == _accuracies(one / "mlperf.log")
    stops = [[(e.value, e.metadata) for e in read_log(run / "mlperf.log").events if e.key == "run_stop"] for run in (one, two)]
    assert len(stops[1]) == 1 and stops[1] == stops[0]  # the same verdict at the same step
    for result in sorted((two / "eval").glob("step_*.jsonl")):  # one worker of 2 ranks, each reading its share
        header = json.loads(result.read_text().splitlines()[0])
        assert header["refit_check"] == "fingerprint+canary"  # the fingerprint summed over the group
        assert header["engine"]["tensor_parallel_size"] == 2
    for step in ("step_2", "step_3"):
        files = sorted((two / "checkpoints" / step).glob("*.safetensors"))
        assert len(files) == 2  # one file from each rank
        theirs = {k: v for f in files for k, v in load_file(f).items()}
        ours = {k: v for f in sorted((one / "checkpoints" / step).glob("*.safetensors")) for k, v in load_file(f).items()}
        assert theirs.keys() == ours.keys()  # tied embeddings stored once in both
        for key in ours:  # the same training in exact arithmetic: FSDP's 2-way reductions reorder float32 sums
            torch.testing.assert_close(theirs[key], ours[key], rtol=0, atol=1e-6)
