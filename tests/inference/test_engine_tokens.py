"""Which tokens an engine feeds the model and where a completion ends (issue 26, items 2
and 3), on the ``hf`` engine; ``tests/test_vllm_engine.py`` checks the vLLM engine the same
way. Every EOS id of the tokenizer and of the generation config ends a completion (real
Qwen3 directories list two), in the engine and in the training batch; a prompt rendered by
a chat template that writes ``{{ bos_token }}`` starts with one BOS, not two."""

import json
import shutil

import torch
import yaml
from transformers import AutoTokenizer, GenerationConfig

from mlperf_grpo.config.load import load_config
from mlperf_grpo.inference.base import Completion, SamplingParams, eos_token_ids
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
from mlperf_grpo.model.load import encode_prompts
from mlperf_grpo.tasks import load_suite
from mlperf_grpo.train.grpo import group_advantages
from mlperf_grpo.train.rollout import build_batch

PROMPTS = ["12+34=", "56+78=", "19+19=", "40+55=", "99+99=", "10+11="]
SEEDS = [11, 12, 13, 14, 15, 16]
PARAMS = SamplingParams(1.0, 1.0, 6)
EOS = 2  # the built-in tokenizer's <eos>
SECOND_EOS = 4  # the built-in vocabulary's "1": the model writes it inside answers such as 124
BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def two_eos_model(tmp_path, second: int = SECOND_EOS):
    """The built-in model whose ``generation_config.json`` lists ``[2, second]`` as EOS
    ids (the tokenizer's EOS stays 2), as Qwen3's lists ``<|im_end|>`` and ``<|endoftext|>``."""
    model = tmp_path / "two-eos"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [EOS, second]}))
    return model


def cut_at(token_ids: list[int], end: int) -> int:
    """The length of ``token_ids`` up to and including the first ``end`` (all without one)."""
    return token_ids.index(end) + 1 if end in token_ids else len(token_ids)


def test_eos_ids_are_the_tokenizers_then_the_generation_configs_without_repeats():
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    assert eos_token_ids(tokenizer, GenerationConfig(eos_token_id=[2, 15])) == [2, 15]
    assert eos_token_ids(tokenizer, GenerationConfig(eos_token_id=[15, 2])) == [2, 15]
    assert eos_token_ids(tokenizer, GenerationConfig(eos_token_id=7)) == [2, 7]
    assert eos_token_ids(tokenizer, GenerationConfig()) == [2]
    assert eos_token_ids(None, GenerationConfig(eos_token_id=[3, 5])) == [3, 5]
    assert eos_token_ids(None, None) == []


def test_the_hf_engine_stops_at_a_secondary_eos_of_the_generation_config(tmp_path):
    """With ``eos_token_id: [2, 4]`` each completion is the one the model samples without
    the second id (same seeds, same prefix), cut just after its first 4."""
    plain = HFEngine(str(BUILTIN_MODEL_DIR), "float32").generate(PROMPTS, PARAMS, SEEDS)
    assert any(SECOND_EOS in c.token_ids[:-1] for c in plain)  # the case is exercised
    engine = HFEngine(str(two_eos_model(tmp_path)), "float32")
    assert engine.eos_token_ids == [EOS, SECOND_EOS]
    for before, after in zip(plain, engine.generate(PROMPTS, PARAMS, SEEDS)):
        n = cut_at(before.token_ids, SECOND_EOS)
        assert after.token_ids == before.token_ids[:n]
        assert after.logprobs == before.logprobs[:n]
        assert after.text == engine.tokenizer.decode(before.token_ids[:n], skip_special_tokens=True)


def test_the_training_batch_ends_a_completion_at_the_first_eos_of_any_id():
    """Tokens an engine returned after an EOS are neither trained on nor attended to."""
    c = Completion(prompt_token_ids=[1, 4], token_ids=[7, SECOND_EOS, 9, 9], logprobs=[-0.1, -0.2, -0.3, -0.4], text="")
    other = Completion(prompt_token_ids=[1, 5, 6], token_ids=[8], logprobs=[-0.5], text="")  # ran to the limit
    rewards = torch.tensor([[1.0, 0.0]])
    batch = build_batch([[c, other]], rewards, group_advantages(rewards), 0, [EOS, SECOND_EOS])
    assert batch.input_ids.tolist() == [[1, 4, 7, SECOND_EOS], [1, 5, 6, 8]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch.completion_mask.tolist() == [[0, 1, 1], [0, 0, 1]]
    assert torch.equal(batch.rollout_logprobs, torch.tensor([[0, -0.1, -0.2], [0, 0, -0.5]]))  # both float32 casts
    only_first = build_batch([[c, other]], rewards, group_advantages(rewards), 0, [EOS])  # 4 is text here
    assert only_first.completion_mask.tolist() == [[0, 1, 1, 1, 1], [0, 0, 1, 0, 0]]


def bos_chat_config(tmp_path):
    """A ``task: jsonl`` config whose rows have ``messages``, on the built-in model (its
    tokenizer adds BOS) given a chat template that starts with ``{{ bos_token }}``."""
    model = tmp_path / "bos-chat"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    tok = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": BOS_TEMPLATE}))
    for name, (a, b) in (("train", (12, 34)), ("validation", (56, 78))):
        row = {"id": name, "prompt": f"{a}+{b}=", "answer": str(a + b),
               "messages": [{"role": "user", "content": f"{a}+{b}="}]}
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    config = {"model": {"path": str(model)}, "validation": {"num_tasks": 1},
              "task": {"name": "jsonl", "train_path": str(tmp_path / "train.jsonl"),
                       "validation_path": str(tmp_path / "validation.jsonl"), "num_train_tasks": 1}}
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump(config))
    return load_config(tmp_path / "chat.yaml")


def expected_chat_ids(text: str) -> list[int]:
    """One BOS, then the built-in character vocabulary's id of each character."""
    vocab = json.loads((BUILTIN_MODEL_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    return [vocab["<bos>"]] + [vocab[ch] for ch in text]


def test_a_chat_prompt_whose_template_writes_bos_is_fed_with_one_bos(tmp_path):
    config = bos_chat_config(tmp_path)
    (task,) = load_suite(config).validation_tasks(1)
    assert task.prompt == "<bos>56+78="  # rendered by the template, BOS included
    engine = HFEngine(config.model.path, "float32")
    (completion,) = engine.generate([task.prompt], PARAMS, [1])
    assert completion.prompt_token_ids == expected_chat_ids("56+78=")  # [1, 8, 9, ...], not [1, 1, 8, ...]


def test_plain_prompts_keep_the_bos_the_tokenizer_adds():
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    assert encode_prompts(tokenizer, ["56+78=", "<bos>56+78=", ""]) == [
        expected_chat_ids("56+78="), expected_chat_ids("56+78="), expected_chat_ids("")]
