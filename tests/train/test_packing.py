"""Token-budget micro-batches (train/packing.py): packed rows attend only within
themselves, and a step of packed micro-batches is the one-big-batch step."""

import copy

import pytest
import torch
import yaml
from test_trainer import MODEL, _batch

from mlperf_grpo.cli import main
from mlperf_grpo.model.load import load_model
from mlperf_grpo.train.grpo import PGLossOptions, token_logprobs
from mlperf_grpo.train.logprobs import policy_token_logprobs
from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step
from mlperf_grpo.train.packing import MicroBatch, packed_inputs, split_to_count, token_budget_micro_batches


def test_token_budget_micro_batches_by_hand():
    lengths = [5, 4, 3, 9, 2, 2, 12]
    kept = [True, True, False, True, True, True, True]
    assert token_budget_micro_batches(lengths, kept, 10) == [
        MicroBatch((0, 1)), MicroBatch((3,)), MicroBatch((4, 5)), MicroBatch((6,))]  # 12 > 10: alone
    assert token_budget_micro_batches(lengths, kept, 100, max_rows=2) == [
        MicroBatch((0, 1)), MicroBatch((3, 4)), MicroBatch((5, 6))]
    assert token_budget_micro_batches(lengths, [False] * 7, 10) == []
    # padded (packing never): rows x the longest within the budget; summed, [10, 1, 1, 1]
    # would be one pass of 13 tokens padded to 40
    long_and_short = [10, 1, 1, 1, 9, 2]
    assert token_budget_micro_batches(long_and_short, [True] * 6, 20) == [
        MicroBatch((0, 1, 2, 3)), MicroBatch((4, 5))]
    assert token_budget_micro_batches(long_and_short, [True] * 6, 20, padded=True) == [
        MicroBatch((0, 1)), MicroBatch((2, 3)), MicroBatch((4, 5))]


def test_split_to_count_cuts_the_largest_and_never_grows_a_pass():
    lengths = [4, 4, 4, 4, 1, 1]
    micro = [MicroBatch((0, 1, 2, 3)), MicroBatch((4, 5))]
    split = split_to_count(micro, lengths, 4)
    # 16 tokens cut at half (8 | 8), then the larger of the two 8-token halves (4 | 4)
    assert split == [MicroBatch((0,)), MicroBatch((1,)), MicroBatch((2, 3)), MicroBatch((4, 5))]
    assert split_to_count([MicroBatch((2,))], lengths, 3) == [
        MicroBatch((2,)), MicroBatch((0,), empty=True), MicroBatch((0,), empty=True)]
    assert split_to_count(micro, lengths, 2) == micro


def test_packed_rows_attend_only_within_themselves():
    # a row's packed log-probs equal its own unpacked ones, and changing every token of
    # the other rows changes none of them (block-diagonal attention, positions from 0)
    torch.manual_seed(0)
    policy = load_model(MODEL, "float32")
    v = policy.config.vocab_size
    lengths = torch.tensor([5, 9, 3, 7])
    ids = torch.randint(0, v, (4, 9))
    score = torch.arange(8).unsqueeze(0) < (lengths - 1).unsqueeze(1)  # every next token of each row
    results = []
    for other in (ids, torch.randint(0, v, (4, 9))):
        mixed = other.clone()
        mixed[1] = ids[1]  # row 1 fixed, the others drawn anew
        packed = packed_inputs(mixed, lengths, score, width_multiple=8)
        assert packed.input_ids.shape[1] == 24 and packed.position_ids[0, :5].tolist() == list(range(5))
        with torch.no_grad():
            flat, _ = policy_token_logprobs(policy, packed.targets, 1.0, 4, input_ids=packed.input_ids,
                                            position_ids=packed.position_ids, logits_to_keep=packed.select,
                                            use_cache=False)
        results.append(torch.zeros(score.shape).masked_scatter(packed.padded_select, flat[0]))
        for r in range(4):  # each row alone (its own forward, no padding inside its length)
            n = int(lengths[r]) - 1
            own = token_logprobs(policy(input_ids=mixed[r:r + 1, :n + 1]).logits[:, :-1], mixed[r:r + 1, 1:n + 1], 1.0)
            torch.testing.assert_close(results[-1][r, :n], own[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-6)
    assert not torch.allclose(results[0][0], results[1][0], atol=1e-3)  # the redrawn rows did change


def _update(policy, batch, **settings):
    policy = copy.deepcopy(policy)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    result = optimize_step(policy, opt, batch, OptimizeSettings(
        settings.pop("micro", None), 1.0, settings.pop("options", PGLossOptions()), 1e9, **settings))
    return result, {n: p.detach() - before[n] for n, p in policy.named_parameters()}


def _assert_same_update(a, b):
    (ra, ua), (rb, ub) = a, b
    assert ra.num_valid_tokens == rb.num_valid_tokens and ra.num_valid_sequences == rb.num_valid_sequences
    assert abs(ra.loss - rb.loss) < 1e-6
    assert abs(ra.entropy_mean - rb.entropy_mean) < 1e-6 and ra.entropy_mean > 0  # the packed positions' too
    for name in ua:  # float32 sums of the same terms in another order (as the accumulation test)
        torch.testing.assert_close(ua[name], ub[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget", [30, 200, 100_000])
def test_packed_micro_batches_give_the_one_big_batch_update(budget):
    batch = _batch()
    policy = load_model(MODEL, "float32")
    whole = _update(policy, batch, micro=64)
    for packing in ("always", "auto", "never"):
        _assert_same_update(whole, _update(policy, batch, micro_batch_tokens=budget, packing=packing))
    aligned = _update(policy, batch, micro_batch_tokens=budget, width_multiple=8, packing="always")  # compiled
    _assert_same_update(whole, aligned)
    for packing in ("auto", "never"):  # compiled widths, the passes cut so that rounded up they keep the budget
        _assert_same_update(whole, _update(policy, batch, micro_batch_tokens=budget, width_multiple=8, packing=packing))


def test_packing_with_an_arbitrary_completion_mask_and_dropped_rows():
    # multi-turn rows: the loss reads holes-and-islands patterns, not a suffix; rows the
    # overlong filter drops are not run, and the update is the padded one-big-batch one's
    batch = _batch()
    torch.manual_seed(3)
    holes = (torch.rand(batch.completion_mask.shape) < 0.7).float()
    batch.completion_mask = batch.completion_mask * holes
    batch.sample_mask = (torch.rand(batch.sample_mask.shape) < 0.8).float()
    policy = load_model(MODEL, "float32")
    options = PGLossOptions(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                            truncated_importance_sampling_ratio=1.5, truncated_importance_sampling_ratio_min=0.5)
    common = dict(options=options, needs_prev_logprobs=True, seq_logprob_error_threshold=2.0)
    _assert_same_update(_update(policy, batch, micro=128, **common),
                        _update(policy, batch, micro_batch_tokens=60, packing="always", **common))


def test_bf16_packed_update_is_as_close_to_float32_as_the_padded_one():
    # bfloat16 rounding already moves the padded update ~3% from the float32 one (its
    # own error, measured here); packing must not add to it beyond a quarter of that
    batch = _batch()
    policy = load_model(MODEL, "float32")

    def flat(update):
        return torch.cat([u.flatten() for u in update[1].values()])

    exact = flat(_update(policy, batch, micro=64))
    padded = flat(_update(policy, batch, micro=16, compute_dtype=torch.bfloat16))
    packed = flat(_update(policy, batch, micro_batch_tokens=100, compute_dtype=torch.bfloat16, packing="always"))
    assert (packed - exact).norm() <= 1.25 * (padded - exact).norm() < 0.05 * exact.norm()


def test_two_prompts_a_step_train_with_the_default_micro_batches(tmp_path):
    # before: the default micro_batch_size 64 refused GBS 32 ("must divide the global batch size")
    config = {"grpo": {"num_prompts_per_step": 2, "max_steps": 1, "first_eval_step": 1}, "validation": {"num_tasks": 20}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path / "r")]) == 0
    from mlperf_grpo.logs.mllog import read_log

    (stats,) = [e.value for e in read_log(tmp_path / "r" / "mlperf.log").find("tracked_stats")]
    assert 0 < stats["entropy"] < 3  # nats: at most ln V (the built-in model's 15 tokens: 2.7)


def test_a_step_whose_rows_are_all_left_out_runs_no_pass_and_changes_nothing():
    batch = _batch()
    batch.sample_mask = torch.zeros_like(batch.sample_mask)
    policy = load_model(MODEL, "float32")
    for settings in ({"micro_batch_tokens": 100, "packing": "always"}, {"micro_batch_tokens": 100,
                                                                        "seq_logprob_error_threshold": 2.0,
                                                    "needs_prev_logprobs": True}):
        result, update = _update(policy, batch, **settings)
        assert result.num_valid_tokens == 0 and result.loss == 0
        assert all(not u.any() for u in update.values())


def test_auto_packs_only_rows_whose_padding_would_double_the_tokens_and_take_half_the_budget():
    from mlperf_grpo.train import optimize

    batch = _batch()  # GRPO rows of similar lengths: padded
    settings = OptimizeSettings(None, 1.0, PGLossOptions(), 1e9, micro_batch_tokens=10_000)
    assert [p.packed is None for p in optimize._passes(batch, settings, True, torch.device("cpu"))] == [True]
    batch.attention_mask[1:] = 0  # one long row among 1-token rows: padding would waste most of the pass
    batch.attention_mask[1:, 0] = 1
    rows, width = batch.input_ids.shape
    padding = rows * width - int(batch.attention_mask.sum())
    for budget, packed in ((rows * width, True),  # padding > half the budget
                           (2 * padding + 2, False)):  # padding at most half the budget: cheaper than a packed pass
        settings = OptimizeSettings(None, 1.0, PGLossOptions(), 1e9, micro_batch_tokens=budget)
        passes = optimize._passes(batch, settings, True, torch.device("cpu"))
        assert [p.packed is not None for p in passes] == [packed], budget
    assert not optimize._passes(batch, settings, False, torch.device("cpu"))[0].packed  # linear attention: never


def test_no_pass_computes_more_than_the_token_budget():
    # the planner counts a pass as at most grpo.micro_batch_tokens tokens: rows of 10 and 6
    # tokens (16 within a budget of 18) padded would be 20 (not double: auto padded them, now
    # cut into passes of at most 18 padded tokens: each row alone); a
    # long row among 1-token rows unpacked (linear attention, packing never) would be a
    # pass of rows x the long one
    from mlperf_grpo.train import optimize

    batch = _batch()
    rows, width = batch.input_ids.shape
    lengths = [10, 6] * (rows // 2) if width >= 10 else None
    assert lengths is not None, width
    batch.attention_mask.zero_()
    for r, n in enumerate(lengths):
        batch.attention_mask[r, :n] = 1
    auto = OptimizeSettings(None, 1.0, PGLossOptions(), 1e9, micro_batch_tokens=18)
    passes = optimize._passes(batch, auto, True, torch.device("cpu"))
    assert [(p.packed, len(p.host_rows), p.width) for p in passes] == [(None, 1, 10), (None, 1, 6)] * (rows // 2)
    batch.attention_mask[1:] = 0
    batch.attention_mask[1:, 0] = 1  # one 10-token row, then 1-token rows
    for pack, packing in ((False, "auto"), (True, "never")):
        settings = OptimizeSettings(None, 1.0, PGLossOptions(), 1e9, micro_batch_tokens=18, packing=packing)
        for p in optimize._passes(batch, settings, pack, torch.device("cpu")):
            assert p.packed is None and len(p.host_rows) * p.width <= 18, (len(p.host_rows), p.width)


def test_no_pass_of_a_compiled_policy_passes_the_budget_once_its_width_is_rounded_up():
    # a compiled policy pads a pass to a multiple of 8 columns: 2-token rows under a budget
    # of 20 were passes of 10 rows, 10 x 8 = 80 tokens computed (the update: the test above)
    from mlperf_grpo.train import optimize

    batch = _batch()
    batch.attention_mask.zero_()
    batch.attention_mask[:, :2] = 1
    batch.attention_mask[::5, :] = 1  # a long row now and then: the rest of the batch right-padded or packed
    for packing, pack in (("never", True), ("auto", False), ("auto", True)):
        settings = OptimizeSettings(None, 1.0, PGLossOptions(), 1e9, micro_batch_tokens=20, packing=packing,
                                    width_multiple=8)
        passes = optimize._passes(batch, settings, pack, torch.device("cpu"))
        for p in passes:
            if p.packed is None and len(p.host_rows) > 1:
                assert len(p.host_rows) * p.width <= 20, (packing, pack, len(p.host_rows), p.width)
            if p.packed is not None and len(p.host_rows) > 1:  # packed to a multiple of 8 too: 24 > 20
                assert p.packed.input_ids.shape[-1] <= 20, (packing, pack, p.packed.input_ids.shape)


def _family(name):
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, MistralConfig

    v = load_model(MODEL, "float32").config.vocab_size  # the batch's token ids
    config = {  # learned absolute positions; a sliding window shorter than the rows; partial rotary, parallel residual
        "gpt2": GPT2Config(vocab_size=v, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                           embd_pdrop=0.0),
        "mistral": MistralConfig(vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4),
        "gpt_neox": GPTNeoXConfig(vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0,
                                  attention_dropout=0.0),
    }[name]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().train()


@pytest.mark.parametrize("name", ["gpt2", "mistral", "gpt_neox"])
def test_other_families_packed_chunked_and_checkpointed_give_the_one_big_batch_update(name):
    # the invariants on models other than the built-in Llama (random init): packed passes of a
    # budget smaller than two rows, log-probs 3 positions a chunk, activation checkpointing
    from mlperf_grpo.train.policy_probe import packing_problem
    from mlperf_grpo.train.trainer import checkpoint_layers

    batch = _batch()
    policy = _family(name)
    assert packing_problem(policy, torch.float32) is None  # the trainer would pack these rows
    whole = _update(policy, batch, micro=64)
    chunk = 3 * 4 * policy.lm_head.out_features  # float32 logits of 3 positions
    _assert_same_update(whole, _update(policy, batch, micro_batch_tokens=20, packing="always", logits_chunk_bytes=chunk))
    checkpointed = copy.deepcopy(policy)
    checkpoint_layers(checkpointed)
    _assert_same_update(whole, _update(checkpointed, batch, micro_batch_tokens=20, packing="always"))
    _assert_same_update(whole, _update(checkpointed, batch, micro=64))
