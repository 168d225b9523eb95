"""Parameters and optimizer state under global names: re-partitioning between pipeline ranks.

A plan upgrade (or a restart from a checkpoint written under another partition) moves decoder
layers, the embedding and the head between the ranks of one pipeline group. This module names
every parameter by its place in the whole model, independent of the partition:

* ``embed.<rest>``, ``layers.<global layer index>.<rest>``, ``head.<rest>``, where ``<rest>`` is
  the name inside that submodule (``SplitLinear`` keeps ``nn.Linear``'s ``weight`` / ``bias``,
  so the names are the same with and without ``split_w``). Routed experts keep their EP-local
  index (``moe.experts.<local>``): all ranks of one pipeline group sit at the same EP position,
  so the names agree within the group that exchanges them.

The *named state* is ``{global name: {"param": tensor, <optimizer key>: tensor, ...}}`` with
AdamW's ``"step"``, ``"exp_avg"``, ``"exp_avg_sq"`` once the parameter took a step.

* :func:`named_state` / :func:`load_named`: in-process read and write of that form;
* :func:`state_from_parts`: the same form from the checkpoint parts of one pipeline group
  (the offline path: restart under another partition);
* :func:`move_state`: the online path, a collective over the pipeline group that moves every
  parameter and its optimizer state to the rank that holds it under the new partition, by
  point-to-point byte buffers (``method="p2p"``) or through ``torch.distributed.checkpoint``
  files (``method="dcp"``, :mod:`tessera.train.upgrade.dcp`).

All copies are bitwise (same dtype, ``copy_``); nothing is cast. Persistent buffers (those in
``state_dict``: the sigmoid router's ``e_score_correction_bias``, which training moves) are model
state too: they are named, moved and loaded as parameters without optimizer state. Not moved:
non-persistent buffers (rotary ``inv_freq``, the router's load count: every stage rebuilds
them) and the optimizer's ``param_groups`` hyperparameters (``lr``, ``weight_decay``: the new
optimizer's own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.train.upgrade.entries import PARAM, dtype_of, nbytes_of, signature

METHODS = ("p2p", "dcp")


@dataclass(frozen=True)
class MoveReport:
    """What one :func:`move_state` call did on this rank.

    Attributes:
        method: ``"p2p"`` or ``"dcp"``.
        moved_bytes: bytes of the tensors (parameters and optimizer state) this rank received from
            other members of the group; summed over the group: the bytes that changed rank.
            Local copies are not counted.
        moved_tensors: number of such tensors (each parameter and each optimizer-state tensor
            counts one).
        seconds: wall time of the call on this rank (metadata exchange, transfer, local copies).
    """

    method: str
    moved_bytes: int
    moved_tensors: int
    seconds: float


def global_param_names(module) -> list[str]:
    """Global names of ``module.parameters()`` (a :class:`~tessera.model.stage.StageModule`), in
    that order: ``embed.<rest>``, ``layers.<max(start, 0) + k>.<rest>``, ``head.<rest>``.

    Raises:
        ValueError: a parameter outside ``embed`` / ``layers`` / ``head``.
    """
    first = max(module.start, 0)
    names = []
    for name, _ in module.named_parameters():
        names.append(_global_key(name, first, where=f"stage [{module.start}, {module.stop})"))
    return names


def _global_key(local: str, first: int, where: str) -> str:
    """``layers.<k>.rest`` -> ``layers.<first + k>.rest``; ``embed.*`` / ``head.*`` unchanged."""
    head, _, rest = local.partition(".")
    if head in ("embed", "head"):
        return local
    if head == "layers":
        k, _, tail = rest.partition(".")
        return f"layers.{first + int(k)}.{tail}"
    raise ValueError(f"{where}: parameter {local!r} is not under embed/layers/head; global names cover "
                     "only StageModule's submodules")


def _persistent_buffers(module) -> list[tuple[str, torch.Tensor]]:
    """``(global name, buffer)`` of ``module``'s persistent buffers (``state_dict`` entries that
    are not parameters), in ``state_dict`` order."""
    first = max(module.start, 0)
    return [(_global_key(k, first, where=f"stage [{module.start}, {module.stop})"), t)
            for k, t in module.state_dict(keep_vars=True).items() if not isinstance(t, torch.nn.Parameter)]


def _named_params(modules) -> list[tuple[str, torch.Tensor]]:
    """``(global name, tensor)`` of ``modules``' parameters, then their persistent buffers."""
    out, seen = [], set()
    for m in modules:
        for name, p in [*zip(global_param_names(m), m.parameters()), *_persistent_buffers(m)]:
            if name in seen:
                raise ValueError(f"parameter {name!r} is held by two local stages; stages must be disjoint")
            seen.add(name)
            out.append((name, p))
    return out


def named_state(modules, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Global name -> ``{"param": data, <optimizer.state[p] entries>}`` of ``modules``' parameters
    and persistent buffers (``{"param": buffer}``).

    The tensors are *views* of the live parameters (``p.detach()``) and the optimizer's own state
    tensors, not copies: they change with the next optimizer step (clone them to keep a snapshot).
    ``optimizer`` may be None (parameters only).

    Raises:
        ValueError: two local stages hold the same name; an optimizer-state entry is not a tensor.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in _named_params(modules):
        entry = {PARAM: p.detach()}
        state = optimizer.state.get(p, {}) if optimizer is not None and isinstance(p, torch.nn.Parameter) else {}
        for key, value in state.items():
            if not torch.is_tensor(value):
                raise ValueError(f"optimizer state {name!r}[{key!r}] is {type(value).__name__}, not a tensor; "
                                 "only tensor state can be moved")
            out_key = str(key)
            if out_key == PARAM:
                raise ValueError(f"optimizer state {name!r} has a key 'param', which names the parameter itself")
            entry[out_key] = value
        out[name] = entry
    return out


def _state_device(key: str, param: torch.Tensor, group: dict) -> torch.device:
    """Where ``optimizer.state[param][key]`` lives: as ``torch.optim.Optimizer.load_state_dict``
    places it (``step`` on the CPU unless the group is ``capturable`` or ``fused``)."""
    if key == "step" and not (group.get("capturable") or group.get("fused")):
        return torch.device("cpu")
    return param.device


def load_named(modules, optimizer, named: dict[str, dict[str, torch.Tensor]]) -> None:
    """Copy ``named`` into ``modules`` (``param.data.copy_``) and ``optimizer.state`` (copies of
    the tensors, same dtype and shape; a parameter without optimizer entries gets none).

    Every parameter of ``modules`` must be in ``named``; ``named`` may hold more names. All
    checks run before anything is written. ``optimizer`` may be None (parameters only).

    Raises:
        KeyError: a parameter's global name (or its ``"param"`` entry) is missing from ``named``.
        ValueError: the parameter's shape or dtype differs; an entry is not a tensor; the
            optimizer does not own the parameter.
    """
    params = _named_params(modules)
    groups = {}
    if optimizer is not None:
        for g in optimizer.param_groups:
            groups.update({id(p): g for p in g["params"]})
    for name, p in params:
        if name not in named:
            raise KeyError(f"parameter {name!r} is not in the named state ({len(named)} names); the source "
                           "partition does not hold it")
        entry = named[name]
        if PARAM not in entry:
            raise KeyError(f"named state {name!r} has no 'param' entry (keys {sorted(entry)})")
        for key, t in entry.items():
            if not torch.is_tensor(t):
                raise ValueError(f"named state {name!r}[{key!r}] is {type(t).__name__}, not a tensor")
        src = entry[PARAM]
        if tuple(src.shape) != tuple(p.shape) or src.dtype != p.dtype:
            raise ValueError(f"parameter {name!r}: named state has {src.dtype} {tuple(src.shape)}, the module "
                             f"{p.dtype} {tuple(p.shape)}; both partitions must build the same model")
        if optimizer is not None and len(entry) > 1 and id(p) not in groups:
            raise ValueError(f"parameter {name!r} has optimizer state but the optimizer does not own it; build "
                             "the optimizer over the new modules' parameters")
    with torch.no_grad():
        for name, p in params:
            entry = named[name]
            p.data.copy_(entry[PARAM])
            if optimizer is None:
                continue
            state = {key: torch.empty(t.shape, dtype=t.dtype, device=_state_device(key, p, groups.get(id(p), {})))
                     .copy_(t) for key, t in entry.items() if key != PARAM}
            if state:
                optimizer.state[p] = state
            else:
                optimizer.state.pop(p, None)


def state_from_parts(parts: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """The named state of one pipeline group from its checkpoint parts (offline re-partitioning).

    Args:
        parts: one ``EngineStepRunner.state_dict()`` per rank of the group: ``{"modules":
            [module.state_dict() per chunk], "optimizer": optimizer.state_dict(), "stages":
            [(stage, start, stop) per chunk, chunk order], "param_names": [global names in
            optimizer order]}``. Module keys are local (``layers.<k>``); optimizer ``state`` is keyed
            by position in the flattened ``param_groups[*]["params"]``.

    Returns:
        ``{global name: {"param": ..., "step": ..., "exp_avg": ..., ...}}`` as :func:`named_state`;
        the tensors are those of ``parts`` (no copies). Persistent buffers (the module state
        dicts' entries outside ``param_names``, e.g. ``e_score_correction_bias``) get
        ``{"param": buffer}``; non-persistent ones (rotary ``inv_freq``) are in no state dict.

    Raises:
        KeyError: a part lacks ``param_names`` (or another field), or a name it lists is in no
            module state dict.
        ValueError: ``stages`` and ``modules`` differ in length, the module state dicts do not
            list the parameters in ``param_names`` order, the optimizer holds another number of
            parameters, or two parts hold the same name.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    owner: dict[str, int] = {}
    for r, part in enumerate(parts):
        for field in ("modules", "optimizer", "stages", "param_names"):
            if field not in part:
                raise KeyError(f"checkpoint part {r} has no {field!r}; it needs modules, optimizer, stages and "
                               "param_names (EngineStepRunner.state_dict)")
        names = list(part["param_names"])
        if len(part["stages"]) != len(part["modules"]):
            raise ValueError(f"checkpoint part {r}: {len(part['stages'])} stages but {len(part['modules'])} "
                             "module state dicts; they must be one per chunk")
        tensors: dict[str, torch.Tensor] = {}
        order: list[str] = []
        wanted = set(names)
        for (_, start, stop), sd in zip(part["stages"], part["modules"]):
            for key, t in sd.items():
                g = _global_key(key, max(int(start), 0), where=f"checkpoint part {r} stage [{start}, {stop})")
                tensors[g] = t
                if g in wanted:
                    order.append(g)
        for name in names:
            if name not in tensors:
                raise KeyError(f"checkpoint part {r}: parameter {name!r} of param_names is in no module state dict")
        if order != names:
            raise ValueError(f"checkpoint part {r}: the module state dicts list the parameters in another order "
                             "than param_names; stages must be in chunk order")
        opt = part["optimizer"]
        index = [i for g in opt["param_groups"] for i in g["params"]]
        if len(index) != len(names):
            raise ValueError(f"checkpoint part {r}: the optimizer holds {len(index)} parameters, param_names "
                             f"{len(names)}; the optimizer must cover exactly the stages' parameters")
        for pos, name in enumerate(names):
            if name in owner:
                raise ValueError(f"parameter {name!r} is in checkpoint parts {owner[name]} and {r}; the parts "
                                 "of one pipeline group hold disjoint layers")
            owner[name] = r
            entry = {PARAM: tensors[name]}
            entry.update({str(k): v for k, v in opt["state"].get(index[pos], {}).items()})
            out[name] = entry
        for name in tensors.keys() - wanted:  # persistent buffers
            if name in owner:
                raise ValueError(f"buffer {name!r} is in checkpoint parts {owner[name]} and {r}; the parts "
                                 "of one pipeline group hold disjoint layers")
            owner[name] = r
            out[name] = {PARAM: tensors[name]}
    return out


def move_state(old_modules, old_optimizer, new_modules, new_optimizer, group, *, method: str = "p2p",
               scratch_dir=None) -> MoveReport:
    """Move parameters and optimizer state to a new partition: a collective over ``group``.

    Every member of the pipeline group ``group`` (None: the default group) calls it with the
    stages it held (``old_modules``, ``old_optimizer``) and freshly built stages of the new
    partition (``new_modules``, ``new_optimizer`` over their parameters). Afterwards every
    parameter of ``new_modules`` and its optimizer state hold bitwise the values some member
    held under the same global name. Names that stay on a rank are copied locally.

    Args:
        method: ``"p2p"``: names, dtypes and shapes are exchanged (``all_gather_object``), then
            every (source, destination) pair exchanges one flat ``uint8`` buffer (tensors sorted
            by name, ``"param"`` then optimizer keys sorted) with ``batch_isend_irecv``; buffers
            are on the CPU for gloo and on the current CUDA device for NCCL. ``"dcp"``: the
            entries other ranks need are saved with ``torch.distributed.checkpoint`` into
            ``scratch_dir`` (keys ``<name>/<key>``) and each rank loads what it needs.
        scratch_dir: a directory shared by the group's members, one per pipeline group
            (``"dcp"`` only); its files are overwritten.

    Returns:
        :class:`MoveReport` of this rank.

    Raises:
        ValueError: an unknown method, ``"dcp"`` without ``scratch_dir``; a needed name held by no
            member, held by two members with different shapes/dtypes/optimizer keys, or built by
            the new partition with another shape (the same message on every member).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: must be one of {METHODS}")
    if method == "dcp" and scratch_dir is None:
        raise ValueError("method='dcp' needs scratch_dir: a directory shared by the pipeline group's ranks")
    t0 = time.perf_counter()
    group = group if group is not None else dist.group.WORLD
    me, size = dist.get_rank(group), dist.get_world_size(group)
    held, error = {}, None
    try:
        held = named_state(old_modules, old_optimizer)
        need = [(n, str(p.dtype), tuple(p.shape)) for n, p in _named_params(new_modules)]
    except ValueError as e:
        need, error = [], f"group rank {me}: {e}"
    meta = {name: signature(entry) for name, entry in held.items()}
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (meta, need, error), group=group)
    errors = [g[2] for g in gathered if g[2] is not None]
    if errors:
        raise ValueError(errors[0])
    plan = plan_moves([g[0] for g in gathered], [g[1] for g in gathered])
    recv = {s: names for (s, d), names in plan.items() if d == me and s != me}
    send = {d: names for (s, d), names in plan.items() if s == me and d != me}
    incoming = {n: held[n] for n in plan.get((me, me), ())}
    sig = {n: gathered[s][0][n] for s, names in recv.items() for n in names}
    if method == "p2p":
        got = _exchange_p2p(held, send, recv, sig, group)
    else:
        from tessera.train.upgrade.dcp import exchange_dcp
        devices = {n: p.device for n, p in _named_params(new_modules)}
        got = exchange_dcp(held, send, recv, sig, group, scratch_dir, devices)
    incoming.update(got)
    load_named(new_modules, new_optimizer, incoming)
    nbytes = sum(nbytes_of(dtype, shape) for n in sig for _, dtype, shape in sig[n])
    ntensors = sum(len(sig[n]) for n in sig)
    return MoveReport(method, nbytes, ntensors, time.perf_counter() - t0)


def plan_moves(metas: list[dict], needs: list[list[tuple]]) -> dict[tuple[int, int], tuple[str, ...]]:
    """Which member sends which names to which: ``{(src, dst): names sorted}`` (group ranks).

    Args:
        metas: per group rank, ``{name: signature}`` of what it holds.
        needs: per group rank, ``[(name, dtype, shape)]`` of its new parameters.

    A rank that holds a name it needs keeps it (``src == dst``); otherwise the lowest group rank
    holding it sends it.

    Raises:
        ValueError: a needed name held by no member, held with different signatures by two
            members, or needed with another dtype/shape than it is held.
    """
    plan: dict[tuple[int, int], list[str]] = {}
    for dst, need in enumerate(needs):
        for name, dtype, shape in need:
            holders = [r for r, m in enumerate(metas) if name in m]
            if not holders:
                raise ValueError(f"parameter {name!r}: group rank {dst} needs it under the new partition but no "
                                 "member holds it; the old stages of the group must cover the whole model")
            sigs = {metas[r][name] for r in holders}
            if len(sigs) > 1:
                raise ValueError(f"parameter {name!r} is held by group ranks {holders} with different "
                                 f"shapes/dtypes/optimizer keys {sorted(sigs)}; the old stages must be disjoint")
            _, held_dtype, held_shape = metas[holders[0]][name][0]
            if (held_dtype, tuple(held_shape)) != (dtype, tuple(shape)):
                raise ValueError(f"parameter {name!r}: held as {held_dtype} {tuple(held_shape)}, group rank {dst} "
                                 f"builds {dtype} {tuple(shape)}; both partitions must build the same model")
            src = dst if dst in holders else holders[0]
            plan.setdefault((src, dst), []).append(name)
    return {k: tuple(sorted(v)) for k, v in plan.items()}


def buffer_device(group) -> torch.device:
    """Where transfer buffers live: the current CUDA device for NCCL, else the CPU (gloo)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_p2p(held, send, recv, sig, group) -> dict[str, dict[str, torch.Tensor]]:
    """One flat uint8 buffer per (src, dst) pair over ``batch_isend_irecv``; returns the received
    entries (views into the receive buffers; a cloned slice where the offset is not aligned)."""
    device = buffer_device(group)
    ops, bufs = [], {}
    for dst, names in sorted(send.items()):
        pieces = [held[n][key].detach().reshape(-1).view(torch.uint8).to(device)
                  for n in names for key, _, _ in signature(held[n])]
        buf = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
        if buf.numel():
            ops.append(dist.P2POp(dist.isend, buf, peer=dist.get_global_rank(group, dst), group=group))
    for src, names in sorted(recv.items()):
        n = sum(nbytes_of(dt, sh) for name in names for _, dt, sh in sig[name])
        bufs[src] = torch.empty(n, dtype=torch.uint8, device=device)
        if n:
            ops.append(dist.P2POp(dist.irecv, bufs[src], peer=dist.get_global_rank(group, src), group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for src, names in recv.items():
        buf, off = bufs[src], 0
        for name in names:
            entry = {}
            for key, dt, sh in sig[name]:
                dtype, nb = dtype_of(dt), nbytes_of(dt, sh)
                piece = buf[off:off + nb]
                if off % dtype.itemsize:
                    piece = piece.clone()
                entry[key] = piece.view(dtype).reshape(sh)
                off += nb
            out[name] = entry
    return out
