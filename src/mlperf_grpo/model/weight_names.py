"""How the tensor names in a model's weight files map onto its parameters.

In transformers 5 a model class may carry a checkpoint conversion mapping: ``from_pretrained``
renames some saved tensors (GPT-NeoX's ``embed_out`` is its ``lm_head``) and merges others
(Qwen3-MoE's and Qwen3.5-MoE's per-expert ``mlp.experts.N.gate_proj.weight`` and
``up_proj.weight`` become one ``mlp.experts.gate_up_proj`` of shape ``[E, 2 I, H]``), and
``save_pretrained`` writes the saved form. Loaders that read the files by name (the model
check, the sharded torchrun loader) go through this module. Without such a mapping
(transformers 4) the names are the files'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PreTrainedModel


class UnsupportedConversionError(ValueError):
    """The weight files need a merge the sharded loader does not perform."""


@dataclass(frozen=True)
class ExpertParts:
    """A parameter of shape ``[E, parts * R, ...]`` that ``from_pretrained`` builds from
    per-expert tensors of the weight files (``MergeModulelist(dim=0)``, then for several
    parts ``Concatenate(dim=1)``): file tensor ``keys[(e, p)]``, of shape ``[R, ...]``, is
    ``param[e, p * R:(p + 1) * R]``."""

    keys: dict[tuple[int, int], str]
    parts: int


def _mapping(model: PreTrainedModel) -> tuple[list, list]:
    """``(renamings, converters)`` of ``model``'s conversion mapping; empty without one."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
        mapping = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError):
        return [], []
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def loaded_shapes(model: PreTrainedModel, have: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...] | None]:
    """The parameter names ``from_pretrained`` loads the files' tensors ``have`` (name ->
    shape) into: name -> shape for a renamed or unchanged tensor, ``None`` for one merged
    from several (its shape is the merge's)."""
    renamings, converters = _mapping(model)
    if not renamings and not converters:
        return dict(have)
    from transformers.core_model_loading import rename_source_key

    loaded: dict[str, tuple[int, ...] | None] = {}
    for key, shape in have.items():
        name, merged_by = rename_source_key(key, renamings, converters)
        loaded[name] = None if merged_by is not None else shape
    return loaded


def saved_sources(model: PreTrainedModel, have: dict[str, tuple[int, ...]]) -> dict[str, str | ExpertParts]:
    """Where each parameter that the files hold is in them: parameter name -> file tensor
    name, or :class:`ExpertParts` for an expert merge. A parameter the files lack (a tied
    one saved once) is absent.

    Raises:
        UnsupportedConversionError: a merge other than stacking experts (dim 0) and
            concatenating their parts (dim 1), or a source name without its expert index.
    """
    renamings, converters = _mapping(model)
    if not renamings and not converters:
        return {key: key for key in have}
    from transformers.core_model_loading import Concatenate, MergeModulelist, apply_renamings, rename_source_key

    sources: dict[str, str | ExpertParts] = {}
    for key in have:
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            sources[name] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
            raise UnsupportedConversionError(
                f"{key} is merged into {name} by {[type(op).__name__ for op in converter.operations]}, which the "
                "torchrun loader does not perform")
        found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), apply_renamings(key, renamings))
        if found is None or found.lastindex != 1:
            raise UnsupportedConversionError(f"{key}: no expert index where {pattern!r} expects one")
        parts = sources.setdefault(name, ExpertParts({}, len(converter.source_patterns)))
        parts.keys[(int(found.group(1)), converter.source_patterns.index(pattern))] = key
    return sources
