"""Generation with Hugging Face ``transformers``: batched, KV-cached ``generate``.

Sampling is seeded per row: each completion draws its tokens from its own
``random.Random(seed)``, so a completion depends on its prompt, its seed and the
weights, not on which other prompts share its batch. ``generate`` runs greedily over
logits that :class:`RowSeededSampler` has reduced to the one sampled token.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from mlperf_grpo.fingerprint import canary_logits, weights_fingerprint
from mlperf_grpo.inference.base import Completion, SamplingParams
from mlperf_grpo.model import load_model, load_tokenizer


class RowSeededSampler(LogitsProcessor):
    """Samples each row from ``softmax(logits / temperature)`` truncated to ``top_p``
    with that row's own RNG, and returns logits that keep only the sampled token.

    Args:
        seeds: one integer seed per batch row.
        temperature, top_p: as in :class:`SamplingParams`.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float) -> None:
        self._rngs = [random.Random(s) for s in seeds]
        self._temperature = TemperatureLogitsWarper(temperature)
        self._top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self._temperature(input_ids, scores.float())
        if self._top_p is not None:
            scores = self._top_p(input_ids, scores)
        cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)  # [B, V]
        u = torch.tensor([[rng.random()] for rng in self._rngs], dtype=cdf.dtype, device=cdf.device)  # [B, 1]
        u = u * cdf[:, -1:]  # guard against the CDF ending a hair below 1
        chosen = torch.searchsorted(cdf, u).clamp(max=scores.shape[-1] - 1)  # [B, 1]
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(1, chosen, 0.0)


class HFEngine:
    """An inference engine holding its own copy of the model (refit by copying weights).

    Args:
        model_path: local Hugging Face directory or ``builtin:...``.
        dtype: "float32" or "bfloat16" (the rollout dtype).
        batch_size: prompts per ``generate`` call (bounds memory).
    Raises:
        ModelLoadError: the model cannot be loaded.
    """

    def __init__(self, model_path: str, dtype: str, batch_size: int = 256, device: str = "cpu") -> None:
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, dtype, device)
        self.batch_size = batch_size
        self.model_path = model_path

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Refit in place. Every parameter must be given, except names tied to a given one
        (e.g. ``lm_head.weight`` tied to the embeddings), which follow it.

        Raises:
            ValueError: a weight is missing or unknown to the model.
        """
        with torch.no_grad():
            result = self.model.load_state_dict(state_dict, strict=False)
        missing = set(result.missing_keys) - self._tied_names(state_dict)
        if missing or result.unexpected_keys:
            raise ValueError(
                f"weights do not match the engine's model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(result.unexpected_keys)[:5]}"
            )

    def load_checkpoint(self, directory: Path) -> None:
        """Refit in place from every ``*.safetensors`` file of ``directory`` (a ``step_N/``).

        Raises:
            ValueError: a weight is missing or unknown to the model, or no weight file.
        """
        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{directory}: no *.safetensors weight file to refit from")
        state_dict: dict[str, torch.Tensor] = {}
        for path in files:
            state_dict.update(load_file(str(path)))
        self.load_weights(state_dict)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine's model holds its weights in."""
        return self.model.dtype

    def describe(self) -> dict:
        """Engine settings stored with evaluation results (for reproducing them)."""
        import transformers

        return {
            "engine": "transformers.generate",
            "model": self.model_path,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
            "batch_size": self.batch_size,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sampler": "RowSeededSampler (per-row random.Random)",
        }

    def weights_fingerprint(self, names: list[str]) -> str:
        """:func:`~mlperf_grpo.fingerprint.weights_fingerprint` of the engine's tensors
        with these names, in the engine's dtype."""
        own = self.model.state_dict()
        return weights_fingerprint({n: own[n] for n in names})

    canary_is_log_softmax = False
    """:meth:`canary_logits` returns raw logits."""

    def canary_logits(self) -> list[float]:
        """The engine model's logits on the fixed canary input (see fingerprint.py)."""
        return canary_logits(self.model, self.model.config.vocab_size)

    def _tied_names(self, given: dict[str, torch.Tensor]) -> set[str]:
        """Names in the model that share storage with a name in ``given``."""
        own = self.model.state_dict()
        given_ptrs = {own[n].data_ptr() for n in given if n in own}
        return {n for n, t in own.items() if n not in given and t.data_ptr() in given_ptrs}

    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """Sample one completion per prompt, row ``i`` with ``seeds[i]``; see
        :class:`InferenceEngine`. The global torch RNG is not used.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        out: list[Completion] = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            out.extend(self._generate_batch(prompts[start:end], params, seeds[start:end]))
        return out

    def _generate_batch(self, prompts: list[str], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        tok = self.tokenizer
        enc = tok(prompts, padding=True, return_tensors="pt").to(self.model.device)
        result = self.model.generate(
            **enc,
            do_sample=False,
            logits_processor=LogitsProcessorList([RowSeededSampler(seeds, params.temperature, params.top_p)]),
            max_new_tokens=params.max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        prompt_len = enc["input_ids"].shape[1]
        generated = result.sequences[:, prompt_len:]  # [B, T]
        logits = torch.stack(result.logits, dim=1).float()  # [B, T, V], raw (unprocessed)
        logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        token_logprobs = logprobs.gather(-1, generated.unsqueeze(-1)).squeeze(-1)  # [B, T]
        completions = []
        for i in range(len(prompts)):
            ids = generated[i].tolist()
            if tok.eos_token_id in ids:
                ids = ids[: ids.index(tok.eos_token_id) + 1]
            prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            completions.append(
                Completion(
                    prompt_token_ids=prompt_ids,
                    token_ids=ids,
                    logprobs=token_logprobs[i, : len(ids)].tolist(),
                    text=tok.decode(ids, skip_special_tokens=True),
                )
            )
        return completions
