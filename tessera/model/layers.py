"""One executable decoder layer built from a :class:`~tessera.spec.model.LayerSpec`.

Structure (pre-norm residual, as transformers' ``Qwen3NextDecoderLayer`` / ``DeepseekV3DecoderLayer``;
a Nemotron-H block is one half: a mixer-only or an MLP-only layer)::

    h   = x + mixer(input_layernorm(x))          # task "mixer"
    hn  = post_attention_layernorm(h)            # part of task "router"
    out = h + (combine(experts(dispatch(hn))) + shared(hn))   # MoE layers
    out = h + mlp(hn)                            # dense layers (task "mlp")

Mixers and norms are the model family's transformers modules (:mod:`tessera.model.mixers`:
Gated DeltaNet, gated / Qwen3-MoE / Nemotron-H attention, MLA, Mamba-2), pure-torch paths on CPU.
The RoPE base and the position limit are the model's (``ModelSpec.rope_theta``,
``ModelSpec.max_positions``). MoE layers: :class:`~tessera.model.moe.MoEBlock` (softmax or
DeepSeek-V3 sigmoid routing, ``MoESpec.router``).

All ``nn.Linear`` inside are swapped for :class:`~tessera.model.wgrad.SplitLinear` (``split_w``)
and tagged with their task kind, so their weight gradients can be deferred to W tasks.

Activation recompute (``recompute``, :class:`~tessera.model.recompute.Recompute`): the task
methods below run their forward, or the regions the mode names, as recompute regions
(:mod:`tessera.model.regions`); the results and gradients are bitwise those without recompute.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.model.mixers import NORM_EPS, build_mixer, make_norm
from tessera.model.moe import Dispatched, MoEBlock, MoEOptions, RouteInfo, derive_seed, make_mlp, seeded
from tessera.model.recompute import Recompute
from tessera.model.regions import CORE_ATTN, checkpointed, drop_output
from tessera.model.wgrad import SplitLinear, split_linears
from tessera.spec.model import DenseMLPSpec, LayerSpec, ModelSpec, MoESpec

RMS_EPS = NORM_EPS["qwen3_next"]
"""The Qwen3-Next family's RMSNorm epsilon (:data:`tessera.model.mixers.NORM_EPS` has each family's)."""


class DecoderLayer(nn.Module):
    """A decoder layer exposing its forward as task functions (see the module docstring).

    Args:
        model: the model spec (for ``hidden`` / ``vocab``).
        spec: this layer's spec (``spec.index`` seeds its weights).
        moe: routing options for MoE layers.
        ep_group: EP process group for the routed experts (None: all local).
        counts_group: the group the MoE layer exchanges its route counts on (the EP group's ranks
            on a communicator of their own; None: ``ep_group``; :class:`~tessera.model.moe.MoEBlock`).
        seed: base seed; weights depend only on (seed, layer index, part, expert id).
        split_w: swap Linear layers for SplitLinear (deferrable weight gradients).
        recompute: what the task forwards drop and re-run in the backward
            (:meth:`Recompute.plan` of ``spec``; default nothing).

    Tensor shapes: ``x``, ``h`` and outputs ``[B, S, H]``; tokens ``[T = B*S, H]``.
    """

    def __init__(self, model: ModelSpec, spec: LayerSpec, *, moe: MoEOptions = MoEOptions(), ep_group=None,
                 seed: int = 0, split_w: bool = True, recompute: Recompute = Recompute(),
                 counts_group=None) -> None:
        super().__init__()
        self.index, self.spec, self.hidden = spec.index, spec, model.hidden
        self.recompute = rc = recompute.plan(spec)
        self.max_positions = model.max_positions
        self.mixer_kind = spec.mixer.kind if spec.mixer is not None else None
        self.input_layernorm = self.attn = self.rotary = None
        self.post_attention_layernorm = self.mlp_module = self.moe = None
        self._mixer_call = None
        with seeded(derive_seed(seed, spec.index, 0)):
            if spec.mixer is not None:
                self.input_layernorm = make_norm(model)
                built = build_mixer(model, spec)
                self.attn, self.rotary, self._mixer_call = built.module, built.rotary, built
            if spec.mlp is not None:
                self.post_attention_layernorm = make_norm(model)
            if isinstance(spec.mlp, DenseMLPSpec):
                self.mlp_module = make_mlp(model.hidden, spec.mlp.ffn, spec.mlp.gated)
        if isinstance(spec.mlp, MoESpec):
            self.moe = MoEBlock(model.hidden, spec.mlp, moe, ep_group, seed=seed, layer_index=spec.index,
                                split_w=split_w, recompute=rc, counts_group=counts_group)
        if split_w:
            if self.attn is not None:
                split_linears(self.attn, "mixer")
            if self.mlp_module is not None:
                split_linears(self.mlp_module, "mlp")
        if rc.core_attn:  # this layer's own config: the attention core runs as a recompute region
            self.attn.config._attn_implementation = CORE_ATTN
        self._linears = {k: tuple(m for m in mod.modules() if isinstance(m, SplitLinear)) if mod is not None else ()
                         for k, mod in (("mixer", self.attn), ("mlp", self.mlp_module),
                                        ("router", None if self.moe is None else self.moe.gate))}

    # --- tasks ------------------------------------------------------------------------------
    def mixer(self, x: torch.Tensor) -> torch.Tensor:
        """Mixer task: ``h = x + mixer(input_layernorm(x))``, ``[B, S, H] -> [B, S, H]``.

        Raises:
            ValueError: an attention layer gets ``S > ModelSpec.max_positions`` tokens.
        """
        if self.attn is None:
            return x
        if self.rotary is not None and x.shape[1] > self.max_positions:
            raise ValueError(f"layer {self.index}: sequence of {x.shape[1]} tokens exceeds the model's max_positions="
                             f"{self.max_positions} (rotary positions 0..S-1)")
        if self.recompute.mixer:
            return checkpointed(self._mixer, x, linears=self._linears["mixer"])
        return self._mixer(x)

    def _mixer(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute.input_norm:
            return x + drop_output(self.input_layernorm, (x,), self._attend, linears=self._linears["mixer"])
        return x + self._attend(self.input_layernorm(x))

    def _attend(self, hn: torch.Tensor) -> torch.Tensor:
        """The mixer on the normed input ``hn [B, S, H]`` (causal mask, RoPE positions 0..S-1
        where the mixer takes them; :class:`tessera.model.mixers.Mixer`)."""
        if self.recompute.mla_up_proj:
            return self._mixer_call.run_mla_up_proj(hn, self.recompute.core_attn)
        return self._mixer_call.run(hn)

    def router(self, h: torch.Tensor) -> RouteInfo:
        """Router task: ``post_attention_layernorm`` then DeepSpeed TopKGate routing."""
        if self.recompute.router:
            return checkpointed(self._router, h, linears=self._linears["router"])
        return self._router(h)

    def _router(self, h: torch.Tensor) -> RouteInfo:
        # the normed tokens are RouteInfo.tokens, which the layer's later tasks hold anyway: only the
        # norm's internals are recomputed (an output-discarding region would free nothing)
        norm = self.post_attention_layernorm
        hn = checkpointed(norm, h) if self.recompute.post_norm else norm(h)
        if self.recompute.gating:
            return checkpointed(self.moe.route, hn.reshape(-1, self.hidden), h, linears=self._linears["router"])
        return self.moe.route(hn.reshape(-1, self.hidden), h)

    def dispatch(self, route: RouteInfo) -> Dispatched:
        """Dispatch task (EP all-to-all when an EP group is set)."""
        return self.moe.dispatch(route)

    def experts(self, d: Dispatched) -> torch.Tensor:
        """Expert task: local experts on ``d.x [N, H]`` -> ``[N, H]``."""
        return self.moe.run_experts(d)

    def shared(self, route: RouteInfo) -> torch.Tensor | None:
        """Shared-expert task: ``[T, H]`` or None."""
        return self.moe.shared(route)

    def combine(self, y: torch.Tensor, d: Dispatched, route: RouteInfo, shared: torch.Tensor | None) -> torch.Tensor:
        """Combine task: layer output ``[B, S, H]``."""
        return self.moe.combine(y, d, route, shared)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """Dense-MLP task: ``h + mlp(post_attention_layernorm(h))``."""
        if self.recompute.mlp:
            return checkpointed(self._mlp, h, linears=self._linears["mlp"])
        return self._mlp(h)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.recompute.post_norm:
            return h + drop_output(self.post_attention_layernorm, (h,), self.mlp_module, linears=self._linears["mlp"])
        return h + self.mlp_module(self.post_attention_layernorm(h))

    # --- whole layer ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer as its tasks in order: mixer, router, dispatch, experts, shared, combine."""
        h = self.mixer(x)
        if self.moe is not None:
            route = self.router(h)
            d = self.dispatch(route)
            y = self.experts(d)
            return self.combine(y, d, route, self.shared(route))
        if self.mlp_module is not None:
            return self.mlp(h)
        return h

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain composed forward (MoE via :meth:`MoEBlock.forward_plain`); needs ep == 1."""
        h = self.mixer(x)
        if self.moe is not None:
            return self.moe.forward_plain(self.router(h))
        if self.mlp_module is not None:
            return self.mlp(h)
        return h
