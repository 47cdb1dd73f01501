"""A model directory whose weight files or config.json are damaged: every loader
(``load_model``, the sharded ``load_sharded_policy``, the vLLM engine) raises
``ModelLoadError`` naming the file, never a library's own error (which the CLI would
report as a failure, exit 1, or, for torch's ``CheckpointException``, a traceback)."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mlperf_grpo.config.sections import InferenceConfig
from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.inference.vllm import VLLMEngine
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.model.load import load_model
from mlperf_grpo.train import fsdp

WEIGHTS = "model.safetensors"


def _truncate(model):
    data = (model / WEIGHTS).read_bytes()
    (model / WEIGHTS).write_bytes(data[: len(data) // 2])


def _short_by_one_byte(model):
    data = (model / WEIGHTS).read_bytes()
    (model / WEIGHTS).write_bytes(data[:-1])


def _random_bytes(model):
    (model / WEIGHTS).write_bytes(os.urandom(4096))


def _empty(model):
    (model / WEIGHTS).write_bytes(b"")


def _missing(model):
    (model / WEIGHTS).unlink()


def _embedding_one_row_short(model):
    weights = load_file(str(model / WEIGHTS))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:-1].clone()
    save_file(weights, str(model / WEIGHTS), metadata={"format": "pt"})


def _norm_missing(model):
    weights = load_file(str(model / WEIGHTS))
    del weights["model.norm.weight"]
    save_file(weights, str(model / WEIGHTS), metadata={"format": "pt"})


def _config_value_of_the_wrong_type(model):
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = "sixty-four"
    (model / "config.json").write_text(json.dumps(config))


def _unknown_architecture(model):
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "no_such_model"
    (model / "config.json").write_text(json.dumps(config))


FAULTS = {  # damage -> what the one line says
    "truncated": (_truncate, f"{WEIGHTS}: Error while deserializing header"),
    "short-by-one-byte": (_short_by_one_byte, f"{WEIGHTS}: Error while deserializing header"),
    "random-bytes": (_random_bytes, f"{WEIGHTS}: Error while deserializing header"),
    "empty": (_empty, f"{WEIGHTS}: Error while deserializing header"),
    "missing": (_missing, "has no weights (model.safetensors or model.safetensors.index.json)"),
    "shape-not-the-config": (_embedding_one_row_short, "tensor 'model.embed_tokens.weight' has shape [14, 64] in the weight files but config.json needs [15, 64]"),
    "tensor-missing": (_norm_missing, "the weight files have no tensor 'model.norm.weight'"),
    "config-value-of-the-wrong-type": (_config_value_of_the_wrong_type, "config.json: Validation error for field 'hidden_size'"),
    "unknown-architecture": (_unknown_architecture, "config.json: The checkpoint you are trying to load has model type `no_such_model`"),
}


@pytest.fixture
def damaged(tmp_path, request):
    damage, message = FAULTS[request.param]
    model = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    damage(model)
    return model, message


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _one_line(err: pytest.ExceptionInfo, model, message: str) -> None:
    text = str(err.value)
    assert "\n" not in text and str(model) in text and message in text, text


@pytest.mark.parametrize("damaged", list(FAULTS), indirect=True)
def test_load_model_names_the_bad_file(damaged):
    model, message = damaged
    with pytest.raises(ModelLoadError) as err:
        load_model(str(model), "float32")
    _one_line(err, model, message)


@pytest.mark.parametrize("damaged", list(FAULTS), indirect=True)
def test_sharded_load_names_the_bad_file(damaged, one_rank_group):
    model, message = damaged
    with pytest.raises(ModelLoadError) as err:
        fsdp.load_sharded_policy(str(model), "cpu", None, activation_checkpointing=False)
    _one_line(err, model, message)


@pytest.mark.parametrize("damaged", ["shape-not-the-config"], indirect=True)
def test_sharded_load_maps_a_failure_inside_the_distributed_load(damaged, one_rank_group, monkeypatch):
    """Files that pass the header check and then fail in ``torch.distributed.checkpoint``
    (replaced in between): its ``CheckpointException``, a ``BaseException``, becomes
    one ModelLoadError line."""
    model, _ = damaged
    good = fsdp.check_weights(BUILTIN_MODEL_DIR)
    monkeypatch.setattr(fsdp, "check_weights", lambda directory: good)
    with pytest.raises(ModelLoadError) as err:
        fsdp.load_sharded_policy(str(model), "cpu", None, activation_checkpointing=False)
    _one_line(err, model, "Size mismatch between saved torch.Size([14, 64]) and current: torch.Size([15, 64])")
    assert "copy the model's weight files there again" in str(err.value)


@pytest.mark.parametrize("damaged", ["truncated", "random-bytes", "missing"], indirect=True)
def test_vllm_engine_checks_the_weights_it_would_load(damaged):
    """vLLM loads ``model.path``'s weights (the evaluator's engine too): checked first,
    before vLLM is imported (so this runs without vLLM)."""
    model, message = damaged
    with pytest.raises(ModelLoadError) as err:
        VLLMEngine(str(model), "float32", "cpu", InferenceConfig(engine="vllm"), seed=1)
    _one_line(err, model, message)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded-index"])
def test_load_model_reads_each_weight_file_once_and_equals_from_pretrained(tmp_path, monkeypatch, sharded):
    """Each weight file is opened (its header read) once, where the check and
    ``from_pretrained`` used to read it twice; the model is ``from_pretrained``'s
    exactly (weights, buffers, tied embedding, config, generation config, logits)."""
    import transformers.modeling_utils
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from mlperf_grpo.model import files as model_files

    directory = BUILTIN_MODEL_DIR
    if sharded:
        directory = tmp_path / "sharded"
        AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR).save_pretrained(directory, max_shard_size="40KB")
        shutil.copy(BUILTIN_MODEL_DIR / "generation_config.json", directory)
        assert len(list(directory.glob("*.safetensors"))) > 1 and (directory / "model.safetensors.index.json").is_file()
    opened = []

    def counting_safe_open(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return safe_open(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(model_files, "safe_open", counting_safe_open)
        patch.setattr(transformers.modeling_utils, "safe_open", counting_safe_open)
        loaded = load_model(str(directory), "bfloat16")
    assert sorted(opened) == sorted(p.name for p in directory.glob("*.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, local_files_only=True).eval()
    ours, theirs = dict(loaded.state_dict(keep_vars=True)), dict(reference.state_dict(keep_vars=True))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)
    assert {k: torch.equal(b, dict(reference.named_buffers())[k]) for k, b in loaded.named_buffers()} == {
        k: True for k, _ in reference.named_buffers()}
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied, as from_pretrained ties them
    assert loaded.config.to_dict() == reference.config.to_dict()
    assert loaded.generation_config.to_dict() == reference.generation_config.to_dict()
    assert not loaded.training
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.equal(loaded(prompt).logits, reference(prompt).logits)


def _saved_model(tmp_path, model_type: str, head: str = "AutoModelForCausalLM", **sizes):
    """A tiny random model of ``model_type`` with the ``transformers`` auto class ``head``,
    written by its ``save_pretrained`` (its saved tensor names and ``architectures``), with
    the built-in model's character tokenizer."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, vocab_size=15, num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0, **sizes)
    torch.manual_seed(0)
    directory = tmp_path / model_type
    getattr(transformers, head).from_config(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, directory / name)
    return directory


@pytest.mark.parametrize("model_type, sizes, saved_name, dropped", [
    ("gpt_neox", {"hidden_size": 64, "intermediate_size": 128, "tie_word_embeddings": False}, "embed_out.weight",
     "embed_out.weight"),
    ("qwen3_moe", {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
                   "num_experts_per_tok": 2, "num_key_value_heads": 2, "head_dim": 16},
     "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.gate.weight"),
])
def test_a_model_saved_under_transformers_names_loads(tmp_path, model_type, sizes, saved_name, dropped):
    """transformers 5 saves some tensors under other names than the model's parameters
    (GPT-NeoX's output head as ``embed_out``; Qwen3-MoE's experts one tensor each, merged
    at load): the model check takes them as ``from_pretrained`` does (it used to refuse
    both, "the weights and config.json are of different models"), and still refuses a
    directory with a tensor missing."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from mlperf_grpo.model.check import check_model

    directory = _saved_model(tmp_path, model_type, **sizes)
    with safe_open(str(directory / WEIGHTS), "pt") as f:
        assert saved_name in f.keys()
    check_model(str(directory), "12+34=")
    model = load_model(str(directory), "float32")
    reference = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(t, reference.state_dict()[n]) for n, t in model.state_dict().items())
    weights = load_file(directory / WEIGHTS)
    del weights[dropped]
    save_file(weights, directory / WEIGHTS)
    with pytest.raises(ModelLoadError, match="the weight files have no tensor"):
        check_model(str(directory), "12+34=")


def test_a_tokenizer_that_transformers_extends_is_named_in_the_refusal(tmp_path):
    """transformers loads a ``qwen2`` model's tokenizer as ``Qwen2Tokenizer`` whatever
    ``tokenizer_class`` says, and that class adds ``<|endoftext|>`` (id 15 here, past the
    15 embedding rows): the refusal names the token and the class, not only an id."""
    from mlperf_grpo.model.check import check_model

    model = _saved_model(tmp_path, "qwen2", hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                         tie_word_embeddings=False)
    with pytest.raises(ModelLoadError) as err:
        check_model(str(model), "1+2=")
    assert "the largest vocabulary id is 15 ('<|endoftext|>', tokenizer loaded as Qwen2Tokenizer) but the embedding " \
           "'model.embed_tokens.weight' has 15 rows" in str(err.value)
    # and says why: the class tokenizer_config.json names is not the one transformers used
    assert str(err.value).endswith("; tokenizer_config.json names TokenizersBackend, but transformers loaded "
                                   "Qwen2Tokenizer for this model type and it adds tokens: use this model type's own "
                                   "tokenizer, or an embedding of at least 16 rows")


BERT_SIZES = {"hidden_size": 64, "intermediate_size": 128}


@pytest.mark.parametrize("model_type, head, sizes, named", [
    ("bert", "AutoModelForMaskedLM", BERT_SIZES, "BertForMaskedLM (model_type bert), a masked LM (it predicts hidden tokens from both sides)"),
    ("roberta", "AutoModelForCausalLM", BERT_SIZES, "RobertaForCausalLM (model_type roberta), its attention sees the "
                                                    "whole sequence (is_decoder is false)"),
    ("t5", "AutoModelForSeq2SeqLM", {"hidden_size": 64, "d_ff": 128, "d_kv": 16},
     "T5ForConditionalGeneration (model_type t5), transformers has no causal-LM class for it"),
], ids=["bert-masked-lm", "roberta-causal-head-without-is_decoder", "t5-encoder-decoder"])
def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path, capsys, model_type, head, sizes, named):
    """AutoModelForCausalLM builds BERT's BertLMHeadModel from a masked-LM directory (it
    attends both ways), and has no class at all for T5 (the refusal said to copy
    config.json again): every loader refuses each in one line saying it is not a causal
    LM, and train exits 2, nothing made."""
    import yaml

    from mlperf_grpo.cli import main
    from mlperf_grpo.model.check import check_model
    from mlperf_grpo.model.skeleton import model_skeleton

    directory = _saved_model(tmp_path, model_type, head, **sizes)
    for load in (lambda: check_model(str(directory), "1+2="), lambda: load_model(str(directory), "float32"),
                 lambda: model_skeleton(str(directory), "float32")):
        with pytest.raises(ModelLoadError) as err:
            load()
        assert f"config.json describes {named}: not a causal LM" in str(err.value)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(directory)}}))
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mlperf-grpo: error: model ") and "not a causal LM" in line
    assert not (tmp_path / "run").exists()


def test_a_policy_the_trainer_refuses_says_its_printed_run_directory_was_removed(tmp_path, capsys, monkeypatch):
    """Gemma2 (logits soft-capped after lm_head) is refused at the trainer's set-up, after
    ``run directory: DIR`` was printed; DIR is removed again (nothing was written), and
    the refusal used not to say so: the user was told of a directory that did not exist."""
    import yaml

    from mlperf_grpo.cli import main

    directory = _saved_model(tmp_path, "gemma2", hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                             head_dim=8)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(directory)}}))
    monkeypatch.chdir(tmp_path)  # the default output is runs/YYYYMMDD-HHMMSS under it
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["train", "--config", str(cfg)]) == 2
    captured = capsys.readouterr()
    (run_dir,) = [line.removeprefix("run directory: ") for line in captured.out.splitlines()
                  if line.startswith("run directory: ")]
    assert not (tmp_path / run_dir).exists()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"mlperf-grpo: error: model {directory}: its logits are not its lm_head's output")
    assert line.endswith(f" (run directory {run_dir} removed: the run wrote nothing in it)")


def test_an_encoder_family_as_a_decoder_is_a_causal_lm(tmp_path):
    """BERT with ``is_decoder: true`` (BertLMHeadModel with causal attention) is accepted."""
    from mlperf_grpo.model.check import check_model

    directory = _saved_model(tmp_path, "bert", is_decoder=True, **BERT_SIZES)
    check_model(str(directory), "1+2=")
    assert type(load_model(str(directory), "float32")).__name__ == "BertLMHeadModel"
