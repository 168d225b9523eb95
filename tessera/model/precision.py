"""The dtype a model's compute runs in (``train.precision``, resolved) and the autocast around it.

Mixed precision as the engine runs it (``train.master_weights=true``, the default): parameters,
gradients and optimizer state stay FP32 (master weights); the forward tasks run under ``torch.autocast(device_type, torch.bfloat16)``
for ``bf16`` (and ``fp8``, which only the cost model distinguishes: the engine computes BF16
there), so autocast's op lists decide: GEMMs and convolutions in BF16, softmax, norms' FP32
internals and cross-entropy in FP32; autograd casts each weight's gradient back to FP32 where it
lands on the parameter. The residual stream stays FP32 (the embedding's output is FP32 and a
residual add of an FP32 and a BF16 tensor is FP32), so the chunk boundaries the pipeline sends
are FP32, while the expert outputs the MoE combine all-to-all carries are BF16. The backward
runs outside autocast in the dtypes autograd recorded; a recompute region re-enters the
forward's autocast state (``torch.utils.checkpoint`` records it). ``fp32``: no autocast.

Pure BF16 (``train.master_weights=false``, :func:`param_dtype`): the weights are drawn in FP32
by seed as always, then every parameter is cast to BF16 (:func:`cast_parameters`; buffers keep
their dtype: the sigmoid router's FP32 correction bias, rotary frequencies), so every layout
holds the same BF16 weights, and the gradients and AdamW's ``exp_avg`` / ``exp_avg_sq`` are BF16
too (2 + 2 + 4 = 8 B per parameter, what the memory model assumes for it; as FSDP2 on a model
loaded in BF16 with ``torch.optim.AdamW``, NeMo AutoModel's recipe). The forward still runs under
the same autocast, which now only keeps its FP32 ops (softmax, norms' internals, cross-entropy)
in FP32; the router computes its logits in FP32 from the BF16 weight
(:func:`tessera.model.moe.gate_routes`). The embedding's output is BF16, so the residual stream
and the chunk boundaries the pipeline sends are BF16 (the engine takes its message dtype from
the parameters); the loss is FP32. Gradients accumulate over microbatches and are reduced over
the data-parallel group in BF16.

Autocast's cast cache is off (``cache_enabled=False``): with it, a tensor that is a leaf (a
detached task boundary, or a weight) and feeds several GEMMs is cast once and the BF16 gradients
of its uses are summed in BF16, while the same tensor inside a connected autograd segment (no
leaf) is cast per use and its gradients are summed in FP32; without the cache every use has its
own cast, so the arithmetic does not depend on the segments the schedule runs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
"""Resolved ``train.precision`` -> the dtype the engine's forward computes in (``fp8``: BF16,
FP8 GEMMs are the cost model's only)."""


def compute_dtype(precision: str) -> torch.dtype:
    """The engine's compute dtype of a resolved ``train.precision`` (:data:`COMPUTE_DTYPES`).

    Raises:
        ValueError: an unknown precision (``auto`` must be resolved first).
    """
    try:
        return COMPUTE_DTYPES[precision]
    except KeyError:
        raise ValueError(f"train.precision={precision!r}: use one of {', '.join(COMPUTE_DTYPES)} "
                         "(resolve auto with tessera.config.auto.resolve_precision)") from None


def param_dtype(precision: str, master_weights: bool) -> torch.dtype:
    """The dtype of the engine's parameters (and so of their gradients and AdamW state) for a
    resolved ``train.precision`` and ``train.master_weights``: FP32 with master weights, else the
    compute dtype (BF16; module docstring).

    Raises:
        ValueError: ``master_weights=False`` with ``fp32`` (no lower precision to keep), or an
            unknown precision.
    """
    dtype = compute_dtype(precision)
    if master_weights:
        return torch.float32
    if dtype == torch.float32:
        raise ValueError(f"train.master_weights=false with train.precision={precision!r}: pure BF16 needs a BF16 "
                         "compute precision; use train.precision=bf16 or train.master_weights=true")
    return dtype


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast every parameter of ``module`` to ``dtype`` in place (the same ``nn.Parameter``
    objects, ``.data`` replaced, as ``Module.to`` does), leaving buffers as they are (module
    docstring); returns ``module``. A no-op for parameters already of ``dtype``."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return module


def autocast(dtype: torch.dtype, device_type: str):
    """The context a forward of compute dtype ``dtype`` runs in on ``device_type`` (``"cpu"``,
    ``"cuda"``): ``torch.autocast(device_type, dtype, cache_enabled=False)`` below FP32 (module
    docstring), else a no-op context."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def module_autocast(module: torch.nn.Module):
    """A zero-argument factory of :func:`autocast` contexts for ``module``: its
    ``compute_dtype`` attribute (FP32 when absent) on the device type of its first parameter."""
    ref = next(module.parameters(), None)
    return functools.partial(autocast, getattr(module, "compute_dtype", torch.float32),
                             ref.device.type if ref is not None else "cpu")
