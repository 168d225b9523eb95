"""Rules of a resolved :class:`~tessera.spec.model.ModelSpec` (inline and Hugging Face models can
carry any value; presets pass them by construction), and the dims tensor parallelism splits.

:func:`check_model` runs before anything is costed: every size is an integer in range, layers
are numbered in order, every layer has a mixer or an MLP, ``top_k <= num_experts``. Each distinct
spec object is checked once, so a 1024-layer model costs a few hundred checks.

:func:`tp_split_dims` lists the dims the analytic cost model divides by ``parallel.tp``
(:mod:`tessera.cost.flops`, :mod:`tessera.cost.memory`): every token-mixer op is scaled by
``1/tp`` (attention query *and* KV heads are split, not replicated; MLA heads; Gated DeltaNet key
and value heads; Mamba-2 heads and groups), the shared expert and the dense MLP are scaled by
``1/tp``, and the output head and embedding are vocabulary-parallel. Routed experts are *not*
split by tp (each GPU runs whole experts on its tokens/tp tokens), so ``expert_ffn`` is not listed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tessera.config.limits import MAX_MODEL_DIM, MODEL_DIM, MODEL_LAYERS, MTP_LAYERS
from tessera.errors import TesseraConfigError
from tessera.spec.model import (AttentionSpec, DeltaNetSpec, DenseMLPSpec, Mamba2Spec, MIXER_TYPES, MLASpec,
                                MLP_TYPES, ModelSpec, MoESpec)

# int fields that may be 0 (0 = none); every other int field of a layer spec must be >= 1
_MAY_BE_ZERO = {"shared_expert_ffn", "latent_dim"}


def _int_in(field: str, v: Any, lo: int, hi: int, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TesseraConfigError(field, v, f"must be an integer ({what})", f"give an integer in {lo}..{hi}")
    if not lo <= v <= hi:
        reason = f"; the limit: {MODEL_DIM.reason}" if v > hi and hi == MAX_MODEL_DIM else ""
        raise TesseraConfigError(field, v, f"must be in {lo}..{hi} ({what}{reason})", f"give an integer in {lo}..{hi}")


def _check_spec(field: str, spec: Any, kinds: dict[str, type]) -> None:
    if not isinstance(spec, tuple(kinds.values())):
        raise TesseraConfigError(field, spec, f"must be one of the specs {', '.join(kinds)}",
                                 "give a mapping of that spec's fields (docs/recipes.md, model.inline)")
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        where = f"{field}.{f.name}"
        if f.type in ("int", int):
            _int_in(where, v, 0 if f.name in _MAY_BE_ZERO else 1, MAX_MODEL_DIM, f"{spec.kind} {f.name}")
        elif f.type in ("bool", bool):
            if not isinstance(v, bool):
                raise TesseraConfigError(where, v, "must be true or false", f"give {f.name}: true or false")
        elif f.type in ("float", float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
                raise TesseraConfigError(where, v, "must be a number >= 0", f"give {f.name} as a number")
            if f.name == "rotary_fraction" and v > 1:
                raise TesseraConfigError(where, v, "must be in [0, 1] (fraction of head_dim with RoPE)",
                                         "use e.g. 1.0 (full rotary) or 0.25 (Qwen3-Next)")
    if isinstance(spec, MoESpec):
        _check_moe(field, spec)


def _check_moe(field: str, spec: MoESpec) -> None:
    if spec.top_k > spec.num_experts:
        raise TesseraConfigError(f"{field}.top_k", spec.top_k, f"must be <= num_experts={spec.num_experts}",
                                 f"use top_k in 1..{spec.num_experts}")
    if spec.router not in ("softmax", "sigmoid"):
        raise TesseraConfigError(f"{field}.router", spec.router, "must be 'softmax' (DeepSpeed top-k, Qwen3) or "
                                 "'sigmoid' (DeepSeek-V3 / Nemotron-H)", "use router: softmax or router: sigmoid")
    if spec.num_experts % spec.num_groups:
        raise TesseraConfigError(f"{field}.num_groups", spec.num_groups,
                                 f"must divide num_experts={spec.num_experts} (equal expert groups)",
                                 "use a divisor of num_experts, or 1 for no group limit")
    if spec.topk_groups > spec.num_groups:
        raise TesseraConfigError(f"{field}.topk_groups", spec.topk_groups, f"must be <= num_groups={spec.num_groups}",
                                 f"use topk_groups in 1..{spec.num_groups}")
    if spec.router == "softmax":  # what only the sigmoid router reads must not be given to it silently
        for name, value, default in (("routed_scaling", spec.routed_scaling, 1.0),
                                     ("bias_update_rate", spec.bias_update_rate, 0.0),
                                     ("num_groups", spec.num_groups, 1), ("topk_groups", spec.topk_groups, 1)):
            if value != default:
                raise TesseraConfigError(f"{field}.{name}", value, "is read by the sigmoid (DeepSeek-V3) router "
                                         "only; the softmax router would ignore it",
                                         f"use router: sigmoid, or {name}: {default}")
    per_group = spec.num_experts // spec.num_groups
    if spec.router == "sigmoid" and spec.num_groups > 1 and per_group < 2:
        raise TesseraConfigError(f"{field}.num_groups", spec.num_groups, "a group's score is its two best experts' "
                                 "(DeepSeek-V3 routing): groups need >= 2 experts", "use fewer groups")
    if spec.router == "sigmoid" and spec.top_k > spec.topk_groups * per_group:
        raise TesseraConfigError(f"{field}.top_k", spec.top_k, f"must be <= topk_groups * experts per group = "
                                 f"{spec.topk_groups * per_group}", "raise topk_groups or lower top_k")


def check_model(model: ModelSpec, field: str) -> None:
    """Check the sizes of a resolved model (``field``: its recipe source, e.g. ``"model.inline"``,
    used as the prefix of the field named in errors, e.g. ``model.inline.layers[3].mixer.num_heads``).

    Raises:
        TesseraConfigError: no layers or more than 1024; ``hidden``/``vocab`` or a layer dim not an
            integer in range (1..2**24; 0 allowed for ``shared_expert_ffn``/``latent_dim``); a layer
            with neither mixer nor MLP or out of order; ``top_k > num_experts``; ``mtp_layers``
            outside 0..16; a non-positive ``rope_theta``/``max_positions``.
    """
    n = model.num_layers
    if not 1 <= n <= MODEL_LAYERS.value:
        raise TesseraConfigError(f"{field}.layers", n, f"a model needs 1..{MODEL_LAYERS.value} layers "
                                 f"({MODEL_LAYERS.reason})", "give at least one decoder layer")
    _int_in(f"{field}.hidden", model.hidden, 1, MAX_MODEL_DIM, "model width")
    _int_in(f"{field}.vocab", model.vocab, 1, MAX_MODEL_DIM, "vocabulary size")
    _int_in(f"{field}.mtp_layers", model.mtp_layers, 0, MTP_LAYERS.value, MTP_LAYERS.reason)
    theta, positions = getattr(model, "rope_theta", 1.0), getattr(model, "max_positions", 1)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise TesseraConfigError(f"{field}.rope_theta", theta, "must be a positive number", "use e.g. 10000.0")
    _int_in(f"{field}.max_positions", positions, 1, 2**40, "longest sequence the positions cover")
    seen: set[int] = set()
    for i, layer in enumerate(model.layers):
        where = f"{field}.layers[{i}]"
        if layer.index != i:
            raise TesseraConfigError(f"{where}.index", layer.index, f"must be {i} (layers are numbered in order)",
                                     f"set index: {i}")
        if layer.mixer is None and layer.mlp is None:
            raise TesseraConfigError(where, None, "has neither a mixer nor an mlp", "give the layer a mixer or an mlp")
        for part, spec, kinds in (("mixer", layer.mixer, MIXER_TYPES), ("mlp", layer.mlp, MLP_TYPES)):
            if spec is not None and id(spec) not in seen:
                _check_spec(f"{where}.{part}", spec, kinds)
                seen.add(id(spec))


def tp_split_dims(model: ModelSpec) -> tuple[tuple[str, int], ...]:
    """``(what, value)`` of every distinct dim the cost model divides by tp, in layer order
    (module docstring), ending with the vocabulary; e.g. ``("attention query heads", 16)``."""
    out: dict[tuple[str, int], None] = {}
    seen: set[int] = set()
    for layer in model.layers:
        for spec in (layer.mixer, layer.mlp):
            if spec is None or id(spec) in seen:
                continue
            seen.add(id(spec))
            if isinstance(spec, AttentionSpec):
                dims = [("attention query heads", spec.num_heads), ("attention KV heads", spec.num_kv_heads)]
            elif isinstance(spec, MLASpec):
                dims = [("MLA heads", spec.num_heads)]
            elif isinstance(spec, DeltaNetSpec):
                dims = [("Gated DeltaNet key heads", spec.num_key_heads),
                        ("Gated DeltaNet value heads", spec.num_value_heads)]
            elif isinstance(spec, Mamba2Spec):
                dims = [("Mamba-2 heads", spec.num_heads), ("Mamba-2 groups", spec.n_groups)]
            elif isinstance(spec, MoESpec):
                dims = [("shared-expert FFN width", spec.shared_expert_ffn)] if spec.shared_expert_ffn > 0 else []
            elif isinstance(spec, DenseMLPSpec):
                dims = [("dense MLP width", spec.ffn)]
            else:
                dims = []
            out.update(dict.fromkeys(dims))
    out[("vocabulary", model.vocab)] = None
    return tuple(out)
