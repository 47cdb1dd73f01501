"""Make the tiny agentic model's files: a byte-level tokenizer with the Qwen3 chat and
tool-call special tokens and chat template, and a tiny Qwen3 config (random init).

Re-run to rebuild ``src/mlperf_grpo/assets/swe-tiny`` (seconds; nothing downloaded):

    python scripts/make_swe_tiny_model.py

What it writes (text files only):

1. ``tokenizer.json``/``tokenizer_config.json``: ids 0-255 are the 256 bytes (byte-level,
   no merges: any text, code and tool call encodes, one token a byte), then the Qwen3
   special tokens ``<|endoftext|>`` (256, pad), ``<|im_start|>``, ``<|im_end|>`` (258, the
   end of a turn), ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
   ``</tool_response>``, ``<think>``, ``</think>``; the chat template
   ``src/mlperf_grpo/agent/qwen3_chat_template.jinja`` (Qwen3.5 / Qwen3-Coder XML tool calls).
2. ``config.json``/``generation_config.json``: a 2-layer Qwen3 (hidden 64), stopping at
   ``<|im_end|>`` or ``<|endoftext|>``.
3. ``random_init.json``: ``{"seed": S}``. No weights are shipped: the first use of
   ``builtin:swe-tiny`` builds the model from the config with ``torch.manual_seed(S)`` into a
   cache folder (``mlperf_grpo.model.random_init``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "mlperf_grpo" / "assets" / "swe-tiny"
TEMPLATE = ROOT / "src" / "mlperf_grpo" / "agent" / "qwen3_chat_template.jinja"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Skipped when decoding with ``skip_special_tokens`` (as Qwen3's)."""
MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Single tokens kept in decoded text (Qwen3 marks them ``special: false``)."""


def make_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        padding_side="left")
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    rest = [b for b in range(256) if b not in printable]
    return rest[ord(ch) - 256]


def make_config(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int) -> Qwen3Config:
    ids = tokenizer.convert_tokens_to_ids
    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=65536,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
        pad_token_id=ids("<|endoftext|>"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--output", type=Path, default=OUT)
    args = parser.parse_args()
    tokenizer = make_tokenizer()
    config = make_config(tokenizer, args.hidden, args.layers)
    if args.output.exists():
        shutil.rmtree(args.output)
    args.output.mkdir(parents=True)
    tokenizer.save_pretrained(args.output)
    config.save_pretrained(args.output)
    GenerationConfig(do_sample=True, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id).save_pretrained(
        args.output)
    (args.output / "random_init.json").write_text(json.dumps({"seed": args.seed}) + "\n")
    print(f"wrote {sorted(p.name for p in args.output.iterdir())} to {args.output}")


if __name__ == "__main__":
    main()
