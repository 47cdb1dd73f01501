"""Make the built-in model: a tiny Llama that adds two-digit numbers but often forgets carries.

Re-run to rebuild ``src/mlperf_grpo/assets/arithmetic-tiny`` (about a minute on 2 cores):

    python scripts/make_default_model.py

What it does, deterministically from ``--seed``:

1. A character-level tokenizer (digits, ``+``, ``=``, ``<bos>``, ``<eos>``, ``<pad>``).
2. A 2-layer Llama (``transformers.LlamaConfig``), randomly initialized.
3. Supervised pre-training on every problem ``a+b=`` (10 <= a, b <= 99). Problems with
   no carry in the units are labelled correctly. Problems with a carry are labelled with
   the correct sum only with probability ``p = 0.05 * (units_a + units_b - 9)`` (0.05 to
   0.45) and otherwise with the sum whose carry was dropped (``a + b - 10``).

The result answers no-carry problems (about 55% of the validation set) and, greedily,
gets carries wrong, while sampling at temperature 1 finds the right carry with
probability ``p``. GRPO has a signal to learn from, and the validation accuracy (pass@4
at temperature 0.1) starts below the 0.69 target and rises as carries are learned.
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mlperf_grpo.tasks import arithmetic

OUT = Path(__file__).resolve().parents[1] / "src" / "mlperf_grpo" / "assets" / "arithmetic-tiny"
SPECIAL = ["<pad>", "<bos>", "<eos>"]
CHARS = list("0123456789+=")


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side="left"
    )


def make_model(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=65536,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def p_correct_carry(a: int, b: int) -> float:
    """Probability that a pre-training label of a carry problem is correct."""
    return 0.05 * ((a % 10) + (b % 10) - 9)


def label(a: int, b: int, rng: random.Random) -> int:
    if (a % 10) + (b % 10) < 10 or rng.random() < p_correct_carry(a, b):
        return a + b
    return a + b - 10


def batch(tokenizer, problems, rng):
    """Right-padded ``[B, L]`` ids and labels (-100 outside the answer and its EOS)."""
    rows, masks = [], []
    for a, b in problems:
        prompt = tokenizer(f"{a}+{b}=")["input_ids"]
        answer = tokenizer(str(label(a, b, rng)), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(r)] = torch.where(torch.tensor(m).bool(), torch.tensor(r), torch.tensor(-100))
    return ids, labels


@torch.no_grad()
def greedy_accuracy(model, tokenizer, tasks) -> float:
    enc = tokenizer([t.prompt for t in tasks], padding=True, return_tensors="pt")
    out = model.generate(**enc, do_sample=False, max_new_tokens=5, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(t.strip() == task.answer for t, task in zip(texts, tasks)) / len(tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output", type=Path, default=OUT)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    torch.set_num_threads(2)
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, args.hidden, args.layers)
    problems = arithmetic.all_problems()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    val = arithmetic.validation_tasks(251)
    model.train()
    for step in range(1, args.steps + 1):
        ids, labels = batch(tokenizer, rng.choices(problems, k=args.batch_size), rng)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 250 == 0 or step == args.steps:
            model.eval()
            print(f"step {step} loss {loss.item():.4f} greedy validation accuracy {greedy_accuracy(model, tokenizer, val):.3f}")
            model.train()
    model.eval()
    if args.output.exists():
        shutil.rmtree(args.output)
    model.generation_config.do_sample = True
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"saved {sum(p.numel() for p in model.parameters())} parameters to {args.output}")


if __name__ == "__main__":
    main()
