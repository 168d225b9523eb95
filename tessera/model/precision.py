"""The dtype a model's compute runs in (``train.precision``, resolved) and the autocast around it.

Mixed precision as the engine runs it: parameters, gradients and optimizer state stay FP32
(master weights); the forward tasks run under ``torch.autocast(device_type, torch.bfloat16)``
for ``bf16`` (and ``fp8``, which only the cost model distinguishes: the engine computes BF16
there), so autocast's op lists decide: GEMMs and convolutions in BF16, softmax, norms' FP32
internals and cross-entropy in FP32; autograd casts each weight's gradient back to FP32 where it
lands on the parameter. The residual stream stays FP32 (the embedding's output is FP32 and a
residual add of an FP32 and a BF16 tensor is FP32), so the chunk boundaries the pipeline sends
are FP32, while the expert outputs the MoE combine all-to-all carries are BF16. The backward
runs outside autocast in the dtypes autograd recorded; a recompute region re-enters the
forward's autocast state (``torch.utils.checkpoint`` records it). ``fp32``: no autocast.

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
