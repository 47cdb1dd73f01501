"""Bytes each tensor-parallel rank reads of the reference's Megatron ``torch_dist``
checkpoint, against its share of the checkpoint.

    python benchmarks/megatron_share.py --ranks 2 --hidden 256 --layers 4 --experts 8

Builds a random-init ``qwen3_5_moe`` from a ``transformers`` config (gated delta-net and
full-attention layers, routed and shared experts; nothing is downloaded), has Megatron-core
write it as a ``torch_dist`` checkpoint at ``--ranks`` writing ranks
(``tests/checkpoint/megatron_writer.py``; needs ``megatron-core``, the test extra), then
for each reading rank of a ``--ranks``-way split (as a tensor-parallel engine shards:
columns of ``o_proj``, ``out_proj`` and ``down_proj``, rows of the rest) reads its slices
with ``megatron_layout.read_into`` (the CRC check left out: it is divided among the ranks
by files). Prints one JSON line: ``checkpoint_bytes`` (the data files); per rank
``records_bytes`` (the ``torch.save`` records DCP was asked for: every saved chunk that
overlaps a slice is read whole), ``rchar_bytes`` (what the process read from the files,
``/proc/self/io``: ``torch.load`` of a record reads some of it twice) and both over the
share ``checkpoint_bytes / ranks`` (1.0 is the floor); ``slices_equal`` (each rank's
slices equal the whole read's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


class _CountRecords:
    """Sums the record bytes ``FileSystemReader.read_data`` is asked for (restored on exit)."""

    def __enter__(self):
        from torch.distributed.checkpoint import FileSystemReader

        self.bytes, self._original = 0, FileSystemReader.read_data

        def read_data(reader, plan, planner):
            self.bytes += sum(reader.storage_data[item.storage_index].length for item in plan.items)
            return self._original(reader, plan, planner)

        FileSystemReader.read_data = read_data
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        FileSystemReader.read_data = self._original


def _model(directory: Path, hidden: int, layers: int, experts: int) -> Path:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    kinds = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    kinds[-1] = "full_attention"
    config = Qwen3_5MoeTextConfig(
        vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        head_dim=hidden // 8, moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden // 2,
        num_experts=experts, num_experts_per_tok=2, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=hidden // 8, linear_value_head_dim=hidden // 8, layer_types=kinds, tie_word_embeddings=False)
    Qwen3_5MoeForCausalLM(config).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()
    if args.ranks < 1 or args.hidden % 64 or args.layers < 1 or args.experts < 1:
        parser.error("--ranks, --layers, --experts must be >= 1 and --hidden a multiple of 64")
    from foreign_layouts import write_megatron

    from mlperf_grpo.checkpoint import megatron_layout as ml

    with tempfile.TemporaryDirectory() as tmp:
        hf = _model(Path(tmp) / "hf", args.hidden, args.layers, args.experts)
        target = Path(tmp) / "step_1" / "policy" / "weights" / "iter_0000000"
        write_megatron([(hf, target, "legacy")], args.ranks)
        ckpt = ml.open_checkpoint(target, 1, hf / "config.json")
        whole = ml.read_weights(ckpt)
        checkpoint_bytes = sum(p.stat().st_size for p in target.glob("*.distcp"))
        per_rank, equal = [], True
        for rank in range(args.ranks):
            blocks, dest = {}, {}
            for name, t in whole.items():
                dim = 1 if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 0
                n = -(-t.shape[dim] // args.ranks)
                offsets, sizes = [0] * t.dim(), list(t.shape)
                offsets[dim] = min(rank * n, t.shape[dim])
                sizes[dim] = max(0, min(n, t.shape[dim] - offsets[dim]))
                blocks[name] = (tuple(offsets), tuple(sizes))
                dest[name] = torch.empty(sizes, dtype=t.dtype)
            before = _rchar()
            with _CountRecords() as records:
                ml.read_into(ckpt, dest, blocks, check=set())
            rchar = _rchar() - before
            equal &= all(torch.equal(dest[n], whole[n][tuple(slice(o, o + k) for o, k in zip(*blocks[n]))]) for n in whole)
            share = checkpoint_bytes / args.ranks
            per_rank.append({"rank": rank, "records_bytes": records.bytes, "records_over_share": round(records.bytes / share, 3),
                             "rchar_bytes": rchar, "rchar_over_share": round(rchar / share, 3)})
    print(json.dumps({"ranks": args.ranks, "checkpoint_bytes": checkpoint_bytes, "per_rank": per_rank, "slices_equal": equal}))


if __name__ == "__main__":
    main()
