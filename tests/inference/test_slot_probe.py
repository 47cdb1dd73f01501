"""The slot decoder's probe (inference/slot_probe.py): a model family whose cache the slot
decoder cannot drive goes to ``generate``, found by running the path, not by its name."""

import pytest
import torch
from test_generation import EOS, tiny_qwen3
from transformers import FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.inference.slot_attention import supports_slot_decoding
from mlperf_grpo.inference.slot_probe import slot_decoding_problem
from mlperf_grpo.inference.slot_state import PrefillWriter


def _tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "opt":
        config = OPTConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                           max_position_embeddings=64, word_embed_proj_dim=16, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
        return OPTForCausalLM(config).eval()
    if family == "falcon":
        return FalconForCausalLM(FalconConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2,
                                              num_attention_heads=2, bos_token_id=1, eos_token_id=2)).eval()
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                          bos_token_id=1, eos_token_id=2)).eval()
    return tiny_qwen3(vocab_size=24, eos_token_id=EOS).eval()


@pytest.mark.parametrize("family", ["opt", "falcon"])
def test_a_family_the_slot_decoder_cannot_drive_is_refused_by_the_probe(family):
    """OPT and Falcon pass the config check (full attention, position ids) but fail inside
    the slot decoder's prefill: the probe says why, and an engine asked for the slot
    decoder refuses in one line (``auto`` then takes ``generate``)."""
    model = _tiny(family)
    assert supports_slot_decoding(model)
    problem = slot_decoding_problem(model, 0)
    assert problem is not None and "\n" not in problem
    with pytest.raises(ValueError, match="does not run through the slot decoder"):
        HFEngine.from_model(model, batch_size=2, decode="slots")


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_the_families_the_slot_decoder_drives_pass_the_probe(family):
    model = _tiny(family)
    assert slot_decoding_problem(model, 0) is None
    assert HFEngine.from_model(model, batch_size=2, decode="slots").describe()["engine"].startswith("slot decoder")


def test_a_cache_the_model_reads_otherwise_fails_the_probe(monkeypatch):
    """A prefill whose keys and values never reach the cache rows (as a family that keeps
    its own cache would leave them) runs without an error; the decode step then attends to
    empty columns, and the probe finds its logits off."""
    model = _tiny("qwen3")
    monkeypatch.setattr(PrefillWriter, "update", lambda self, key, value, layer, *args, **kwargs: (key, value))
    problem = slot_decoding_problem(model, 0)
    assert problem is not None and "differ" in problem


def test_an_engine_built_for_a_refit_probes_at_its_first_generate():
    """Built for a refit, an engine's weights are not set yet: the probe waits for its
    first generate (then refuses decode=slots for OPT in one line; auto takes generate)."""
    for decode in ("slots", "auto"):
        engine = HFEngine.__new__(HFEngine)
        engine._init(_tiny("opt"), None, 2, "in-memory", decode, weights_set=False)
        if decode == "slots":
            assert engine._decoder is not None  # not probed yet
            with pytest.raises(ValueError, match="does not run through the slot decoder"):
                engine.generate_ids([[3, 4, 5]], SamplingParams(1.0, 1.0, 3), [7])
        else:
            assert engine._decoder is None  # auto on the CPU: generate, no probe
            assert len(engine.generate_ids([[3, 4, 5]], SamplingParams(1.0, 1.0, 3), [7])[0].token_ids) <= 3
