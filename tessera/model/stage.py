"""A pipeline stage: a contiguous range of the extended layer index space, built alone.

Extended indices (as in ``ModelCosts.layer``): ``-1`` is the embedding, ``0 .. L-1`` the decoder
layers, ``L`` the head (final RMSNorm, output projection, cross-entropy loss). A stage holds the
half-open range ``[start, stop)``, e.g. for L = 8: ``(-1, 4)`` = embedding + layers 0-3 and
``(4, 9)`` = layers 4-7 + head. Weights depend only on (seed, index), so any split of the model
into stages builds the same weights as the whole model in one stage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.errors import TesseraConfigError
from tessera.model.layers import DecoderLayer
from tessera.model.mixers import make_norm
from tessera.model.moe import MoEOptions, derive_seed, seeded
from tessera.model.precision import cast_parameters, module_autocast
from tessera.model.recompute import Recompute
from tessera.model.wgrad import SplitLinear
from tessera.spec.model import ModelSpec


class Embedding(nn.Module):
    """Token embedding (task ``embed``): ids ``[B, S]`` int64 -> ``[B, S, H]``; N(0, 0.02) init.
    Its weight gradient is computed during B (not deferrable)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Head(nn.Module):
    """Final norm (the model family's RMSNorm, :func:`tessera.model.mixers.make_norm`) + output
    projection + mean cross-entropy (task ``head``).

    ``forward(h [B, S, H], labels [B, S] int64) -> loss`` (scalar); ``logits(h) -> [B, S, V]``.
    The output projection is a SplitLinear tagged ``"head"``.
    """

    def __init__(self, model: ModelSpec, split_w: bool = True) -> None:
        super().__init__()
        vocab, hidden = model.vocab, model.hidden
        self.norm = make_norm(model)
        lin = nn.Linear(hidden, vocab, bias=False)
        self.output = SplitLinear.from_linear(lin, "head") if split_w else lin

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class StageModule(nn.Module):
    """The modules of one pipeline stage: optional embedding, decoder layers, optional head.

    Args:
        model: the model spec (L = ``model.num_layers``).
        layer_range: ``(start, stop)`` or ``range`` over extended indices, ``-1 <= start < stop
            <= L + 1``.
        moe: routing options; ep_group: EP group for routed experts; counts_group: the group
            their route counts travel on (the EP group's ranks on a communicator of their own;
            None: ``ep_group``); seed: base seed;
        split_w: use SplitLinear for deferrable weight gradients.
        recompute: activation recompute of the decoder layers
            (:class:`~tessera.model.recompute.Recompute`, from ``planner.activation_recompute`` /
            ``recompute_modules``; default none). The embedding and head are never recomputed.
        compute_dtype: the dtype the forward computes in (resolved ``train.precision``,
            :func:`tessera.model.precision.compute_dtype`): ``torch.float32`` (default) or
            ``torch.bfloat16`` (autocast, :mod:`tessera.model.precision`). The engine's chunks read it.
        param_dtype: the parameters' dtype (:func:`tessera.model.precision.param_dtype`): None or
            ``torch.float32`` (default: FP32 master weights), or ``torch.bfloat16`` (pure BF16:
            the weights are drawn in FP32 by seed, then cast; buffers keep their dtype).

    ``forward(x, labels=None)``: ``x`` is token ids ``[B, S]`` when the stage has the embedding,
    else hidden states ``[B, S, H]``; returns the scalar loss when the stage has the head
    (``labels [B, S]`` required), else hidden states ``[B, S, H]``.
    """

    def __init__(self, model: ModelSpec, layer_range, *, moe: MoEOptions = MoEOptions(), ep_group=None,
                 seed: int = 0, split_w: bool = True, recompute: Recompute = Recompute(),
                 compute_dtype: torch.dtype = torch.float32, counts_group=None,
                 param_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.compute_dtype = compute_dtype
        if isinstance(layer_range, range):
            if layer_range.step != 1:
                raise TesseraConfigError("layer_range", layer_range, "must have step 1", "use range(start, stop)")
            start, stop = layer_range.start, layer_range.stop
        else:
            start, stop = layer_range
        n = model.num_layers
        if not (-1 <= start < stop <= n + 1):
            raise TesseraConfigError("layer_range", (start, stop), f"must satisfy -1 <= start < stop <= {n + 1}",
                                     "use extended indices: -1 embedding, 0..L-1 layers, L head")
        self.model_spec, self.start, self.stop = model, start, stop
        self.embed = self.head = None
        if start == -1:
            with seeded(derive_seed(seed, -1)):
                self.embed = Embedding(model.vocab, model.hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(model, model.layers[i], moe=moe, ep_group=ep_group, seed=seed, split_w=split_w,
                         recompute=recompute, counts_group=counts_group)
            for i in range(max(start, 0), min(stop, n))
        )
        if stop == n + 1:
            with seeded(derive_seed(seed, n)):
                self.head = Head(model, split_w)
        if param_dtype is not None:
            cast_parameters(self, param_dtype)

    @property
    def has_embed(self) -> bool:
        return self.embed is not None

    @property
    def has_head(self) -> bool:
        return self.head is not None

    def layer(self, index: int) -> DecoderLayer:
        """The decoder layer with global index ``index`` (must be in this stage)."""
        first = max(self.start, 0)
        if not first <= index < first + len(self.layers):
            raise KeyError(f"layer {index} is not in stage [{self.start}, {self.stop})")
        return self.layers[index - first]

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.head is not None and labels is None:
            raise ValueError("the last stage needs labels")
        with module_autocast(self)():
            if self.embed is not None:
                x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return x if self.head is None else self.head(x, labels)
