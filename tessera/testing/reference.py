"""Single-process reference training, bitwise comparable with pipelined / expert-parallel runs.

Floating-point sums depend on their order, so "the same training" is only bitwise equal if every
sum is formed in the same order. The reference fixes each order the distributed engine fixes:

* **Task boundaries.** Both call the task functions of :mod:`tessera.model.tasks`
  (detached boundaries, explicit gradient sums), so each task's arithmetic is identical; a
  pipeline cut is one more detached boundary that exists at every layer anyway.
* **Replicas.** The reference keeps one model per data-parallel replica; replica ``d``'s
  non-expert parameters accumulate only replica ``d``'s microbatches, in microbatch order (the
  engine runs W and the B of a chunk in microbatch order).
* **Experts.** Replicas ``g*ep .. g*ep+ep-1`` form EP group ``g``; for each layer and microbatch
  the reference builds, per EP owner, the expert-major buffer that owner receives (its experts'
  rows: member 0's, then member 1's, ...; :func:`~tessera.model.ep.stack_rows`) and runs
  the owner's experts on it, so every expert GEMM has the same operands and offsets as under EP;
  group ``g``'s experts live in replica ``g*ep``'s model.
* **Reduction.** Gradients are summed over replicas (dense) or EP groups (experts) in rank order
  ``((g0 + g1) + g2) + ...`` (the engine: ``all_reduce``, equal for two ranks, or its ordered
  mode), then multiplied once by ``1 / (num_microbatches * dp)``.
* **Optimizer.** The same optimizer on replica 0's model; the others copy its parameters.
* **Precision.** With ``compute_dtype`` BF16 every forward task runs under the autocast the
  engine's chunks enter (:func:`tessera.model.precision.module_autocast`), the backward outside
  it; ``param_dtype`` BF16 builds the replicas in pure BF16 as the engine does
  (:mod:`tessera.model.precision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from tessera.model import tasks as lt
from tessera.model import MoEOptions, StageModule, gating
from tessera.model.ep import stack_rows, unstack_rows
from tessera.model.precision import module_autocast
from tessera.spec.model import ModelSpec


@dataclass(frozen=True)
class ReferenceResult:
    """``state``: final parameters by global name (see :func:`global_state_dict`);
    ``losses``: per step, the mean microbatch loss over all replicas; ``microbatch_losses``: per
    step, every replica's microbatch losses in the order they ran (replica-major within each EP
    group, microbatch order), as Python floats of the FP32 losses."""

    state: dict
    losses: tuple[float, ...]
    microbatch_losses: tuple[tuple[float, ...], ...] = ()


def _params_and_biases(layer):
    """A layer's parameters, then its routers' correction biases (buffers that training moves)."""
    yield from layer.named_parameters()
    yield from ((n, b) for n, b in layer.named_buffers() if n.endswith("e_score_correction_bias"))


def global_state_dict(module: StageModule) -> dict[str, torch.Tensor]:
    """Parameters of a stage (and its sigmoid routers' ``e_score_correction_bias`` buffers, which
    training moves) under global names: ``layers.<global layer>.…`` with routed experts
    as ``moe.experts.<global expert>.…``; ``embed.…`` and ``head.…`` unchanged. Values are
    detached clones."""
    out = {}
    for layer_pos, layer in enumerate(module.layers):
        offset = layer.moe.expert_offset if layer.moe is not None else 0
        for name, p in _params_and_biases(layer):
            if name.startswith("moe.experts."):
                e, rest = name[len("moe.experts."):].split(".", 1)
                name = f"moe.experts.{int(e) + offset}.{rest}"
            out[f"layers.{layer.index}.{name}"] = p.detach().clone()
    for prefix, sub in (("embed", module.embed), ("head", module.head)):
        if sub is not None:
            out.update({f"{prefix}.{n}": p.detach().clone() for n, p in sub.named_parameters()})
    return out


def _microbatch(models: Sequence[StageModule], members: Sequence[int], batches, mb: int, ep: int) -> list[float]:
    """Forward and backward of microbatch ``mb`` for the replicas ``members`` of one EP group."""
    owner = models[members[0]]
    with module_autocast(owner)():  # the forward tasks under the engine chunks' autocast
        emb, states, experts, counts, heads, losses = _forward(models, members, batches, mb, ep)
    _backward(models, members, ep, emb, states, experts, counts, heads)
    return losses


def _forward(models, members, batches, mb: int, ep: int):
    owner = models[members[0]]
    n = len(owner.layers)
    emb = [models[d].embed(batches[j].input_ids[mb]) for j, d in enumerate(members)]
    x = list(emb)
    states = [[lt.LayerState() for _ in range(n)] for _ in members]
    experts: list[list[lt.ExpertState]] = [[] for _ in range(n)]
    counts: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for i in range(n):
        moe = owner.layers[i].moe
        rows = []
        for j, d in enumerate(members):
            layer, st = models[d].layers[i], states[j][i]
            lt.f_mixer(layer, st, x[j])
            if moe is not None:
                lt.f_router(layer, st)
                rows.append(lt.f_gather(layer, st))
                counts[i].append(st.route.counts)
            elif layer.mlp_module is not None:
                lt.f_mlp(layer, st)
            x[j] = lt.layer_output(st)
        if moe is None:
            continue
        e_local = moe.spec.num_experts // ep
        y_all = []
        for r in range(ep):  # each EP owner's buffer, then back to the members
            sl = slice(r * e_local, (r + 1) * e_local)
            buf, per_expert = stack_rows([rw for rw in _owner_rows(rows, counts[i], sl)], [c[sl] for c in counts[i]])
            est = lt.ExpertState()
            y_all.append(lt.f_expert(moe.experts[sl], est, buf, per_expert))
            experts[i].append(est)
        y_back = _from_owners(y_all, counts[i], e_local, ep)
        for j, d in enumerate(members):
            layer, st = models[d].layers[i], states[j][i]
            if layer.moe.shared_expert is not None:
                lt.f_shared(layer, st)
            x[j] = lt.f_combine(layer, st, y_back[j])
    heads = [lt.HeadState() for _ in members]
    losses = [float(lt.f_head(models[d].head, heads[j], x[j], batches[j].labels[mb]).detach())
              for j, d in enumerate(members)]
    return emb, states, experts, counts, heads, losses


def _backward(models, members, ep: int, emb, states, experts, counts, heads) -> None:
    owner = models[members[0]]
    n = len(owner.layers)
    g = [lt.b_head(h) for h in heads]
    for i in reversed(range(n)):
        moe = owner.layers[i].moe
        if moe is not None:
            g_back = [lt.b_combine(states[j][i], g[j]) for j in range(len(members))]
            e_local = moe.spec.num_experts // ep
            g_x = []
            for r in range(ep):
                sl = slice(r * e_local, (r + 1) * e_local)
                buf, _ = stack_rows(_owner_rows(g_back, counts[i], sl), [c[sl] for c in counts[i]])
                g_x.append(lt.b_expert(experts[i][r], buf))
            g_rows = _from_owners(g_x, counts[i], e_local, ep)
        for j, d in enumerate(members):
            layer, st = models[d].layers[i], states[j][i]
            if moe is not None:
                lt.b_gather(st, g_rows[j])
                if layer.moe.shared_expert is not None:
                    lt.b_shared(layer, st, g[j])
                g_h = lt.b_router(st, g[j])
            elif layer.mlp_module is not None:
                g_h = lt.b_mlp(st, g[j])
            else:
                g_h = g[j]
            g[j] = lt.b_mixer(st, g_h) if layer.attn is not None else g_h
    for j in range(len(members)):
        torch.autograd.backward(emb[j], g[j])


def _owner_rows(rows: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], sl: slice) -> list[torch.Tensor]:
    """Each member's rows for the experts in ``sl`` (rows are sorted by expert)."""
    out = []
    for r, c in zip(rows, counts):
        before, inside = int(c[: sl.start].sum()), int(c[sl].sum())
        out.append(r[before:before + inside])
    return out


def _from_owners(parts: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], e_local: int, ep: int) -> list:
    """Per owner expert-major rows -> per member its rows in send order (owner 0's experts first)."""
    per_owner = [unstack_rows(parts[r], [c[r * e_local:(r + 1) * e_local] for c in counts]) for r in range(ep)]
    return [torch.cat([per_owner[r][j] for r in range(ep)], dim=0) for j in range(len(counts))]


def _sum_in_order(grads: Iterable[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    acc = None
    for g in grads:
        g = torch.zeros_like(like) if g is None else g
        acc = g.clone() if acc is None else acc + g
    return acc


def reference_train(model: ModelSpec, batches: Sequence[Sequence], *, ep: int = 1, seed: int = 0,
                    moe: MoEOptions = MoEOptions(), make_optimizer: Callable[[Iterable[torch.nn.Parameter]], object],
                    prepare: Callable[[StageModule], None] | None = None,
                    device: torch.device | str | None = None, compute_dtype: torch.dtype = torch.float32,
                    param_dtype: torch.dtype | None = None) -> ReferenceResult:
    """Train ``model`` for ``len(batches)`` steps in one process.

    Args:
        model: the model spec; every replica is ``StageModule(model, (-1, L+1), seed=seed)``.
        batches: ``batches[step][replica]`` a :class:`~tessera.engine.engine.Batch` (``dp``
            replicas; all of a step share the shape).
        ep: EP group size (divides ``dp``).
        moe: routing options (as the distributed run).
        make_optimizer: builds the optimizer from parameters (as the distributed run).
        prepare: applied to every replica's model after construction (e.g. to force routing).
        device: where the replicas run (their weights are drawn on the CPU, by seed, then moved;
            the batches must be on it too); None: where they are built, the CPU.
        compute_dtype, param_dtype: as :class:`~tessera.model.stage.StageModule`'s (the run's
            ``train.precision`` and ``train.master_weights``: :mod:`tessera.model.precision`).

    Returns:
        :class:`ReferenceResult` with the final parameters under global names.
    """
    dp = len(batches[0])
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    models = [StageModule(model, (-1, model.num_layers + 1), moe=moe, seed=seed, compute_dtype=compute_dtype,
                          param_dtype=param_dtype) for _ in range(dp)]
    if device is not None:
        models = [m.to(device) for m in models]
    if prepare is not None:
        for m in models:
            prepare(m)
    expert_names = {n for n, _ in models[0].named_parameters() if ".moe.experts." in n}
    params = [dict(m.named_parameters()) for m in models]
    opt = make_optimizer(models[0].parameters())
    losses, per_mb = [], []
    for step_batches in batches:
        m = step_batches[0].input_ids.shape[0]
        step_losses = []
        for g in range(dp // ep):
            members = list(range(g * ep, (g + 1) * ep))
            for mb in range(m):
                step_losses += _microbatch(models, members, [step_batches[d] for d in members], mb, ep)
        scale = 1.0 / (m * dp)
        for name, p in params[0].items():
            sources = range(0, dp, ep) if name in expert_names else range(dp)
            p.grad = _sum_in_order((params[d][name].grad for d in sources), p).mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        routers = [gating.sigmoid_routers([mod]) for mod in models]
        for d in range(1, dp):  # every replica's routes count (the engine sums them over its DP group)
            for r0, r in zip(routers[0], routers[d]):
                r0.load.add_(r.load)
                r.load.zero_()
        gating.update_expert_bias(routers[0])
        with torch.no_grad():
            for d in range(1, dp):
                for r0, r in zip(routers[0], routers[d]):
                    r.e_score_correction_bias.copy_(r0.e_score_correction_bias)
                models[d].zero_grad(set_to_none=True)
                for name, p in params[0].items():
                    params[d][name].copy_(p)
        losses.append(sum(step_losses) / len(step_losses))
        per_mb.append(tuple(step_losses))
    return ReferenceResult(global_state_dict(models[0]), tuple(losses), tuple(per_mb))
