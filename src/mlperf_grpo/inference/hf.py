"""Generation with Hugging Face ``transformers``: batched, KV-cached ``generate``.

Sampling is seeded per row: each completion draws its tokens from its own
``random.Random(seed)``, so a completion depends on its prompt, its seed and the
weights, not on which other prompts share its batch. ``generate`` runs greedily over
logits that :class:`~mlperf_grpo.inference.sampling.RowSeededSampler` has reduced to
the one sampled token; the sampler takes that token's log-probability at the same step,
so no step's full-vocabulary logits outlive it (memory grows with tokens, not tokens x
vocabulary).

On CUDA, models whose layers are all full attention decode instead through
:class:`~mlperf_grpo.inference.decode.SlotDecoder` (a per-slot KV cache grown with the
rows' lengths, refilled slots, each decode step replayed as a CUDA graph) with the same sampler arithmetic
(:func:`~mlperf_grpo.inference.sampling.sample_tokens`); ``decode="generate"`` or a CPU
device keeps ``generate`` (the CPU calibration's path).

Tensor parallel (``tensor_parallel_size`` T > 1, under a process group): the model is
split over the T ranks of this process's group by transformers' own DTensor plan
(:mod:`~mlperf_grpo.inference.tensor_parallel`); each rank holds its slices
(:meth:`HFEngine.weights`, :meth:`HFEngine.weight_slices`), every rank of the group calls
``generate`` with the same prompts and seeds and gets the same completions (the sampler
sees the gathered full-vocabulary logits), and decoding is ``generate`` (the slot
decoder's cache is not split by heads).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from mlperf_grpo.inference.base import (
    Completion,
    SamplingParams,
    Weights,
    completion_length,
    eos_token_ids,
    weight_pairs,
)
from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder
from mlperf_grpo.inference.generation_defaults import generating_with, neutral_generation_config, print_ignored_note
from mlperf_grpo.inference.sampling import RowSeededSampler
from mlperf_grpo.inference.slot_attention import supports_slot_decoding
from mlperf_grpo.inference.slot_probe import slot_decoder_drives
from mlperf_grpo.inference.tensor_parallel import (
    build_tensor_parallel_model,
    full_tensor,
    local_part,
    local_slices,
    local_tensor,
    mesh_of,
    tensor_parallel_mesh,
)
from mlperf_grpo.model.attention import planless_attention
from mlperf_grpo.model.fingerprint import canary_logits, weights_fingerprint
from mlperf_grpo.model.load import build_model_for_refit, check_model_path, encode_prompts, load_model, load_tokenizer

class HFEngine:
    """An inference engine holding its own copy of the model (refit by copying weights).

    Args:
        model_path: local Hugging Face directory or ``builtin:...``.
        dtype: "float32" or "bfloat16" (the rollout dtype).
        batch_size: prompts per ``generate`` call (bounds memory); with slot decoding,
            the most rows in flight (finished rows' slots take waiting prompts).
        device: "cpu" or "cuda".
        tensor_parallel_size: T; above 1 the model is split over the T ranks of this
            process's tensor-parallel group (every rank of the world builds its engine at
            once; each rank reads only its slices of the weight files).
        decode: ``"auto"``: slot decoding with CUDA graphs (:mod:`~mlperf_grpo.inference.decode`)
            on CUDA for a model whose layers are all full attention, else ``generate``;
            ``"generate"``: always ``generate``; ``"slots"``: slot decoding (CUDA graphs on
            CUDA only; raises ValueError for a model it does not support, or at T > 1).
        top_p_candidates: K > 0: on CUDA the slot decoder samples at top-p < 1 from each
            row's K largest logits, running a block of steps again exactly where a
            nucleus is wider (``SlotDecoder``'s option of that name); 0 (the default), or
            on the CPU (whose sort has no stable tie order), the full-vocabulary sampler.
        prefill_graphs: the slot decoder pads each admission to a bucket and, on CUDA,
            captures each bucket's prefill as a CUDA graph (``SlotDecoder``'s option of
            that name; default off).
    Raises:
        ModelLoadError: the model cannot be loaded.
        ValueError: T > 1 without a process group whose world size T divides (a
            ModelLoadError for a model T does not split:
            :func:`~mlperf_grpo.inference.tensor_parallel.parallelize`).

    :meth:`from_model` builds one around a model already in memory (benchmarks, tests).
    Memory per ``generate`` call: the model, its KV cache, ``O(batch_size x tokens)``
    for ids and log-probabilities, and full-vocabulary logits of one step at a time.
    With slot decoding the KV cache (at most ``2 x layers x (batch_size + 1) x kv_heads x
    columns x head_dim`` elements, columns = longest prompt + ``max_new_tokens`` rounded
    up to 64, plus one; else grown with the rows' lengths, ``decode.SlotDecoder``) and the
    graphs stay allocated between calls until :meth:`close` or :meth:`release_memory`.
    """

    def __init__(self, model_path: str, dtype: str, batch_size: int = 256, device: str = "cpu",
                 decode: str = "auto", tensor_parallel_size: int = 1, decoder: DecodeOptions = DecodeOptions()) -> None:
        if tensor_parallel_size == 1:
            self._init(load_model(model_path, dtype, device), load_tokenizer(model_path), batch_size, model_path, decode,
                       decoder)
            return
        mesh = tensor_parallel_mesh(tensor_parallel_size, device)
        self._init(build_tensor_parallel_model(model_path, dtype, device, mesh), load_tokenizer(model_path),
                   batch_size, model_path, decode, decoder)
        self.load_checkpoint(check_model_path(model_path))

    @classmethod
    def for_refit(cls, model_path: str, dtype: str, batch_size: int = 256, device: str = "cpu",
                  decode: str = "auto", tensor_parallel_size: int = 1, decoder: DecodeOptions = DecodeOptions()) -> HFEngine:
        """An engine whose weights are unset until its first :meth:`load_weights` (the
        model built from its config on ``device``, nothing read from the weight files
        nor initialised: :func:`~mlperf_grpo.model.load.build_model_for_refit`, or at T > 1
        :func:`~mlperf_grpo.inference.tensor_parallel.build_tensor_parallel_model` over
        this process's group). For evaluators and the trainer, which refit before every
        use; generating before the first refit gives meaningless text. Args and errors
        as the constructor's."""
        engine = cls.__new__(cls)
        if tensor_parallel_size == 1:
            model = build_model_for_refit(model_path, dtype, device)
        else:
            model = build_tensor_parallel_model(model_path, dtype, device, tensor_parallel_mesh(tensor_parallel_size, device))
        engine._init(model, load_tokenizer(model_path), batch_size, model_path, decode, decoder, weights_set=False)
        return engine

    @classmethod
    def from_model(
        cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 256,
        model_path: str = "in-memory", decode: str = "auto",
    ) -> HFEngine:
        """An engine around ``model`` as it is (its dtype and device; put in eval mode;
        tensor-parallel when its parameters are ``DTensor`` s split by
        :func:`~mlperf_grpo.inference.tensor_parallel.parallelize`).

        Without a tokenizer only :meth:`generate_ids` works and completions have empty
        ``text``; the pad id then comes from ``model.generation_config`` (falling back to
        0). EOS ids: those of the tokenizer and of ``model.generation_config``
        (:func:`~mlperf_grpo.inference.base.eos_token_ids`); none means every row runs to
        ``max_new_tokens``.
        """
        engine = cls.__new__(cls)
        engine._init(model.eval(), tokenizer, batch_size, model_path, decode)
        return engine

    def _init(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, batch_size: int, model_path: str,
        decode: str, decoder: DecodeOptions = DecodeOptions(), weights_set: bool = True,
    ) -> None:
        self.model = model
        mesh = mesh_of(model)
        self.tp_size: int = 1 if mesh is None else mesh.size()
        """T: the ranks the model is split over (1: a whole replica)."""
        self.tp_rank: int = 0 if mesh is None else mesh.get_local_rank()
        """This rank's index in its tensor-parallel group (0 .. T - 1)."""
        self.tp_group: torch.distributed.ProcessGroup | None = None if mesh is None else mesh.get_group()
        """The group's process group; None at T = 1."""
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.model_path = model_path
        self.eos_token_ids: list[int] = eos_token_ids(tokenizer, model.generation_config)
        source = tokenizer if tokenizer is not None else model.generation_config
        pad = _single_id(source.pad_token_id)
        self.pad_token_id: int = pad if pad is not None else (
            self.eos_token_ids[0] if tokenizer is not None and self.eos_token_ids else 0)
        self._decode = decode
        self._unprobed = False  # a slot decoder built before the weights were set: probed at the first generate
        self._decoder = self._slot_decoder(decode, decoder, weights_set)
        self._generation_config = neutral_generation_config(model.generation_config)
        """What ``generate`` runs with: the token ids only (``generation_defaults``)."""
        print_ignored_note(model_path, model.generation_config)

    def _slot_decoder(self, decode: str, decoder: DecodeOptions, weights_set: bool = True) -> SlotDecoder | None:
        """The :class:`SlotDecoder` that ``decode`` asks for, or None for ``generate``;
        ``decoder``'s options, with CUDA graphs and top-p candidates on CUDA only. A model
        the probe finds the slot decoder cannot drive gets ``generate``; without
        ``weights_set`` (an engine built for a refit) the probe waits for the first
        :meth:`generate_ids`, when the weights are the real ones.

        Raises:
            ValueError: ``decode`` is unknown, or ``"slots"`` for a model that needs ``generate``.
        """
        if decode not in ("auto", "generate", "slots"):
            raise ValueError(f"decode is {decode!r}; use auto, generate or slots")
        supported = supports_slot_decoding(self.model) and self.tp_size == 1  # its cache holds every head
        if decode == "slots" and not supported:
            raise ValueError(f"{type(self.model).__name__} has layers other than full attention, or is tensor-parallel: "
                             "use decode='generate'")
        on_cuda = self.model.device.type == "cuda"
        if decode == "generate" or (decode == "auto" and not (supported and on_cuda)):
            return None
        if weights_set and not slot_decoder_drives(self.model, self.pad_token_id, decode):
            return None
        self._unprobed = not weights_set
        return SlotDecoder(self.model, self.batch_size, self.pad_token_id, dataclasses.replace(
            decoder, cuda_graphs=on_cuda, top_p_candidates=decoder.top_p_candidates if on_cuda else 0))

    def load_weights(self, weights: Weights) -> None:
        """Refit in place: each given tensor is copied into the engine's own (any source
        device; from pinned host memory the copies are asynchronous DMAs, waited for once
        at the end, so the caller may reuse the source memory when this returns). Every
        parameter must be given, except names tied to a given one (e.g. ``lm_head.weight``
        tied to the embeddings), which follow it. A state dict is checked before anything
        is copied; ``(name, tensor)`` pairs (a sharded policy's, gathered one at a time)
        as they come, and the missing names at the end. Tensor parallel: each tensor may
        be the full one (this rank copies its slice, :meth:`weight_slices`) or exactly
        this rank's slice; no communication.

        Raises:
            ValueError: a weight is missing, unknown to the model, or of another shape.
        """
        own = self.model.state_dict()
        if isinstance(weights, Mapping):
            self._check_weights(own, {n: t.shape for n, t in weights.items()}, complete=True)
        given: set[str] = set()
        with torch.no_grad():
            for name, tensor in weight_pairs(weights):
                target = own.get(name)
                if target is None or tuple(tensor.shape) not in _accepted_shapes(target):
                    self._check_weights(own, {name: tensor.shape}, complete=False)  # raises, naming it
                local = local_tensor(target)
                local.copy_(tensor if tensor.shape == local.shape else local_part(tensor, target), non_blocking=True)
                given.add(name)
        self._check_weights(own, {n: own[n].shape for n in given}, complete=True)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _check_weights(self, own: dict[str, torch.Tensor], shapes: dict[str, torch.Size], complete: bool) -> None:
        """Raise ValueError unless every name in ``shapes`` is the engine's with that shape
        (full, or this rank's slice) and, when ``complete``, every weight not tied to one
        of them is among them."""
        missing = set(own) - set(shapes) - self._tied_names(shapes) if complete else set()
        unexpected = set(shapes) - set(own)
        wrong = sorted(n for n in set(shapes) & set(own) if tuple(shapes[n]) not in _accepted_shapes(own[n]))
        if missing or unexpected or wrong:
            raise ValueError(
                f"weights do not match the engine's model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}, other shape {wrong[:5]}"
            )

    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's own weights (its model's ``state_dict``: no copy); tensor
        parallel: this rank's local slices (``full[weight_slices()[name]]``)."""
        own = self.model.state_dict()
        return own if self.tp_size == 1 else {n: local_tensor(t) for n, t in own.items()}

    def weight_slices(self) -> dict[str, tuple[slice, ...] | None]:
        """For each tensor of :meth:`weights`, the index into the full tensor of what
        this rank holds (one slice per dim; whole for replicated tensors and at T = 1);
        None for a packed parameter (fused gate/up experts), which no index gives: read
        it in full and :meth:`load_weights` cuts it
        (:func:`~mlperf_grpo.inference.tensor_parallel.local_slices`)."""
        return {n: local_slices(t) for n, t in self.model.state_dict().items()}

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full tensor, one at a time, in sorted name order, on the engine's device.
        Tensor parallel: each split tensor is all-gathered over :attr:`tp_group` when its
        turn comes (a collective: every rank of the group must iterate to the end), so at
        most one full tensor exists besides the slices; T = 1: :meth:`weights`' tensors,
        no communication."""
        own = self.model.state_dict()
        for name in sorted(own):  # sorted: every rank of the group gathers the same tensor at once
            yield name, full_tensor(own[name])

    def load_checkpoint(self, directory: Path) -> None:
        """Refit in place from every ``*.safetensors`` file of ``directory`` (a ``step_N/``
        or a model directory), one tensor at a time; tensor parallel: only this rank's
        slice of each tensor is read (safetensors slicing).

        Raises:
            ValueError: a weight is missing or unknown to the model, or no weight file.
        """
        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{directory}: no *.safetensors weight file to refit from")
        slices = self.weight_slices()
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(safe_open(str(path), framework="pt")) for path in files]
            names = {name: f for f in opened for name in f.keys()}
            self._check_weights(self.model.state_dict(), {n: f.get_slice(n).get_shape() for n, f in names.items()},
                                complete=True)
            self.load_weights((n, f.get_tensor(n) if slices.get(n) is None or self.tp_size == 1
                               else f.get_slice(n)[slices[n]]) for n, f in names.items())

    @property
    def device(self) -> torch.device:
        """Where the engine's model lives."""
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine's model holds its weights in."""
        return self.model.dtype

    def describe(self) -> dict:
        """Engine settings stored with evaluation results (for reproducing them)."""
        import transformers

        return {
            "engine": "transformers.generate" if self._decoder is None else "slot decoder (KV cache grown to the rows' lengths, refilled slots)",
            "cuda_graphs": self._decoder is not None and self._decoder.cuda_graphs,
            "top_p_candidates": 0 if self._decoder is None else self._decoder.top_p_candidates,
            "prefill_graphs": self._decoder is not None and self._decoder.prefill_graphs and self._decoder.cuda_graphs,
            "fused_kernels": [] if self._decoder is None else self._decoder.fused_kernels,
            "model": self.model_path,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
            "batch_size": self.batch_size,
            "tensor_parallel_size": self.tp_size,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sampler": "RowSeededSampler (per-row random.Random)",
        }

    def generation_stats(self) -> dict[str, int | float]:
        """The slot decoder's counts of the last call (``decode_steps``: forward passes
        after the prefills; ``rerun_steps``: steps run again exactly, a nucleus beyond the
        top-p candidates; ``graph_captures``: decode steps and prefills captured as new
        CUDA graphs; ``prefills``: admissions of waiting prompts, each a forward (eager, or
        a graph's replay with ``prefill_graphs``); ``prefill_ms``: their device time, ms;
        ``cache_grows``: KV cache widenings; ``preempted``: rows preempted to keep it in its
        budget; ``kv_cache_peak_bytes``: the most it held); ``{}`` with ``generate``."""
        d = self._decoder
        return {} if d is None else {"decode_steps": d.decode_steps, "rerun_steps": d.rerun_steps,
                                     "graph_captures": d.graph_captures, "prefills": d.prefills,
                                     "prefill_ms": round(d.prefill_ms, 2), "cache_grows": d.cache_grows,
                                     "preempted": d.preempted, "kv_cache_peak_bytes": d.kv_cache_peak_bytes}

    def weights_fingerprint(self, names: list[str]) -> str:
        """:func:`~mlperf_grpo.model.fingerprint.weights_fingerprint` of the engine's tensors
        with these names, in the engine's dtype (tensor parallel: this rank's slices)."""
        own = self.weights()
        return weights_fingerprint({n: own[n] for n in names})

    def release_memory(self) -> None:
        """Free the slot decoder's KV cache and CUDA graphs until the next :meth:`generate`
        (which allocates and captures them again); the weights stay."""
        if self._decoder is not None:
            self._decoder.release()

    def close(self) -> None:
        """Drop the slot decoder's KV cache and CUDA graphs; the model is freed with the engine."""
        self._decoder = None

    canary_is_log_softmax = False
    """:meth:`canary_logits` returns raw logits."""

    def canary_logits(self) -> list[float]:
        """The engine model's logits on the fixed canary input (see model/fingerprint.py)."""
        return canary_logits(self.model, self.model.config.vocab_size)

    def _tied_names(self, given: dict[str, object]) -> set[str]:
        """Names in the model that share storage with a name in ``given``."""
        own = self.weights()
        given_ptrs = {own[n].data_ptr() for n in given if n in own}
        return {n for n, t in own.items() if n not in given and t.data_ptr() in given_ptrs}

    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """Sample one completion per prompt, row ``i`` with ``seeds[i]``; see
        :class:`InferenceEngine`. The global torch RNG is not used.

        Raises:
            ValueError: the engine has no tokenizer, or prompts and seeds differ in number.
        """
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids to generate_ids")
        return self.generate_ids(encode_prompts(self.tokenizer, prompts), params, seeds)

    @torch.no_grad()
    def generate_ids(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> list[Completion]:
        """:meth:`generate` for prompts given as token ids (unpadded), in batches of
        ``batch_size``, each left-padded to its longest prompt.

        Raises:
            ValueError: prompts and seeds differ in number; or, at the first call of an
                engine built for a refit with ``decode="slots"``, the slot decoder does not
                drive the model (:func:`~mlperf_grpo.inference.slot_probe.slot_decoder_drives`).
        """
        if len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(prompt_token_ids)} prompts but {len(seeds)} seeds")
        if self._unprobed:  # built for a refit: the weights are set now
            self._unprobed = False
            if not slot_decoder_drives(self.model, self.pad_token_id, self._decode):
                self._decoder = None
        if self._decoder is not None:
            rows = self._decoder.generate(prompt_token_ids, seeds, params.temperature, params.top_p,
                                          params.max_new_tokens, self.eos_token_ids)
            return [self._completion(p, ids, logprobs) for p, (ids, logprobs) in zip(prompt_token_ids, rows)]
        out: list[Completion] = []
        for start in range(0, len(prompt_token_ids), self.batch_size):
            end = start + self.batch_size
            out.extend(self._generate_batch(prompt_token_ids[start:end], params, seeds[start:end]))
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts])  # [B, P], left-padded
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
        sampler = RowSeededSampler(seeds, params.temperature, params.top_p, params.max_new_tokens)
        with planless_attention(), generating_with(self.model, self._generation_config):
            sequences = self.model.generate(
                input_ids=input_ids.to(self.model.device),
                attention_mask=attention_mask.to(self.model.device),
                do_sample=False,
                logits_processor=LogitsProcessorList([sampler]),
                max_new_tokens=params.max_new_tokens,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_ids or None,
            )  # [B, P + T]; stops once every row has produced one of the EOS ids
        generated = sequences[:, width:].cpu()  # [B, T]
        token_logprobs = sampler.token_logprobs()[:, : generated.shape[1]].cpu()  # [B, T]
        completions = []
        for prompt, ids, logprobs in zip(prompts, generated.tolist(), token_logprobs.tolist()):
            ids = ids[: completion_length(ids, self.eos_token_ids)]  # rows that ended are padded after
            completions.append(self._completion(prompt, ids, logprobs[: len(ids)]))
        return completions

    def _completion(self, prompt: list[int], ids: list[int], logprobs: list[float]) -> Completion:
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Completion(prompt_token_ids=list(prompt), token_ids=ids, logprobs=logprobs, text=text)


def _accepted_shapes(target: torch.Tensor) -> set[tuple[int, ...]]:
    """The shapes a refit may give for ``target``: the full tensor's and this rank's slice's."""
    return {tuple(target.shape), tuple(local_tensor(target).shape)}


def _single_id(token_id: int | list[int] | None) -> int | None:
    """The first id of a (possibly list-valued) special-token id, or None."""
    if isinstance(token_id, list):
        return token_id[0] if token_id else None
    return token_id
