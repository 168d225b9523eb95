"""Sparse MoE block split into tasks: router, dispatch, expert, shared, combine.

Routing is DeepSpeed's ``deepspeed.moe.sharded_moe.TopKGate`` (its ``top1gating`` /
``top2gating`` / ``topkgating`` functions: capacity factor, ``min_capacity``, ``drop_tokens``,
load-balancing aux loss); where DeepSpeed is not installed, dropless deterministic routing comes
from :mod:`tessera.model.gating` with the same numbers (:data:`GATING_SOURCE` says which). Routed
experts and the shared expert are transformers' ``Qwen3NextMLP`` (SwiGLU: ``down(silu(gate(x)) * up(x))``); the shared expert is scaled by
``sigmoid(shared_expert_gate(x))`` as in Qwen3-Next. Experts live on the ranks of an optional EP
group (:mod:`tessera.model.ep`, its synchronous front); rank ``r`` holds global experts
``[r*E_l, (r+1)*E_l)``.

Row order: routes are sent sorted by (global expert, token index); an expert sees its rows in
(source rank, token) order. Combine adds each token's routes in expert order into zeros.
The aux loss is attached to the combine output by an autograd function whose backward feeds
``aux_loss_coef * aux_loss_scale`` into the aux loss, so each stage's aux losses reach the router
without being sent between pipeline stages (Megatron's aux-loss auto-scaler idea).

The router runs in FP32 (Megatron keeps it there): the gate's logits and DeepSpeed's gating run
with autocast off, so under BF16 autocast the top-k is still chosen on FP32 logits.

Host synchronisation: the router task reads nothing on the host (the kept routes are sorted
without ``nonzero``, the counts are formed without ``bincount`` and the capacity stays a tensor);
dispatch makes the MoE layer's one host read, in the plan (:func:`tessera.model.ep.plan_route`).
DeepSpeed's top-1 gating in dropless mode reads its capacity on the host itself (a Python ``min``
of two tensors); top-2 and top-k gating do not.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import time
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextMLP

from tessera.errors import TesseraConfigError
from tessera.model import ep as ep_ops
from tessera.model import gating
from tessera.model.hostsync import HostSyncs
from tessera.model.recompute import NO_RECOMPUTE, LayerRecompute
from tessera.model.regions import checkpointed, drop_output
from tessera.model.wgrad import SplitLinear, split_linears
from tessera.spec.model import MoESpec

try:
    from deepspeed.moe.sharded_moe import TopKGate, multiplicative_jitter, top1gating, top2gating, topkgating

    GATING_SOURCE = "deepspeed"
    """Who routes: ``"deepspeed"`` when DeepSpeed imports, else :data:`tessera.model.gating.SOURCE`."""
except ImportError:  # only torch and transformers here (e.g. the one-GPU check): the same numbers, dropless
    TopKGate = gating.Router
    GATING_SOURCE = gating.SOURCE


@dataclass(frozen=True)
class MoEOptions:
    """Routing options passed to DeepSpeed's TopKGate (its defaults except where noted).

    ``drop_tokens=False`` (dropless; capacity = max routes per expert, agreed over the EP group),
    ``use_rts=False`` and ``top2_2nd_expert_sampling=False`` (deterministic routing) differ from
    DeepSpeed's defaults. ``aux_loss_scale`` multiplies the aux-loss gradient (e.g. 1/microbatches).
    """

    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 8
    drop_tokens: bool = False
    use_rts: bool = False
    top2_2nd_expert_sampling: bool = False
    noisy_gate_policy: str | None = None
    shared_expert_gate: bool = True
    aux_loss_scale: float = 1.0


@dataclass(frozen=True, eq=False)
class RouteInfo:
    """Output of the router task for ``T = batch * seq`` tokens, top-k routes each.

    Attributes:
        tokens: ``[T, H]`` normalised tokens (expert and shared-expert input; differentiable).
        residual: ``[B, S, H]`` the layer's residual stream after the mixer.
        expert_index: int64 ``[k, T]`` global expert of each route; -1 if dropped by capacity.
        gates: float32 ``[k, T]`` combine weights (0 for dropped routes; differentiable).
        aux_loss: scalar load-balancing loss (DeepSpeed's ``l_aux``).
        requested: int64 ``[E]`` routes per expert before capacity dropping (``exp_counts``).
        counts: int64 ``[E]`` routes kept per expert (what dispatch sends).
        capacity: this rank's capacity, a 0-d integer tensor, not read on the host by the router
            (drop: DeepSpeed's ``ceil(T/E * cf * k)`` floored at ``min_capacity``, on the CPU;
            dropless: the largest local count, on the router's device).
        order: int64 ``[k*T]`` flat route ids ``j*T + t``, the kept routes sorted by (expert,
            token) first, then the dropped ones (expert -1, drop mode only): its first
            ``sum(counts)`` entries are the send order of dispatch (the rest is never sent).
    """

    tokens: torch.Tensor
    residual: torch.Tensor
    expert_index: torch.Tensor
    gates: torch.Tensor
    aux_loss: torch.Tensor
    requested: torch.Tensor
    counts: torch.Tensor
    capacity: torch.Tensor | int
    order: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True, eq=False)
class Dispatched:
    """Output of the dispatch task: the rows this rank's experts compute.

    Attributes:
        x: ``[N, H]`` expert inputs, expert-major (local expert 0's rows first).
        counts: rows per local expert (``[E_l]``), ``sum(counts) == N``.
        capacity: capacity agreed over the EP group: the max of the ranks' ``RouteInfo.capacity``
            (with ``drop_tokens`` each rank drops with its own DeepSpeed capacity first; equal
            token counts per rank give equal capacities).
        plan: the all-to-all plan (None when ep == 1).
    """

    x: torch.Tensor
    counts: tuple[int, ...]
    capacity: int
    plan: ep_ops.A2APlan | None


class _AttachAux(torch.autograd.Function):
    """Identity on ``y``; backward also sends ``coef`` as the gradient of the scalar ``aux``."""

    @staticmethod
    def forward(ctx, y, aux, coef):
        ctx.coef = coef
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        return gy, torch.full((), ctx.coef, dtype=torch.float32), None


def attach_aux_loss(y: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    """Return ``y`` unchanged; its backward adds ``coef * d(aux)`` to the graph behind ``aux``."""
    if not aux.requires_grad or coef == 0.0:
        return y
    return _AttachAux.apply(y, aux, float(coef))


def gate_routes(gate: TopKGate, x: torch.Tensor, seq_len: int | None = None):
    """Run DeepSpeed's gating for ``x [T, H]`` exactly as ``TopKGate.forward(x, None, True)``,
    except that the logits come from calling ``gate.wg`` (so a SplitLinear router defers W) and
    that top-1 gating gets ``min(min_capacity, T)`` as its ``min_capacity``.

    DeepSpeed's ``top1gating`` asserts ``T >= min_capacity`` (a bare AssertionError, also in
    dropless mode, e.g. for fewer than 8 tokens per microbatch with the default 8). The floor
    ``min_capacity`` only raises the capacity, and a capacity of ``T`` already keeps every route
    of a top-1 gate, so routes, gates and the aux loss are unchanged; only the reported capacity
    of a drop-mode gate is ``T`` instead of ``min_capacity`` then.

    The gate runs in FP32 with autocast off (logits and gating): under BF16 autocast the
    logits, and so the top-k choice and the gates, are FP32 as in Megatron's router. Without
    autocast nothing changes.

    A :class:`~tessera.model.gating.SigmoidRouter` (``MoESpec.router="sigmoid"``) routes with
    DeepSeek-V3's rule instead; ``seq_len`` (tokens per sequence of ``x``, default all of ``x``)
    is its aux loss's sequence length.

    Returns DeepSpeed's sparse-route tuple ``(l_aux, capacity, E, indices [k, T] int32,
    locations [k, T] int32, gates [k, T] float32, exp_counts [E])``.

    Raises:
        ValueError: DeepSpeed rejects the input (one line naming T, E, k and min_capacity).
    """
    with torch.autocast(x.device.type, enabled=False):
        return _gate_routes_fp32(gate, x.float(), x.shape[0] if seq_len is None else seq_len)


def _gate_routes_fp32(gate: TopKGate, xf: torch.Tensor, seq_len: int):
    if isinstance(gate, gating.SigmoidRouter):
        w = gate.wg.weight
        return gate.routes(gate.wg(xf) if w.dtype == torch.float32 else F.linear(xf, w.float()), seq_len)
    if isinstance(gate, gating.Router):
        w = gate.wg.weight
        return gating.dropless_routes(gate.wg(xf) if w.dtype == torch.float32 else F.linear(xf, w.float()), gate.k)
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        xf = multiplicative_jitter(xf, device=xf.device)
    w = gate.wg.weight
    logits = gate.wg(xf) if w.dtype == torch.float32 else F.linear(xf, w.float())
    cf = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    try:
        if gate.k == 1:
            policy = gate.noisy_gate_policy if gate.training else None
            floor = min(int(gate.min_capacity), logits.shape[0])
            return top1gating(logits, cf, floor, None, policy, gate.drop_tokens, gate.use_rts, None, True, False)
        if gate.k == 2:
            return top2gating(logits, cf, gate.min_capacity, gate.drop_tokens, None, gate.top2_2nd_expert_sampling,
                              True)
        return topkgating(logits, gate.k, cf, gate.min_capacity, gate.drop_tokens, None, sparse_routes=True)
    except AssertionError as e:
        raise ValueError(f"MoE routing of {logits.shape[0]} tokens over {logits.shape[1]} experts (top-{gate.k}, "
                         f"min_capacity={gate.min_capacity}, drop_tokens={gate.drop_tokens}) rejected by DeepSpeed: "
                         f"{str(e).splitlines()[0] if str(e) else 'assertion failed'}") from None


class _SquaredReLUMLP(nn.Module):
    """Non-gated expert ``down(relu(up(x))**2)`` (Nemotron-H style, ``MoESpec.gated=False``);
    ``act_recompute``: the activation output (the down-projection input) is rebuilt in the
    backward from ``up(x)`` (:func:`~tessera.model.regions.drop_output`)."""

    def __init__(self, hidden: int, ffn: int, act_recompute: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act_recompute = act_recompute

    @staticmethod
    def _act(u: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(u))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_recompute:
            return drop_output(self._act, (self.up_proj(x),), self.down_proj, linears=(self.down_proj,))
        return self.down_proj(self._act(self.up_proj(x)))


class _RecomputedActMLP(Qwen3NextMLP):
    """``Qwen3NextMLP`` (same parameters and names) whose ``act(gate(x)) * up(x)``, the
    down-projection input, is rebuilt in the backward from the two fc1 outputs
    (:func:`~tessera.model.regions.drop_output`); bitwise the plain forward."""

    def _act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.act_fn(g) * u

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x)
        return drop_output(self._act, (g, self.up_proj(x)), self.down_proj, linears=(self.down_proj,))


def make_mlp(hidden: int, ffn: int, gated: bool = True, act_recompute: bool = False) -> nn.Module:
    """SwiGLU MLP (transformers ``Qwen3NextMLP``) or a squared-ReLU MLP; ``[.., H] -> [.., H]``;
    ``act_recompute``: its activation output is recomputed in the backward (``moe_act``)."""
    if not gated:
        return _SquaredReLUMLP(hidden, ffn, act_recompute)
    cls = _RecomputedActMLP if act_recompute else Qwen3NextMLP
    return cls(Qwen3NextConfig(hidden_size=hidden, hidden_act="silu"), intermediate_size=ffn)


class ExpertList(nn.ModuleList):
    """A rank's local experts (an ``nn.ModuleList``: same parameter names); ``recompute``: the
    expert task's forward is one recompute region (:func:`expert_rows`)."""

    recompute: bool = False


def expert_rows(experts, x: torch.Tensor, counts) -> torch.Tensor:
    """``experts`` (in order) on expert-major rows ``x [N, H]``, ``counts[e]`` rows for expert
    ``e``: split, each expert, cat; ``[N, H]`` with its graph. Experts without rows run on
    ``[0, H]`` (zero gradients). An :class:`ExpertList` with ``recompute`` runs it as one
    checkpoint (:func:`~tessera.model.regions.checkpointed`)."""
    if getattr(experts, "recompute", False):
        linears = tuple(m for m in experts.modules() if isinstance(m, SplitLinear))
        return checkpointed(lambda t: _rows(experts, t, counts), x, linears=linears)
    return _rows(experts, x, counts)


def _rows(experts, x: torch.Tensor, counts) -> torch.Tensor:
    parts = torch.split(x, list(counts), dim=0)
    return torch.cat([expert(p) for expert, p in zip(experts, parts)], dim=0)


def derive_seed(*parts: int) -> int:
    """Deterministic seed from integers (so weights do not depend on stage or EP layout)."""
    return hash(tuple(parts)) & 0x7FFF_FFFF_FFFF


@contextlib.contextmanager
def seeded(seed: int):
    """Run the block with the CPU RNG seeded to ``seed``; the previous RNG state is restored."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MoEBlock(nn.Module):
    """Routed experts (local shard under EP) + optional shared expert, as task functions.

    Args:
        hidden: model width H.
        spec: the MoE spec (``num_experts``, ``top_k``, ``expert_ffn``, ``shared_expert_ffn``,
            ``aux_loss_coef``; ``latent_dim`` > 0: latent-space experts, Nemotron 3 Super's MoE as
            transformers' ``NemotronHMoE``: the dispatched rows are ``latent_down(tokens)``
            (``fc1_latent_proj``), the experts work in ``latent_dim``, and the weighted sum goes
            back through ``latent_up`` (``fc2_latent_proj``) before the shared expert and the
            residual are added; both projections run inside dispatch and combine (plain
            ``nn.Linear``: their weight gradients are computed in B, not deferred)).
        options: routing options.
        ep_group: EP process group (None: all experts local).
        seed, layer_index: weights are drawn per (seed, layer, part, expert).
        recompute: the layer's recompute regions (``expert``, ``shared``, ``moe_act``;
            :class:`~tessera.model.recompute.LayerRecompute`).
        counts_group: the process group :meth:`dispatch` exchanges the route counts on: the same
            ranks as ``ep_group`` in the same order, on a communicator of its own
            (:mod:`tessera.model.ep.plan`); None: ``ep_group`` itself.

    Attributes:
        host_syncs: the host reads :meth:`dispatch` made (one per call;
            :class:`~tessera.model.hostsync.HostSyncs`). The engine counts on its own counter.

    Raises:
        TesseraConfigError: EP size not dividing the experts, ``top_k`` outside
            ``1..num_experts``, ``min_capacity < 0``, a capacity factor <= 0, or a counts group
            of another size than the EP group.
    """

    def __init__(self, hidden: int, spec: MoESpec, options: MoEOptions = MoEOptions(), ep_group=None,
                 seed: int = 0, layer_index: int = 0, split_w: bool = True,
                 recompute: LayerRecompute = NO_RECOMPUTE, counts_group=None) -> None:
        super().__init__()
        ep = ep_ops.ep_size(ep_group)
        if spec.num_experts % ep:
            raise TesseraConfigError("parallel.ep", ep, f"must divide num_experts={spec.num_experts}",
                                     "pick an EP size that divides the expert count")
        if not 1 <= spec.top_k <= spec.num_experts:
            raise TesseraConfigError("model.moe.top_k", spec.top_k, f"must be in 1..num_experts={spec.num_experts}",
                                     "route each token to at most num_experts experts")
        if options.min_capacity < 0 or options.capacity_factor <= 0 or options.eval_capacity_factor <= 0:
            raise TesseraConfigError("moe.options", options, "min_capacity must be >= 0 and capacity factors > 0",
                                     "use e.g. MoEOptions(min_capacity=8, capacity_factor=1.0)")
        if ep > 1 and counts_group is not None and ep_ops.ep_size(counts_group) != ep:
            raise TesseraConfigError("counts_group", ep_ops.ep_size(counts_group),
                                     f"must have the EP group's {ep} ranks",
                                     "create it with the EP group's ranks (tessera.engine.groups.make_groups)")
        self.spec, self.options, self.hidden = spec, options, hidden
        self.ep_group = ep_group if ep > 1 else None
        self.counts_group = (ep_group if counts_group is None else counts_group) if ep > 1 else None
        self.host_syncs = HostSyncs()
        self.num_local = spec.num_experts // ep
        self.expert_offset = ep_ops.ep_rank(ep_group) * self.num_local
        gated = getattr(spec, "gated", True)
        with seeded(derive_seed(seed, layer_index, 1)):
            router = gating.SigmoidRouter if spec.router == "sigmoid" else TopKGate
            self.gate = router(hidden, spec.num_experts, k=spec.top_k, capacity_factor=options.capacity_factor,
                                 eval_capacity_factor=options.eval_capacity_factor, min_capacity=options.min_capacity,
                                 noisy_gate_policy=options.noisy_gate_policy, drop_tokens=options.drop_tokens,
                                 use_rts=options.use_rts, ep_group=None,
                                 top2_2nd_expert_sampling=options.top2_2nd_expert_sampling,
                                 **(dict(num_groups=spec.num_groups, topk_groups=spec.topk_groups,
                                         routed_scaling=spec.routed_scaling, bias_update_rate=spec.bias_update_rate)
                                    if spec.router == "sigmoid" else {}))
        width = spec.latent_dim or hidden  # the routed experts' width (latent-space experts: latent_dim)
        self.latent_down = self.latent_up = None
        if spec.latent_dim:
            with seeded(derive_seed(seed, layer_index, 4)):
                self.latent_down = nn.Linear(hidden, spec.latent_dim, bias=False)
                self.latent_up = nn.Linear(spec.latent_dim, hidden, bias=False)
        experts = []
        for e in range(self.expert_offset, self.expert_offset + self.num_local):
            with seeded(derive_seed(seed, layer_index, 2, e)):
                experts.append(make_mlp(width, spec.expert_ffn, gated, recompute.moe_act))
        self.experts = ExpertList(experts)
        self.experts.recompute = recompute.expert
        self.recompute_shared = recompute.shared
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_ffn:
            with seeded(derive_seed(seed, layer_index, 3)):
                self.shared_expert = make_mlp(hidden, spec.shared_expert_ffn, gated)
                if options.shared_expert_gate and spec.shared_expert_gate:
                    self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        if split_w:
            split_linears(self.gate, "router")
            split_linears(self.experts, "expert")
            if self.shared_expert is not None:
                split_linears(self.shared_expert, "shared")
            if self.shared_expert_gate is not None:
                self.shared_expert_gate = SplitLinear.from_linear(self.shared_expert_gate, "shared")

    # --- tasks ------------------------------------------------------------------------------
    def route(self, tokens: torch.Tensor, residual: torch.Tensor) -> RouteInfo:
        """Router task: ``tokens [T, H]`` (normalised), ``residual [B, S, H]`` -> RouteInfo."""
        l_aux, capacity, num_experts, idx, _loc, gates, requested = gate_routes(self.gate, tokens, residual.shape[1])
        idx = idx.to(torch.int64)
        k, t = idx.shape
        flat = idx.reshape(-1)
        ids = torch.arange(k * t, device=flat.device)
        kept = flat >= 0
        # kept routes by (expert, token) (unique keys: a token's k experts differ), then the dropped
        # ones in route-id order; no nonzero, so the host reads nothing here
        order = torch.argsort(torch.where(kept, flat * t + ids % t, num_experts * t + ids), stable=True)
        expert = torch.where(kept, flat, num_experts)  # dropped routes count in a spare bin
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).index_add_(
            0, expert, torch.ones_like(expert))[:num_experts]
        return RouteInfo(tokens, residual, idx, gates, l_aux, requested.to(torch.int64), counts, capacity, order)

    def dispatch(self, route: RouteInfo) -> Dispatched:
        """Dispatch task: gather routed rows ``[N_send, H]`` and (EP) all-to-all them.

        The counts are exchanged first, on the counts group (:func:`tessera.model.ep.plan_route`,
        the plan the engine uses too; one host read, counted on :attr:`host_syncs`); in dropless
        mode the capacity is agreed as the max over the group.
        """
        r = ep_ops.plan_route(route.counts, route.capacity, self.ep_group, self.counts_group, self.host_syncs)
        rows = self.gather_rows(route, r.num_send)
        x = rows if r.plan is None else ep_ops.dispatch_tokens(rows, r.plan, self.ep_group)
        return Dispatched(x, r.counts, r.capacity, r.plan)

    def run_experts(self, d: Dispatched) -> torch.Tensor:
        """Expert task: each local expert on its block of ``d.x``; returns ``[N, H]`` (same
        layout). Experts with no rows still run (on ``[0, H]``), so their grads are zeros."""
        return expert_rows(self.experts, d.x, d.counts)

    def shared(self, route: RouteInfo) -> torch.Tensor | None:
        """Shared-expert task: ``[T, H]`` (gated by ``sigmoid(shared_expert_gate)``) or None."""
        if self.shared_expert is None:
            return None
        if self.recompute_shared and torch.is_grad_enabled():
            linears = tuple(m for mod in (self.shared_expert, self.shared_expert_gate) if mod is not None
                            for m in mod.modules() if isinstance(m, SplitLinear))
            return checkpointed(self._shared, route.tokens, linears=linears)
        return self._shared(route.tokens)

    def _shared(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.shared_expert(tokens)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(tokens)) * out
        return out

    def combine(self, y: torch.Tensor, d: Dispatched, route: RouteInfo, shared: torch.Tensor | None) -> torch.Tensor:
        """Combine task: (EP) reverse all-to-all of expert outputs ``y [N, H]``, weight each
        route by its gate, add per token in expert order, add the shared output and residual.
        Returns the layer output ``[B, S, H]`` (aux loss attached for backward)."""
        if d.plan is not None:
            y = ep_ops.combine_tokens(y, d.plan, self.ep_group)
        return self.combine_rows(y, route, shared)

    def gather_rows(self, route: RouteInfo, num_send: int) -> torch.Tensor:
        """The rows dispatch sends, ``[num_send, W]``: ``route.tokens`` (latent-space experts:
        ``latent_down(route.tokens)``, ``W = latent_dim``; else ``W = H``) in the first ``num_send``
        entries of ``route.order`` (sorted by (global expert, token)); differentiable (backward:
        index_add into ``[T, W]``). ``num_send``: the kept routes, ``sum(route.counts)`` as a host
        int (the plan's :attr:`~tessera.model.ep.ExpertRoute.num_send`)."""
        src = route.tokens if self.latent_down is None else self.latent_down(route.tokens)
        return src.index_select(0, route.order[:num_send] % route.num_tokens)

    def combine_rows(self, y: torch.Tensor, route: RouteInfo, shared: torch.Tensor | None) -> torch.Tensor:
        """The compute part of combine: expert outputs ``y [N_send, H]`` already back in this rank's
        send order (after the reverse all-to-all, or local; ``N_send`` its kept routes) -> layer
        output ``[B, S, H]``. Used by :meth:`combine` and by engines that run the all-to-all
        themselves."""
        t = route.num_tokens
        order = route.order[:y.shape[0]]
        w = route.gates.reshape(-1).index_select(0, order)
        contrib = (y * w.unsqueeze(1)).to(route.tokens.dtype)
        moe = route.tokens.new_zeros(t, y.shape[1]).index_add(0, order % t, contrib)
        return self._finish(self._up(moe), route, shared)

    def _up(self, moe: torch.Tensor) -> torch.Tensor:
        """Latent-space experts: the weighted sum ``[T, latent_dim]`` back to ``[T, H]``
        (``latent_up``, as transformers' ``NemotronHMoE.fc2_latent_proj``); else ``moe`` itself."""
        return moe if self.latent_up is None else self.latent_up(moe).to(moe.dtype)

    def _finish(self, moe: torch.Tensor, route: RouteInfo, shared: torch.Tensor | None) -> torch.Tensor:
        if shared is not None:
            moe = moe + shared
        out = route.residual + moe.view_as(route.residual)
        return attach_aux_loss(out, route.aux_loss, self.spec.aux_loss_coef * self.options.aux_loss_scale)

    def forward_tasks(self, route: RouteInfo) -> torch.Tensor:
        """dispatch -> experts -> shared -> combine, in the task order the engine uses."""
        d = self.dispatch(route)
        y = self.run_experts(d)
        return self.combine(y, d, route, self.shared(route))

    def forward_plain(self, route: RouteInfo) -> torch.Tensor:
        """Reference MoE written without the task split (all experts local): for each expert,
        select its tokens with a mask, run it, scale by the gate, ``index_add_`` into the output
        (the transformers ``Qwen3NextExperts`` loop). Bitwise equal to :meth:`forward_tasks`."""
        if self.ep_group is not None:
            raise RuntimeError("forward_plain needs all experts local (ep == 1)")
        x = route.tokens if self.latent_down is None else self.latent_down(route.tokens)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = route.expert_index == e  # [k, T]
            tok = sel.any(0).nonzero().squeeze(1)
            g = (route.gates * sel).sum(0).index_select(0, tok)
            out.index_add_(0, tok, (expert(x.index_select(0, tok)) * g.unsqueeze(1)).to(x.dtype))
        return self._finish(self._up(out), route, self.shared(route))
