"""Deterministic kernels per device: what ``train.deterministic`` and the GPU tests switch on.

CPU (what the suite proves bitwise): ``torch.use_deterministic_algorithms(True, warn_only=True)``
as before: every op the model runs on CPU is deterministic.

CUDA: cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``) in the environment before
its first use in the process (torch reads it when it sizes the cuBLAS workspace), and torch's
deterministic mode then picks deterministic kernels where they exist: per
``torch.use_deterministic_algorithms``' documentation ``index_add`` / ``index_select``'s
backward, ``scatter_add_``, ``scatter`` and ``gather``'s backward on CUDA switch to
deterministic versions, which covers the MoE's row moves. Ops that have no deterministic CUDA
kernel raise with ``warn_only=False``; among what Tessera's model runs, the one known is the
float ``cumsum`` of transformers' chunked gated delta rule (the DeltaNet mixer's pure-torch
path, :func:`cuda_nondeterministic`). So on CUDA :func:`use_deterministic` sets
``warn_only=False`` when the model has none of those ops (an op that is not deterministic fails
loudly instead of changing bits silently) and ``warn_only=True`` otherwise, and says which ops
keep the run from being bitwise (docs/running.md, GPU section: the stated tolerance).

Uninitialised memory: under deterministic mode torch also fills every new ``torch.empty``
buffer (NaN for floats, the largest value for integers;
``torch.utils.deterministic.fill_uninitialized_memory``, on by default), so that a read of
memory nobody wrote is reproducible. A communication buffer that a collective overwrites whole
(the expert all-to-alls' and the count exchange's receive buffers) is never read before it is
written, so the fill is a full write of the buffer that changes nothing: :func:`empty_overwritten`
allocates such buffers without it (and only them; the global setting stays on for everything
else), which keeps the run deterministic.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.utils.deterministic as _det

from tessera.spec.model import DeltaNetSpec, ModelSpec

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS workspace setting for reproducible GEMMs (CUDA's cuBLAS documentation, "Results
reproducibility"; the value torch's deterministic mode asks for)."""


def cuda_nondeterministic(model: ModelSpec | None) -> tuple[str, ...]:
    """Ops ``model`` runs on CUDA that have no deterministic kernel (one line each, naming the
    layers); empty when all have one. None (model unknown): the DeltaNet entry, conservatively."""
    if model is None:
        return ("model unknown: assume the DeltaNet mixer's float cumsum",)
    layers = [layer.index for layer in model.layers if isinstance(layer.mixer, DeltaNetSpec)]
    if not layers:
        return ()
    return (f"float cumsum of transformers' torch_chunk_gated_delta_rule (DeltaNet mixer, layers {layers}): "
            "no deterministic CUDA kernel",)


def use_deterministic(device: torch.device | str, model: ModelSpec | None = None) -> tuple[str, ...]:
    """Switch torch's deterministic algorithms on for ``device`` (module docstring); returns the
    ops that keep a CUDA run from being bitwise (empty on CPU, and on CUDA when none).

    On CUDA, ``CUBLAS_WORKSPACE_CONFIG`` is set to :data:`CUBLAS_WORKSPACE_CONFIG` unless the
    environment already has it; call this before the process's first CUDA matmul.
    """
    if torch.device(device).type != "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        return ()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    left = cuda_nondeterministic(model)
    torch.use_deterministic_algorithms(True, warn_only=bool(left))
    return left


def empty_overwritten(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` without deterministic mode's fill of
    uninitialised memory (module docstring): only for a buffer that is written whole before it is
    read (a collective's receive buffer). Outside deterministic mode, or with the fill off, plainly
    ``torch.empty``. The fill setting is process-wide; it is switched off around this one
    allocation only (an allocation on another thread at that instant would go unfilled too)."""
    if not (torch.are_deterministic_algorithms_enabled() and _det.fill_uninitialized_memory):
        return torch.empty(shape, dtype=dtype, device=device)
    _det.fill_uninitialized_memory = False
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    finally:
        _det.fill_uninitialized_memory = True
