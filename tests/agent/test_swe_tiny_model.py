"""The agentic tiny model: byte-level tokenizer, Qwen3 chat template with XML tool calls,
random init from a seed into a cache folder (no weights in the repository)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from mlperf_grpo.model.load import load_tokenizer
from mlperf_grpo.model.files import ASSETS, resolve_model_path
from mlperf_grpo.model.random_init import needs_random_init

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def test_the_shipped_directory_has_no_weights_and_resolves_to_a_seeded_cached_copy(tmp_path, monkeypatch):
    assert needs_random_init(ASSETS / "swe-tiny")
    weights = []
    for cache in ("a", "b"):
        monkeypatch.setenv("MLPERF_GRPO_CACHE", str(tmp_path / cache))
        directory = resolve_model_path("builtin:swe-tiny")
        assert directory.is_relative_to(tmp_path / cache) and (directory / "tokenizer.json").is_file()
        assert resolve_model_path("builtin:swe-tiny") == directory  # built once
        weights.append(load_file(directory / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys() and len(weights[0]) > 5
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=0, atol=0)  # same seed, same bits


def test_any_text_round_trips_one_token_a_byte_and_markup_is_one_token(tmp_path, monkeypatch):
    monkeypatch.setenv("MLPERF_GRPO_CACHE", str(tmp_path))
    tok = load_tokenizer("builtin:swe-tiny")
    text = "def f(x):\n\treturn x + 1  # é ✓\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert tok.decode(ids) == text
    call = "<tool_call>\n<function=bash>\n</function>\n</tool_call><|im_end|>"
    ids = tok(call, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>") and ids[-1] == tok.eos_token_id == 258
    assert tok.decode(ids, skip_special_tokens=True) == call.removesuffix("<|im_end|>")  # tool markup kept


def test_the_chat_template_writes_tools_xml_calls_and_tool_responses(tmp_path, monkeypatch):
    monkeypatch.setenv("MLPERF_GRPO_CACHE", str(tmp_path))
    tok = load_tokenizer("builtin:swe-tiny")
    messages = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls", "n": [1, 2]}}}]},
        {"role": "tool", "content": "a.py"}, {"role": "tool", "content": "b.py"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                   enable_thinking=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           '{"type": "function", "function": {"name": "bash"')
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nFix it.<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>assistant\n<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n"
        "<parameter=n>\n[1, 2]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
