"""The planner's sequence figures (plan/sequences.py) and the trainer's use of them
(train/memory_fit.py): activation checkpointing resolved before run_start, a step that
cannot fit refused in one line, checkpointing in one process giving the same update."""

import copy
import re

import pytest
import torch
from test_trainer import MODEL, _batch
from transformers import Qwen3Config, Qwen3ForCausalLM

from mlperf_grpo.config.load import parse_config
from mlperf_grpo.errors import ConfigError
from mlperf_grpo.inference import slot_prefill
from mlperf_grpo.model.load import load_model
from mlperf_grpo.plan import sequences
from mlperf_grpo.plan.sequences import SequenceShape
from mlperf_grpo.train import logprobs
from mlperf_grpo.train.grpo import PGLossOptions
from mlperf_grpo.train.memory_fit import plan_step, step_shape
from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step
from mlperf_grpo.train.trainer import checkpoint_layers

TINY = {"model_type": "qwen3", "vocab_size": 50, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2}
QWEN3_1_4B = {"model_type": "qwen3", "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "tie_word_embeddings": True}
GIB = 1 << 30


def _saved_bytes(layers: int, tokens: int, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in a forward of a random Qwen3."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in TINY.items() if k not in ("model_type", "num_hidden_layers")},
                                         num_hidden_layers=layers, attn_implementation="sdpa")).train()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.model(input_ids=torch.randint(0, 50, (1, tokens)), use_cache=False)
    return sum(storages.values())


@pytest.mark.parametrize("compute_bytes", [4, 2], ids=["float32", "bfloat16"])
def test_layer_activation_bytes_are_what_autograd_saves(compute_bytes):
    # one more layer, at two lengths: the per-layer constants (weights, their bfloat16
    # copies) cancel, what is left is the layer's bytes per token, exactly
    autocast = compute_bytes == 2
    per_layer = {s: _saved_bytes(2, s, autocast) - _saved_bytes(1, s, autocast) for s in (128, 256)}
    assert (per_layer[256] - per_layer[128]) / 128 == sequences.layer_activation_bytes(TINY, compute_bytes)


def test_qwen3_1_4b_figures_by_hand():
    # 26 H + 10 q + 10 kv + 8 I + 8 heads + 4 kv_heads + 8, H = q = 2048, kv = 1024, I = 6144
    assert sequences.layer_activation_bytes(QWEN3_1_4B) == 53248 + 20480 + 10240 + 49152 + 128 + 32 + 8 == 133288
    shape = SequenceShape(pass_tokens=16384, packed=True, engine_rows=256, engine_length=1030)
    m = sequences.sequence_memory(QWEN3_1_4B, shape, checkpointing=True)
    assert m.activation_bytes == (4 * 2048 * 28 + 133288 + 12 * 2048) * 16384
    assert m.logits_bytes == 14 * 151_936 * 1766  # (2 + 12) V x one chunk of 1 GiB of float32 logits
    assert m.attention_mask_bytes == 3 * 16384**2
    assert m.kv_cache_bytes == 2 * 28 * 256 * 1024 * (1088 + 1) * 2  # columns: 1,030 rounded up to 64, + 1
    assert m.kv_cache_min_bytes == 2 * 28 * 1024 * (1088 + 1) * 2  # one row
    spare = sequences.sequence_memory(QWEN3_1_4B, SequenceShape(16384, True, 256, 1030, spare_row=True), True)
    assert spare.kv_cache_bytes == m.kv_cache_bytes * 257 // 256  # inference.prefill_graphs: a spare row
    assert sequences.LOGITS_CHUNK_BYTES == logprobs.LOGITS_CHUNK_BYTES
    assert sequences.PREFILL_WIDTH_BLOCK == slot_prefill.PREFILL_WIDTH_BLOCK
    assert sequences.PREFILL_CHUNK == slot_prefill.PREFILL_CHUNK


def test_qwen3_1_4b_prefill_bytes_by_hand():
    # a query position: 2 (4 H + 2 d + max(3 I, 6 q + 4 kv)) = 2 (8192 + 256 + 18432) bytes;
    # a row's logits and sampling: (2 + 12) V; a query-key pair's mask: 1 + 2 bytes
    token, row = 2 * 26880, 14 * 151_936
    assert sequences.prefill_bytes(QWEN3_1_4B, 256, 40) == 256 * (40 * 40 * 3 + 40 * token + row) + 40 * 40
    # 16 agent turns of up to 65,536 tokens: the larger of a 65,536-token one alone in chunks
    # of 1,024 columns (keys and values repeated over the 16 heads; 0.74 GiB, where one
    # prefill of it would hold 12 GiB of masks) and 16 of at most 1,024 tokens together
    alone = 1024 * 65536 * 3 + 1024 * token + 2 * 2048 * 2 * 65536 + row
    together = 16 * (1024 * 1024 * 3 + 1024 * token + row) + 1024**2
    assert sequences.prefill_bytes(QWEN3_1_4B, 1, 65536) == alone == 795_374_848
    assert sequences.prefill_bytes(QWEN3_1_4B, 16, 65536) == together > alone
    assert sequences.prefill_bytes(QWEN3_1_4B, 16, 1024) == together
    # with inference.prefill_graphs the rows' width is rounded up to 16 columns
    assert sequences.prefill_bytes(QWEN3_1_4B, 1, 40, spare_row=True) == 48 * 48 * 3 + 48 * token + row + 48 * 48


@pytest.mark.parametrize("prompt, new_tokens", [(40, 24), (40, 1048), (16, 48), (1, 63)])
def test_the_planned_kv_cache_holds_the_slot_decoders_rows_with_prefill_graphs(prompt, new_tokens):
    # with inference.prefill_graphs a prompt of 40 tokens fills 48 columns: 40 + 24 rounds to
    # 64 columns but the decoder needs 128; the planner's one row was 1 KB short (a
    # KVCacheBudgetError mid-run) and its all rows held one (the rest preempted)
    from test_generation import tiny_qwen3

    from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder

    model = tiny_qwen3(vocab_size=24, eos_token_id=None)
    config = {"model_type": "qwen3", **{k: getattr(model.config, k) for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
        "num_hidden_layers", "vocab_size")}}
    m = sequences.sequence_memory(config, SequenceShape(16, False, 4, prompt + new_tokens, 4, 4, True), False)
    for budget, rows in ((m.kv_cache_min_bytes, 1), (m.kv_cache_bytes, 4)):
        decoder = SlotDecoder(model, rows, 0, DecodeOptions(kv_cache_bytes=budget, prefill_graphs=True))
        decoder.generate([[5] * prompt] * rows, list(range(rows)), 1.0, 1.0, new_tokens, [])
        assert (decoder.cache_grows, decoder.preempted) == (0, 0)  # allocated at full length at once


def _config(**grpo):
    return parse_config({"model": {"path": MODEL, "dtype": "bfloat16", "device": "cuda"},
                         "grpo": {"num_prompts_per_step": 16, "first_eval_step": 1, **grpo}}, source="test")


def test_step_shape_follows_the_token_budget():
    shape = step_shape(_config(max_new_tokens=1024), longest_prompt=40, world_size=1)
    assert (shape.pass_tokens, shape.packed, shape.engine_rows, shape.engine_length) == (16384, True, 256, 1064)
    assert shape.engine_prompt == 40  # the engine prefills the prompts; an agent's turn, its whole context
    assert step_shape(_config(max_new_tokens=1024), longest_prompt=40, world_size=1, agentic=True).engine_prompt is None
    long = step_shape(_config(max_new_tokens=65000, num_prompts_per_step=1), longest_prompt=40, world_size=1)
    assert (long.pass_tokens, long.packed, long.engine_rows) == (65040, False, 16)  # one row alone
    padded = step_shape(_config(micro_batch_size=4, micro_batch_tokens=None), longest_prompt=10, world_size=2)
    assert (padded.pass_tokens, padded.packed, padded.engine_rows) == (4 * 16, False, 128)


def test_auto_checkpointing_turns_on_only_where_needed_and_a_step_that_cannot_fit_is_refused():
    config = _config(max_new_tokens=1024)
    roomy = plan_step(config, QWEN3_1_4B, 40, 1, 400 * GIB)
    assert not roomy.checkpointing and roomy.note() is None and roomy.verdict.fits
    h100 = plan_step(config, QWEN3_1_4B, 40, 1, 80 * 10**9)
    assert h100.checkpointing and "activation checkpointing on" in h100.note() and "\n" not in h100.note()
    assert h100.verdict.peak_bytes <= 80 * 10**9 - sequences.DEVICE_RESERVE_BYTES
    with pytest.raises(ConfigError) as err:
        plan_step(config, QWEN3_1_4B, 40, 1, 40 * GIB)
    line = str(err.value)
    assert "\n" not in line and "over the device's 40.0 GiB" in line and "more ranks" in line
    # 16 rows of 65k: the KV cache bounded, at least one row (7.0 GiB); the 65k-token pass
    # (27 GiB checkpointed) and 32 GiB of state do not fit 57 GiB even in turns with it
    long = _config(max_new_tokens=65_000, num_prompts_per_step=1)
    # the cache is freed while the policy trains: 32.0 + the larger of 7.0 + 0.1 and 23.5 + 3.5 (the line summed all)
    with pytest.raises(ConfigError, match=r"about 59.0 GiB .* engine \+ the larger of \(7.0 GiB engine KV cache \(one "
                                          r"row at full length.*\) \+ 0.1 GiB its largest prefill\) and \(23.5 GiB "
                                          r"activations .* \+ 3.5 GiB log-prob"):
        plan_step(long, QWEN3_1_4B, 40, 1, 60 * GIB)
    off = parse_config({"model": {"path": MODEL, "dtype": "bfloat16", "device": "cuda", "activation_checkpointing": "off"},
                        "grpo": {"num_prompts_per_step": 16, "max_new_tokens": 1024}}, source="test")
    with pytest.raises(ConfigError, match="set model.activation_checkpointing: on"):
        plan_step(off, QWEN3_1_4B, 40, 1, 80 * 10**9)
    # a pass of one 65k-token row: a lower token budget cannot split it (the remedy said to lower it)
    one_row = parse_config({"model": {"path": MODEL, "dtype": "bfloat16", "device": "cuda", "activation_checkpointing": "off"},
                            "grpo": {"num_prompts_per_step": 1, "first_eval_step": 1, "max_new_tokens": 65_000}},
                           source="test")
    with pytest.raises(ConfigError, match=r"set model.activation_checkpointing: on, or shorter rows \(lower "
                                          r"grpo.max_new_tokens: the largest pass is already one row of 65,040 tokens"):
        plan_step(one_row, QWEN3_1_4B, 40, 1, 80 * 10**9)


def test_the_engine_frees_its_cache_while_training_and_bounds_it_where_needed():
    # 16 rows of 65,040 tokens: 7.0 GiB of KV cache each, 111 GiB for all; an H100 (79.2 GiB, less 3 reserved) holds 32 GiB of state and a
    # checkpointed 65k-token pass; the cache does not fit at full length beside them, so
    # the engine keeps its 16 rows and gets the bytes left as its budget (it grows with the
    # rows' lengths and preempts rows past it): with synchronous rollouts (age 0) the cache
    # is freed while the policy trains and takes all but the state, with age 1 the next
    # generation runs during training and gets what the pass leaves
    h100 = 85_000_000_000
    for age, released in ((0, True), (1, False)):
        config = _config(max_new_tokens=65_000, num_prompts_per_step=1, max_trajectory_age_steps=age,
                         use_importance_sampling_correction=True)
        fit = plan_step(config, QWEN3_1_4B, 40, 1, h100)
        assert (fit.checkpointing, fit.release_engine_memory, fit.engine_rows) == (True, released, 256)
        v, m = fit.verdict, fit.verdict.memory
        usable = h100 - 3 * GIB
        # beside the cache: the engine's largest prefill, its 16 prompts of 40 tokens together
        assert m.prefill_bytes == sequences.prefill_bytes(QWEN3_1_4B, 16, 40) > 0
        room = usable - v.static_bytes - m.prefill_bytes - (0 if released else m.training_bytes)
        assert v.bounded and fit.kv_cache_bytes == m.kv_cache_bytes == room
        assert m.kv_cache_min_bytes == 2 * 28 * 1024 * (65_088 + 1) * 2 <= room  # one row
        full = sequences.sequence_memory(QWEN3_1_4B, v.shape, True).kv_cache_bytes
        assert full == 2 * 28 * 16 * 1024 * (65_088 + 1) * 2 > room
        generation = m.kv_cache_bytes + m.prefill_bytes
        turns = max(generation, m.training_bytes) if released else generation + m.training_bytes
        assert v.peak_bytes == v.static_bytes + turns == usable
        assert "the engine's KV cache bounded to" in fit.note() and "not all 16 rows at full length" in fit.note()
        assert ("freed while the policy trains" in fit.note()) is released
    short = plan_step(_config(max_new_tokens=1024), QWEN3_1_4B, 40, 1, h100)
    assert not short.release_engine_memory and not short.verdict.bounded  # checkpointing alone fits
    assert short.kv_cache_bytes >= short.verdict.memory.kv_cache_bytes  # every row at full length, allocated at once


def test_a_step_that_fits_only_with_synchronous_rollouts_names_that_remedy():
    # age 1 keeps the next generation's KV cache live during the training pass; one row of 65,040 tokens
    # (7.0 GiB of cache) beside the checkpointed 65k-token pass and the 1.4B state needs 66 GiB, which a
    # 65 GiB device does not hold, while age 0 takes the two in turn (59 GiB): the refusal named only
    # shorter rows, not the setting that fits
    config = _config(max_new_tokens=65_000, num_prompts_per_step=1, max_trajectory_age_steps=1,
                     use_importance_sampling_correction=True)
    with pytest.raises(ConfigError, match=r"about 66.0 GiB .* reserve: set grpo.max_trajectory_age_steps: 0 \(open "
                                          r"division: .* and the step fits\), or ") as err:
        plan_step(config, QWEN3_1_4B, 40, 1, 65 * GIB)
    assert "\n" not in str(err.value)
    synchronous = plan_step(_config(max_new_tokens=65_000, num_prompts_per_step=1), QWEN3_1_4B, 40, 1, 65 * GIB)
    assert synchronous.release_engine_memory and synchronous.verdict.fits
    with pytest.raises(ConfigError) as err:  # where neither fits, the setting is not offered
        plan_step(config, QWEN3_1_4B, 40, 1, 60 * GIB)
    assert "max_trajectory_age_steps" not in str(err.value)


def test_nothing_is_planned_off_cuda_and_on_or_off_is_as_asked():
    for asked, expected in (("auto", False), ("on", True), ("off", False)):
        config = parse_config({"model": {"activation_checkpointing": asked}}, source="test")
        assert plan_step(config, QWEN3_1_4B, 40, 1, None).checkpointing is expected


def test_a_model_whose_sequences_are_not_planned_says_so_on_cuda_in_one_line():
    # before: on CUDA a Mistral (or the benchmark's qwen3_5_moe) left auto checkpointing off,
    # kept the KV cache while training and checked nothing, without a word
    mistral = dict(QWEN3_1_4B, model_type="mistral")
    for asked, on in (("auto", False), ("on", True), ("off", False)):
        config = parse_config({"model": {"activation_checkpointing": asked}}, source="test")
        fit = plan_step(config, mistral, 40, 1, 80 * GIB)
        assert fit.checkpointing is on and fit.kv_cache_bytes is None and not fit.release_engine_memory
        note = fit.note()
        assert "model_type 'mistral' are not planned" in note and "\n" not in note
        assert ("auto is off" in note) is (asked == "auto")
        assert plan_step(config, mistral, 40, 1, None).note() is None  # off CUDA nothing is planned anyway
    assert plan_step(_config(), QWEN3_1_4B, 40, 1, 400 * GIB).note() is None  # planned and roomy: silent


def test_the_old_distributed_key_says_where_it_moved():
    with pytest.raises(ConfigError, match="moved to model.activation_checkpointing"):
        parse_config({"distributed": {"activation_checkpointing": True}}, source="test")


@pytest.mark.parametrize("tokens", [None, 200])
def test_activation_checkpointing_in_one_process_gives_the_same_update(tokens):
    batch = _batch()
    base = load_model(MODEL, "float32")
    updates = []
    for checkpointing in (False, True):
        policy = copy.deepcopy(base)
        if checkpointing:
            checkpoint_layers(policy)
            assert all(layer.gradient_checkpointing for layer in policy.model.layers)
        opt = torch.optim.SGD(policy.parameters(), lr=1.0)
        optimize_step(policy, opt, batch, OptimizeSettings(16, 1.0, PGLossOptions(), 1e9, micro_batch_tokens=tokens))
        updates.append({n: p.detach().clone() for n, p in policy.named_parameters()})
    for name in updates[0]:  # the recomputed forward is the same float32 arithmetic
        torch.testing.assert_close(updates[0][name], updates[1][name], rtol=0, atol=0)


def test_checkpointing_a_model_transformers_cannot_checkpoint_is_one_line():
    # was transformers' ValueError, exit 1, after the run directory line
    from transformers import JetMoeConfig, JetMoeForCausalLM

    policy = JetMoeForCausalLM(JetMoeConfig(vocab_size=15, hidden_size=16, num_hidden_layers=1, num_key_value_heads=2,
                                            kv_channels=4, intermediate_size=16, num_local_experts=2,
                                            num_experts_per_tok=1))
    with pytest.raises(ConfigError, match="^model.activation_checkpointing: JetMoeForCausalLM does not support "
                                          "activation checkpointing .*set model.activation_checkpointing: off"):
        checkpoint_layers(policy)


def test_plan_memory_gives_the_sequences_for_a_trajectory_length(tmp_path, capsys):
    import json

    from mlperf_grpo.cli import main

    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_1_4B, "max_position_embeddings": 65536}))
    argv = ["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "1", "--trajectory-tokens", "65536",
            "--rows", "16"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)["sequences"]
    shape = SequenceShape(65536, False, 16, 65536)
    assert out["checkpointing"] == sequences.sequence_memory(QWEN3_1_4B, shape, True).to_json()
    assert out["no_checkpointing"]["kv_cache_bytes"] == 2 * 28 * 16 * 1024 * 65537 * 2
    # the engine's largest prefill, counted as a 65,536-token prompt (an agent turn)
    memory = sequences.sequence_memory(QWEN3_1_4B, shape, True)
    assert out["checkpointing"]["prefill_bytes"] == memory.prefill_bytes == sequences.prefill_bytes(QWEN3_1_4B, 16, 65536)
    static = out["static_device_bytes"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert ("sequences: passes of 65,536 tokens (one row), the engine decoding 16 rows of 65,536 (prompts of up to "
            "65,536)") in text
    lines = {line[:38].strip(): line.split()[-1] for line in text.splitlines() if line.startswith("  ")}
    assert lines["engine prefill (the largest)"] == sequences.gib_cell(memory.prefill_bytes)
    # the peak the trainer judges (plan_step's fit, nothing freed) is the one printed
    verdict = sequences.fit(QWEN3_1_4B, shape, static, 1 << 50, checkpointing=True)
    assert verdict.peak_bytes == static + memory.kv_cache_bytes + memory.prefill_bytes + memory.training_bytes
    assert lines["= device peak (with all rows)"] == sequences.gib_cell(verdict.peak_bytes)
    # prompts of 40 tokens (not an agent's): the rows' prefill together, as the trainer counts it
    assert main(argv + ["--prompt-tokens", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["sequences"]
    assert out["checkpointing"]["prefill_bytes"] == sequences.prefill_bytes(QWEN3_1_4B, 16, 40) < memory.prefill_bytes
    assert main(argv + ["--prompt-tokens", "40"]) == 0
    assert "the engine decoding 16 rows of 65,536 (prompts of up to 40)" in capsys.readouterr().out
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "1", "--rows", "4"]) == 2
    assert "add --trajectory-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, named", [
    # was planned silently: rows longer than the model can attend over
    (["--trajectory-tokens", "65537"], "--trajectory-tokens 65,537 is over the model's context of 65,536 tokens"),
    # were ignored without --trajectory-tokens (and without --memory)
    (["--micro-batch-tokens", "100"], "--micro-batch-tokens sizes the sequences: add --trajectory-tokens L"),
    (["--prompt-tokens", "40"], "--prompt-tokens sizes the sequences: add --trajectory-tokens L"),
    (["--trajectory-tokens", "1024", "--prompt-tokens", "2048"], "--prompt-tokens 2,048 is over --trajectory-tokens 1,024"),
])
def test_plan_memory_refuses_sequences_it_cannot_plan_in_one_line(tmp_path, capsys, arguments, named):
    import json

    from mlperf_grpo.cli import main

    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_1_4B, "max_position_embeddings": 65536}))
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "1", *arguments]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert main(["plan", "--global-batch-size", "256", "--micro-batch-tokens", "100"]) == 2
    assert "--micro-batch-tokens belongs to plan --memory" in capsys.readouterr().err
    assert main(["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "1",
                 "--trajectory-tokens", "65536", "--micro-batch-tokens", "100"]) == 0  # at the context: planned


def test_a_step_whose_rollout_batch_cannot_fit_the_host_is_refused_before_anything_is_written(tmp_path, capsys):
    # 1e11 prompts a step spent minutes drawing prompts in step 1, then ran out of host memory
    from mlperf_grpo.cli import main
    from mlperf_grpo.plan.memory import MemoryPlanError
    from mlperf_grpo.train.memory_fit import BATCH_BYTES_PER_TOKEN, HOST_BYTES_PER_ROW, check_host_batch

    config = parse_config({"grpo": {"num_prompts_per_step": 4, "max_new_tokens": 10, "first_eval_step": 1}})
    need = 64 * (15 * BATCH_BYTES_PER_TOKEN + HOST_BYTES_PER_ROW)  # 4 x 16 rows of a 5-token prompt + 10 new tokens
    check_host_batch(config, 5, 1, host_bytes=need)
    check_host_batch(config, 5, 2, host_bytes=need // 2, ranks_on_host=1)  # a rank holds its share of the rows
    check_host_batch(config, 5, 2, host_bytes=need, ranks_on_host=2)  # two ranks on one host: both shares
    with pytest.raises(MemoryPlanError, match="for the 2 ranks on this host"):
        check_host_batch(config, 5, 2, host_bytes=need - 1, ranks_on_host=2)
    big = parse_config({"grpo": {"num_prompts_per_step": 10**6, "max_new_tokens": 10, "first_eval_step": 1}})
    with pytest.raises(MemoryPlanError, match="rollout batch of 16,000,000 rows"):  # ran the host out of memory
        check_host_batch(big, 5, 1, host_bytes=24 << 30)
    with pytest.raises(MemoryPlanError, match="rollout batch of 64 rows a rank .* lower grpo.num_prompts_per_step"):
        check_host_batch(config, 5, 1, host_bytes=need - 1, ranks_on_host=1)
    (tmp_path / "c.yaml").write_text("grpo: {num_prompts_per_step: 100000000000, first_eval_step: 1}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1,600,000,000,000 rows" in err[0] and "GiB of host memory" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["", "abc", "0", "-1", "2.5", " 2"])
def test_local_world_size_is_torchruns_alone_and_a_bad_one_is_refused_in_one_line(tmp_path, capsys, monkeypatch, value):
    # int(os.environ["LOCAL_WORLD_SIZE"]) ended a single-process train with exit 1 and
    # "invalid literal for int()", and "-1" made every step fit
    from mlperf_grpo.cli import main
    from mlperf_grpo.plan.memory import MemoryPlanError
    from mlperf_grpo.train.memory_fit import check_host_batch
    from mlperf_grpo.train.ranks import LayoutError

    config = parse_config({"grpo": {"num_prompts_per_step": 4, "max_new_tokens": 10, "first_eval_step": 1}})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    check_host_batch(config, 5, 1, host_bytes=285_184)  # one process: the variable is not read
    with pytest.raises(MemoryPlanError, match=r"needs 0.3 MiB of host memory \(24 bytes"):
        check_host_batch(config, 5, 1, host_bytes=285_183)
    (tmp_path / "c.yaml").write_text("grpo: {num_prompts_per_step: 100000000000, first_eval_step: 1}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GiB of host memory (" in err[0], err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # a torchrun rank
    with pytest.raises(LayoutError, match=f"^LOCAL_WORLD_SIZE must be .* got {re.escape(repr(value))}; launch with"):
        check_host_batch(config, 5, 1, host_bytes=1 << 40)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    check_host_batch(config, 5, 1, host_bytes=3 * 285_184)  # a rank's 64 rows: 64 x (15 x 24 + 4,096) bytes
    with pytest.raises(MemoryPlanError, match="for the 3 ranks on this host"):
        check_host_batch(config, 5, 1, host_bytes=3 * 285_184 - 1)


def test_plan_memory_checks_the_context_transformers_gives_a_config_without_one(tmp_path, capsys):
    # a config.json without max_position_embeddings was planned at any length; the trainer loads
    # it (transformers) with the model type's default context, Qwen3's 32,768
    import json

    from mlperf_grpo.cli import main
    from mlperf_grpo.model.files import context_length

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1_4B))
    assert context_length(str(tmp_path)) == (32768, "max_position_embeddings")
    plan = ["plan", "--memory", "--model-config", str(tmp_path), "--world-size", "1", "--trajectory-tokens"]
    assert main([*plan, "32769"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "over the model's context of 32,768 tokens" in err, err
    assert "the default for model_type 'qwen3', which the config leaves out" in err
    assert main([*plan, "32768"]) == 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_every_attention_call_of_a_step_leaves_cudnn_out(monkeypatch, checkpointing):
    # cuDNN's attention plans each new shape: 73 ms + 46 ms of host time a new pass width
    # on an H100; a checkpointed layer's recomputation (in backward) must pick as its forward did
    batch = _batch()
    policy = load_model(MODEL, "float32")
    if checkpointing:
        checkpoint_layers(policy)
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process's default is untouched
    optimize_step(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch,
                  OptimizeSettings(16, 1.0, PGLossOptions(), 1e9, needs_prev_logprobs=True))
    layers = policy.config.num_hidden_layers
    assert len(seen) >= layers * (2 if checkpointing else 1) and not any(cudnn for _, cudnn in seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()
