"""A real Megatron-core ``GPTModel`` (a dense Qwen3 or Llama shape, the local layer spec,
CPU, one gloo rank) with random weights, saved by ``dist_checkpointing.save``, and its own
logits for fixed token ids::

    python tests/checkpoint/megatron_gpt.py CONFIG_JSON ITER_DIR LOGITS_PT VOCAB_PADDED

The reader under test maps this checkpoint's names to the Hugging Face model's; the
logits of that model must be Megatron's (``test_megatron_layout.py``). Megatron-core
0.16.1 cannot build the gated delta-net on the CPU (its layer spec needs Transformer
Engine), so ``qwen3_5_moe`` is covered by ``megatron_writer.py`` instead.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

IDS = [[1, 5, 9, 19, 3, 0, 7, 12]]


def main() -> None:
    config_json, out, logits_file, vocab = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    torch.cuda.synchronize = lambda *a, **k: None  # CPU shims: Megatron-core's save calls these
    torch.cuda.current_device = lambda: "cpu"
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # no CUDA rng states on the CPU; dropout is 0
    hf = json.loads(config_json.read_text())
    qk_norm = hf["model_type"] == "qwen3"
    heads = hf["num_attention_heads"]
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads, kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=qk_norm,
        params_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False)
    theta = (hf.get("rope_parameters") or {}).get("rope_theta") or hf.get("rope_theta")
    torch.manual_seed(1)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm"),
                     vocab_size=vocab, max_sequence_length=64, share_embeddings_and_output_weights=hf.get("tie_word_embeddings", False),
                     position_embedding_type="rope", rotary_base=theta).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.5 * torch.randn(p.shape))
    out.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(out))
    ids = torch.tensor(IDS)
    mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool), 1)  # True: masked (causal)
    with torch.no_grad():
        torch.save(model(ids, torch.arange(ids.shape[1])[None], mask), logits_file)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # the async writer's processes import this file
    main()
