"""Code that runs inside vLLM's workers: refit in place, and the fingerprint of what was loaded.

vLLM mixes :class:`WeightSyncExtension` into each worker (``LLM(...,
worker_extension_cls=WORKER_EXTENSION)``); the engine calls its methods by name with
``LLM.collective_rpc``, the mechanism of vLLM's RLHF examples. A refit hands the
Hugging Face-named tensors to the worker's own ``reload_weights``
(``vllm.model_executor.model_loader.reload``), which runs the model's ``load_weights``
(fusing ``q/k/v_proj`` into ``qkv_proj``, sharding for tensor parallelism, skipping a
tied ``lm_head``) between vLLM's layer-wise reload hooks, so kernel-format weights (the
CPU backend's prepacked oneDNN/SGL matrices) are rebuilt from the new values.

When the engine runs the model with wider attention heads
(:mod:`mlperf_grpo.inference.head_padding`), the worker pads the tensors it receives
(checkpoint layout, as the policy and ``step_N/`` hold them) just before
``load_weights``; fingerprints are of the received, unpadded tensors.

Because those kernel formats drop the plain ``weight`` tensors, the loaded values cannot
be read back from the model on every backend; the worker instead fingerprints the exact
tensors it passed to ``load_weights`` (:func:`mlperf_grpo.model.fingerprint.weights_fingerprint`),
and the canary, run through vLLM's own forward pass, proves the kernels use them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from mlperf_grpo.inference.head_padding import HeadPadding
from mlperf_grpo.model.fingerprint import weights_fingerprint

WORKER_EXTENSION = "mlperf_grpo.inference.vllm_worker.WeightSyncExtension"
"""Qualified name passed to vLLM as ``worker_extension_cls``."""


def read_safetensors_dir(directory: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, in file then name order.

    Raises:
        ValueError: the directory has no ``*.safetensors`` file.
    """
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors weight file to refit from")
    weights = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            weights.extend((key, f.get_tensor(key)) for key in sorted(f.keys()))
    return weights


class WeightSyncExtension:
    """Methods vLLM adds to its worker class (``self`` is the worker); called through
    ``LLM.collective_rpc(name, args=...)`` on every worker (tensor-parallel rank)."""

    def refit_from_state_dict(self, weights: list[tuple[str, torch.Tensor]], padding: HeadPadding | None = None) -> str:
        """Reload these Hugging Face-named tensors in place through the model's own
        ``load_weights``, padded by ``padding`` when given; returns (and keeps) the
        fingerprint of exactly these tensors (before padding)."""
        dtype = self.vllm_config.model_config.dtype
        weights = [(name, t.to(dtype)) for name, t in weights]  # what load_weights copies in
        fingerprint = weights_fingerprint(dict(weights))
        loaded = padding.pad_all(weights) if padding is not None else iter(weights)
        self.reload_weights(weights_iterator=loaded, is_checkpoint_format=True)
        self._retie_output_embeddings()
        self.mlperf_loaded_fingerprint = fingerprint
        self.mlperf_loaded_names = sorted(name for name, _ in weights)
        return fingerprint

    def refit_from_directory(self, directory: str, padding: HeadPadding | None = None) -> str:
        """Refit from a ``step_N/`` directory's safetensors files, read in this worker (the
        tensors do not pass through the driver process); returns their fingerprint."""
        return self.refit_from_state_dict(read_safetensors_dir(directory), padding)

    def _retie_output_embeddings(self) -> None:
        """Tie ``lm_head`` to the input embeddings again when the config ties them.

        vLLM 0.32's layer-wise reload re-creates ``embed_tokens.weight`` but, finding no
        ``lm_head.weight`` to load (``load_weights`` skips it when tied), puts the old
        ``lm_head`` tensor back ("ParallelLMHead: Failed to load weights"), so the
        output layer would keep the previous weights. Re-tie through the layer's own
        ``tie_weights`` and rebuild its kernel (the CPU backend prepacks it).
        """
        if not getattr(self.vllm_config.model_config.hf_text_config, "tie_word_embeddings", False):
            return
        model = self.get_model()
        lm_head = getattr(model, "lm_head", None)
        embeddings = [m for name, m in model.named_modules() if name.endswith("embed_tokens")]
        if lm_head is None or len(embeddings) != 1:
            raise ValueError("tied word embeddings, but no single embed_tokens / lm_head pair to re-tie after refit")
        lm_head.tie_weights(embeddings[0])
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def loaded_fingerprint(self, names: list[str]) -> str:
        """The fingerprint of the tensors of the last refit.

        Raises:
            ValueError: no refit yet, or ``names`` are not the names that were loaded.
        """
        loaded = getattr(self, "mlperf_loaded_names", None)
        if loaded is None:
            raise ValueError("the vLLM engine has not been refit yet; nothing to fingerprint")
        if sorted(names) != loaded:
            raise ValueError(f"asked for the fingerprint of {len(names)} tensors, but the last refit loaded {len(loaded)} others")
        return self.mlperf_loaded_fingerprint
