"""Benchmarks given bad arguments: one line on stderr naming them, exit 2, no traceback
(benchmarks/attention_backends.py used to raise from inside generation on ``--rows 0``;
benchmarks/evaluate.py from the config parser on ``--checkpoints 0``, and from torch's
lazy CUDA init on ``--device cuda`` without CUDA)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script, arguments, named", [
    ("attention_backends.py", ["--rows", "0"], "--rows"),
    ("agent.py", ["--trajectories", "0", "--tool-threads", "0"], "--trajectories 0, --tool-threads 0"),
    ("agent.py", ["--params", "inf"], "--params inf"),
    ("attention_backends.py", ["--params", "-5"], "--params"),
    ("evaluate.py", ["--checkpoints", "0", "--tasks", "-3"], "--checkpoints 0, --tasks -3"),
    ("evaluate.py", ["--top-p-candidates", "-1"], "--top-p-candidates -1"),
    ("sampler.py", ["--candidates", "0"], "--candidates"),
    ("generation.py", ["--top-p-candidates", "0"], "--top-p-candidates"),
    ("sampler.py", ["--top-p", "1.0"], "--top-p"),
    ("decode_step.py", ["--batch", "0", "--new-tokens", "1"], "--batch 0, --new-tokens 1"),
    ("decode_step.py", ["--batch", "x"], "argument --batch: invalid int value: 'x'"),  # argparse's: no usage block
    ("generation.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("sampler.py", ["--dtype", "int8"], "argument --dtype: invalid choice"),
    ("decode_step.py", ["--params", "nan"], "--params nan"),  # was accepted: a 16-layer model of hidden 256
    ("decode_step.py", ["--params", "inf"], "--params inf"),  # config_for_params looped forever
    ("decode_step.py", ["--hidden", "100"], "--hidden 100"),  # head_dim 25: a RoPE traceback
    ("generation.py", ["--params", "inf"], "--params inf"),
    ("kv_growth.py", ["--budget-fraction", "1"], "--budget-fraction 1: must be in (0, 1)"),
    ("kv_growth.py", ["--rows", "0"], "--rows, --prompt-tokens"),
    ("generation.py", ["--params", "-5"], "--params -5"),
    # a KVCacheBudgetError traceback after two arms had run
    ("kv_growth.py", ["--budget-fraction", "0.01"], "--budget-fraction 0.01: 13,148 bytes hold no row at full length"),
    # tracebacks from int(), the config parser or the model's embedding, after building the model
    ("long_sequences.py", ["--cases", "16x"], "--cases 16x: must be ROWSxNEW_TOKENS"),
    ("long_sequences.py", ["--cases", "20x64"], "--cases 20x64"),
    ("long_sequences.py", ["--cases", "1x64"], "--cases 1x64"),
    ("long_sequences.py", ["--cases", "16x64", "--real", "32x64"], "--real 32x64: not among --cases"),
    ("long_sequences.py", ["--vocab", "0"], "--vocab 0: must hold the built-in tokenizer's"),
    # a RuntimeError traceback: the embedding of 1e14 ids was allocated
    ("long_sequences.py", ["--vocab", "99999999999999"], "--vocab 99,999,999,999,999: must hold"),
    ("long_sequences.py", ["--context", "40"], "--context 40"),
    ("long_sequences.py", ["--steps", "0"], "--steps 0, --train-rows 2"),
    ("evaluate.py", ["--params", "inf"], "--params inf"),  # an OverflowError traceback
    ("evaluate.py", ["--dir", "missing"], "--dir missing is not a directory"),  # tracebacks, these three
    ("evaluate.py", ["--run", "."], "--run . is not a trained run directory (no mlperf.log, config.yaml, checkpoints)"),
    ("evaluate.py", ["--keep", "/proc/version/kept"], "--keep /proc/version/kept: cannot write there"),
    ("evaluate.py", ["--dir", "/proc"], "--dir /proc: cannot make a folder there"),  # os.access says yes to root
    ("weight_copies.py", ["--steps", "3"], "--steps must be >= 4"),
    ("grpo_step.py", ["--repeat", "0", "--steps", "1"], "--repeat 0, --steps 1"),  # a StatisticsError traceback
    ("grpo_step.py", ["--also-steps", "1", "--also-micro-batch-size", "0"], "--also-micro-batch-size 0, --also-steps 1"),
    ("grpo_step.py", ["--max-new-tokens", "100000", "--no-trl"], "over the model's context"),  # a ConfigError one
    ("grpo_step.py", ["--model", "/nonexistent", "--no-trl"], "not a local Hugging Face model directory"),
    pytest.param("evaluate.py", ["--device", "cuda"], "no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_benchmark_arguments_are_one_line_exit_2(tmp_path, script, arguments, named):
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--device", "cpu", *arguments],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1 and named in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing made


def test_kv_growth_benchmark_grows_and_bounds_the_cache(tmp_path):
    """The smallest run: one JSON line; the grown arm gives the full arm's tokens with
    less KV cache (8 rows of which a few run long), the bounded arm stays in its budget
    (its rows run in other batches: the same tokens only up to float rounding over a
    151,936-id vocabulary of nearly equal probabilities)."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "kv_growth.py"), "--rows", "8", "--new-tokens", "128",
                           "--mean-tokens", "16"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["full"]["cache_grows"] == 0 and line["grown"]["cache_grows"] > 0
    assert line["grown"]["identical"] == 1.0
    for arm in ("grown", "bounded"):
        assert line[arm]["kv_peak_ratio"] < 1 and line[arm]["kv_cache_peak_bytes"] <= line[arm]["budget_bytes"]


def test_decode_step_benchmark_prints_every_section(tmp_path):
    """The smallest run: one JSON line on stdout with the proxy, the baseline and the parts."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "decode_step.py"), "--batch", "2", "--new-tokens", "3",
                           "--key-length", "8", "--profile-top", "2", "--variants"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["baseline"]["tokens_per_s"] > 0 and line["proxy"]["tokens_per_s"] > 0
    assert line["baseline"]["proxy_ratio"] == round(line["baseline"]["tokens_per_s"] / line["proxy"]["tokens_per_s"], 3)
    assert set(line["parts_ms"]) == {"key_length", "forward", "output_head", "sample_training",
                                     "sample_training_by_blocks", "sample_validation", "sample_validation_64_candidates"}
    assert len(line["profile"]["top_ms_per_step"]) == 2


def test_generation_benchmark_adds_the_cache_reads_to_the_proxy(tmp_path):
    """generation.py's kv_floor: a step's cache bytes counted from the model's shape (2
    layers x 2 KV heads x head_dim 16, float32: K and V are 512 bytes a column; each of
    the 2 rows has 4 tokens, the prefill's and 3 decode steps over 32 + 1, 2, 3 columns),
    and a floor below the GEMM-only proxy by exactly those reads."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "generation.py"), "--batch", "2", "--new-tokens", "4",
                           "--layers", "2", "--hidden", "64"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    floor = line["kv_floor"]
    per_token_bytes = 512 * (3 * 32 + 1 + 2 + 3) / 4
    assert floor["kv_bytes_per_step"] == int(per_token_bytes * 2)
    assert floor["kv_ms_per_step"] == pytest.approx(per_token_bytes * 2 / (floor["read_bandwidth_gb_s"] * 1e9) * 1e3,
                                                    rel=0.01, abs=0.0011)  # rounded to 0.1 GB/s and 1 us
    per_token_s = line["proxy"]["step_ms"] / 1e3 / 2 + floor["kv_ms_per_step"] / 1e3 / 2
    assert floor["floor_tokens_per_s"] == pytest.approx(1 / per_token_s, rel=0.01)
    assert line["floor_ratio"] == round(line["tokens_per_s"] / floor["floor_tokens_per_s"], 3)


def test_grpo_step_benchmark_measures_each_decode_arm_with_its_engine(tmp_path):
    """--decode generate slots: ours trains once per arm, each arm's engines decode as
    named (their describe() says so), with a rollout speedup per arm; --overlong-filtering
    off: every row trained."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "grpo_step.py"), "--no-trl", "--steps", "2", "--decode",
                           "generate", "slots", "--num-prompts-per-step", "2", "--micro-batch-size", "8",
                           "--max-new-tokens", "8", "--max-trajectory-age-steps", "0", "--overlong-filtering", "off"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.splitlines()[-1])
    arms = line["decode_arms"]
    assert arms["generate"]["engine"] == ["transformers.generate"]
    assert arms["slots"]["engine"] == ["slot decoder (KV cache grown to the rows' lengths, refilled slots)"]
    assert set(line["rollout_speedup"]) == {"generate", "slots"} and line["rollout_speedup"]["generate"] == 1.0
    (compared,) = line["comparisons"]  # every row trained, those that hit the 8 tokens too
    assert not compared["overlong_filtering"] and compared["ours_rows_trained"] == 32


def test_grpo_step_benchmark_compares_a_longer_length_and_profiles_the_update(tmp_path):
    """--also-new-tokens T: ours trained again with every completion T tokens long (no
    EOS), reported under ``longer``; --profile-update: the last update's regions, four
    micro-batches of a GBS-32 batch at micro-batch 8."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "grpo_step.py"), "--no-trl", "--steps", "2",
                           "--num-prompts-per-step", "2", "--micro-batch-size", "8", "--max-new-tokens", "4",
                           "--also-new-tokens", "6", "--profile-update"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.splitlines()[-1])
    assert line["max_new_tokens"] == 4 and line["longer"]["max_new_tokens"] == 6 and line["longer"]["ignore_eos"]
    assert line["longer"]["ours_step_s"] > 0 and line["longer"]["trl_step_s"] is None
    default, longer = line["comparisons"]  # side by side; the longer one with --also-steps 2: one step measured
    assert (default["max_new_tokens"], default["steps_measured_per_side"]) == (4, 1)
    assert (longer["max_new_tokens"], longer["ignore_eos"], longer["steps_measured_per_side"]) == (6, True, 1)
    assert longer["ours_step_s"] == line["longer"]["ours_step_s"] and longer["speedup"] is None
    assert not longer["overlong_filtering"] and longer["ours_rows_trained"] == 32  # no row left out: none ends by itself
    profile = line["update_profile"]
    assert profile["optimize_step"]["count"] == 1 and profile["micro_batch"]["count"] == 4
    assert profile["clip_grad_norm"]["count"] == 1 and profile["optimizer_step"]["count"] == 1


def test_update_ops_benchmark_counts_the_operations_of_each_pass(tmp_path):
    """The smallest run: 16 rows at micro-batch 8 are 2 passes; the eager policy is its own baseline."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "update_ops.py"), "--prompts", "1", "--micro-batch-size",
                           "8", "--top", "3"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["passes"] == 2 and line["compute_ops_per_pass"] > 0 and line["compute_ops"] > 2 * 100
    assert line["compute_ops_per_pass_over_eager"] == 1.0 and len(line["top_compute_ops_per_pass"]) == 3
    assert line["entropy"] > 0 and line["compute_ops_per_pass_over_baseline"] is None


def test_weight_copies_benchmark_alternates_the_arms(tmp_path):
    """The smallest run: steps 3 and 5 with autocast's casts, 4 with the copies (steps 1 and 2 compile)."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "weight_copies.py"), "--steps", "5",
                           "--num-prompts-per-step", "2", "--micro-batch-size", "8"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["steps_with_copies"] == [2, 4]
    assert [len(line["update_s"][arm]) for arm in ("copies", "autocast")] == [1, 2]
    medians = {arm: statistics.median(times) for arm, times in line["update_s"].items()}
    assert line["ratio"] == round(medians["copies"] / medians["autocast"], 3)
