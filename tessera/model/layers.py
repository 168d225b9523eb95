"""One executable decoder layer built from a :class:`~tessera.spec.model.LayerSpec`.

Structure (pre-norm residual, as transformers' ``Qwen3NextDecoderLayer``)::

    h   = x + mixer(input_layernorm(x))          # task "mixer"
    hn  = post_attention_layernorm(h)            # part of task "router"
    out = h + (combine(experts(dispatch(hn))) + shared(hn))   # MoE layers
    out = h + mlp(hn)                            # dense layers (task "mlp")

Mixers come from transformers (pure-torch paths, CPU-capable): ``Qwen3NextGatedDeltaNet``
(``DeltaNetSpec``; chunked gated delta rule, chunk 64 fixed by transformers), ``Qwen3NextAttention``
(``AttentionSpec(gated=True)``: sigmoid output gate, partial RoPE, q/k RMSNorm) and
``Qwen3MoeAttention`` (``gated=False``, full RoPE only), each with a causal mask and the
``Qwen3NextRotaryEmbedding`` positions ``0..S-1`` of the microbatch. Norms are
``Qwen3NextRMSNorm``. MLA and Mamba-2 mixers are not built (TesseraConfigError). The RoPE base and
the position limit are the model's (``ModelSpec.rope_theta``, ``ModelSpec.max_positions``).

All ``nn.Linear`` inside are swapped for :class:`~tessera.model.wgrad.SplitLinear` (``split_w``)
and tagged with their task kind, so their weight gradients can be deferred to W tasks.

Activation recompute (``recompute``, :class:`~tessera.model.recompute.Recompute`): the task
methods below run their forward, or the regions the mode names, as recompute regions
(:mod:`tessera.model.regions`); the results and gradients are bitwise those without recompute.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextGatedDeltaNet,
    Qwen3NextRMSNorm,
    Qwen3NextRotaryEmbedding,
)

from tessera.errors import TesseraConfigError
from tessera.model.moe import Dispatched, MoEBlock, MoEOptions, RouteInfo, derive_seed, make_mlp, seeded
from tessera.model.recompute import Recompute
from tessera.model.regions import CORE_ATTN, checkpointed, drop_output
from tessera.model.wgrad import SplitLinear, split_linears
from tessera.spec.model import AttentionSpec, DeltaNetSpec, DenseMLPSpec, LayerSpec, ModelSpec, MoESpec

RMS_EPS = 1e-6


def hf_config(model: ModelSpec, layer: LayerSpec) -> Qwen3NextConfig:
    """A one-layer transformers ``Qwen3NextConfig`` with ``layer``'s mixer dims (eager attention),
    ``model.max_positions`` and, for attention, RoPE base ``model.rope_theta``."""
    kw: dict = dict(hidden_size=model.hidden, vocab_size=model.vocab, num_hidden_layers=1, rms_norm_eps=RMS_EPS,
                    hidden_act="silu", max_position_embeddings=model.max_positions, attn_implementation="eager")
    m = layer.mixer
    if isinstance(m, AttentionSpec):
        kw.update(layer_types=["full_attention"], num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                  head_dim=m.head_dim, rope_parameters={"rope_type": "default", "rope_theta": float(model.rope_theta),
                                                        "partial_rotary_factor": m.rotary_fraction})
    elif isinstance(m, DeltaNetSpec):
        kw.update(layer_types=["linear_attention"], linear_num_key_heads=m.num_key_heads,
                  linear_num_value_heads=m.num_value_heads, linear_key_head_dim=m.key_head_dim,
                  linear_value_head_dim=m.value_head_dim, linear_conv_kernel_dim=m.conv_kernel)
    else:
        kw.update(layer_types=["linear_attention"])
    return Qwen3NextConfig(**kw)


def causal_mask(seq: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive causal mask ``[1, 1, S, S]``: 0 on and below the diagonal, dtype-min above."""
    upper = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(upper, torch.finfo(dtype).min)[None, None]


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
        config = hf_config(model, spec)
        self.input_layernorm = self.attn = self.rotary = None
        self.post_attention_layernorm = self.mlp_module = self.moe = None
        m = spec.mixer
        with seeded(derive_seed(seed, spec.index, 0)):
            if m is not None:
                self.input_layernorm = Qwen3NextRMSNorm(model.hidden, eps=RMS_EPS)
                if isinstance(m, DeltaNetSpec):
                    self.attn = Qwen3NextGatedDeltaNet(config, 0)
                elif isinstance(m, AttentionSpec) and m.gated:
                    self.attn = Qwen3NextAttention(config, 0)
                    self.rotary = Qwen3NextRotaryEmbedding(config)
                elif isinstance(m, AttentionSpec):
                    if m.rotary_fraction != 1.0:
                        raise TesseraConfigError(f"model.layers[{spec.index}].mixer.rotary_fraction", m.rotary_fraction,
                                                 "non-gated attention is built with full RoPE only",
                                                 "use rotary_fraction=1.0 or gated=True")
                    self.attn = Qwen3MoeAttention(
                        Qwen3MoeConfig(hidden_size=model.hidden, num_attention_heads=m.num_heads,
                                       num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, rms_norm_eps=RMS_EPS,
                                       max_position_embeddings=model.max_positions, attn_implementation="eager"), 0)
                    self.rotary = Qwen3NextRotaryEmbedding(config)
                else:
                    raise TesseraConfigError(f"model.layers[{spec.index}].mixer", m.kind, "this mixer kind is not built",
                                             "use attention or deltanet layers for executable models")
            if spec.mlp is not None:
                self.post_attention_layernorm = Qwen3NextRMSNorm(model.hidden, eps=RMS_EPS)
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
        """The mixer on the normed input ``hn [B, S, H]`` (causal mask, RoPE positions 0..S-1)."""
        if self.rotary is None:
            return self.attn(hn)
        seq = hn.shape[1]
        positions = torch.arange(seq, device=hn.device).unsqueeze(0)
        out, _ = self.attn(hn, self.rotary(hn, positions), causal_mask(seq, hn.dtype, hn.device))
        return out

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
