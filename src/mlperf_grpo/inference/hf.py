"""Generation with Hugging Face ``transformers``: batched, KV-cached ``generate``."""

from __future__ import annotations

import torch

from mlperf_grpo.inference.base import Completion, SamplingParams
from mlperf_grpo.model import load_model, load_tokenizer


class HFEngine:
    """An inference engine holding its own copy of the model (refit by copying weights).

    Args:
        model_path: local Hugging Face directory or ``builtin:...``.
        dtype: "float32" or "bfloat16" (the rollout dtype).
        batch_size: prompts per ``generate`` call (bounds memory).
    Raises:
        ModelLoadError: the model cannot be loaded.
    """

    def __init__(self, model_path: str, dtype: str, batch_size: int = 256) -> None:
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, dtype)
        self.batch_size = batch_size

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

    def _tied_names(self, given: dict[str, torch.Tensor]) -> set[str]:
        """Names in the model that share storage with a name in ``given``."""
        own = self.model.state_dict()
        given_ptrs = {own[n].data_ptr() for n in given if n in own}
        return {n for n, t in own.items() if n not in given and t.data_ptr() in given_ptrs}

    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt; see :class:`InferenceEngine`.

        The global torch RNG is seeded with ``params.seed`` inside a forked RNG state, so
        the caller's random state is untouched.
        """
        out: list[Completion] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed)
            for start in range(0, len(prompts), self.batch_size):
                out.extend(self._generate_batch(prompts[start:start + self.batch_size], params))
        return out

    def _generate_batch(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        tok = self.tokenizer
        enc = tok(prompts, padding=True, return_tensors="pt")
        result = self.model.generate(
            **enc,
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
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
