"""Where every rank of a run sits: the world rank and node of every (pipeline rank, data-parallel
position), and how each communication group falls on nodes, for one rank order.

One function, three readers: the cost model prices a group's traffic on NVLink or the network by
how many of its members share a node (:mod:`tessera.cost.comm`, :mod:`tessera.cost.dp`), the
engine builds its process groups from the same rank formula (:class:`tessera.engine.groups.Layout`),
and ``tessera plan`` / ``tessera simulate`` print which groups cross nodes.

Ranks. A run has ``pp`` pipeline ranks and, per pipeline rank, ``dp * tp`` data-parallel
positions ``c`` (replica ``d = c // tp``, tensor-parallel rank ``t = c % tp``; the engine runs
``tp = 1``, the cost model prices published runs with ``tp > 1``): ``world = pp * dp * tp``.
A rank order (:data:`RANK_ORDERS`, dimensions fastest-varying first, as Megatron-Core's
``RankGenerator`` spells ``tp-cp-ep-dp-pp``) maps ``(p, c)`` to a world rank:

* ``ep-dp-pp``: ``rank = p * dp * tp + c``. The positions of one pipeline rank are consecutive,
  so an EP group (``ep`` consecutive positions) lies inside one node when ``ep <= gpus_per_node``
  (and ``ep`` divides ``gpus_per_node``), and pipeline stages are ``dp * tp`` ranks apart: across nodes once
  ``dp * tp >= gpus_per_node``. Megatron-Core's order for MoE (``tp-cp-ep-dp-pp`` with ``cp = 1``:
  EP inside the NVLink domain, PP across nodes).
* ``pp-ep-dp``: ``rank = (d * pp + p) * tp + t``. One replica's pipeline is consecutive, so a
  node holds whole pipelines and EP groups are ``pp * tp`` ranks apart (across nodes once
  ``pp * tp >= gpus_per_node``). The engine's only order before ``parallel.rank_order`` existed.
* ``auto`` (:func:`resolve_order`): ``ep-dp-pp`` on nodes of several devices, ``pp-ep-dp`` on
  single-device nodes (the ``cpu`` preset), where every group crosses nodes in either order.

Nodes. World rank ``r`` runs on node ``r // gpus_per_node``: Ray Train, torchrun and Slurm give
the processes of one node consecutive ranks (the driver checks it on a running job and maps
ranks where a launcher did otherwise, :mod:`tessera.train.job.placement`).

Groups (:data:`GROUP_KINDS`), each a tuple of world ranks in group order:

* ``pipeline`` per position ``c``: pipeline ranks ``0 .. pp-1``;
* ``tp`` per ``(p, d)``: positions ``d*tp .. d*tp+tp-1``;
* ``ep`` per ``(p, g)``: positions ``g*ep .. g*ep+ep-1`` (EP is carved from ``dp * tp``,
  Megatron-Core's expert layout with expert-TP 1; at ``tp = 1`` replicas ``g*ep ..``);
* ``dense_dp`` per ``(p, t)``: the positions with ``c % tp == t``;
* ``expert_dp`` per ``(p, j)``: the positions with ``c % ep == j`` (the ranks holding the same
  experts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from tessera.errors import TesseraConfigError

RANK_ORDERS = ("ep-dp-pp", "pp-ep-dp")
"""The rank orders a run may use (module docstring); ``auto`` picks one (:func:`resolve_order`)."""
GROUP_KINDS = ("pipeline", "tp", "ep", "dense_dp", "expert_dp")


def resolve_order(order: str, gpus_per_node: int) -> str:
    """The concrete rank order of ``order`` (one of :data:`RANK_ORDERS` or ``"auto"``): ``auto`` is
    ``ep-dp-pp`` when ``gpus_per_node > 1`` (EP groups inside a node, pipeline stages across
    nodes), else ``pp-ep-dp``.

    Raises:
        TesseraConfigError: an unknown order (field ``parallel.rank_order``)."""
    if order == "auto":
        return RANK_ORDERS[0] if gpus_per_node > 1 else RANK_ORDERS[1]
    if order not in RANK_ORDERS:
        raise TesseraConfigError("parallel.rank_order", order, f"must be one of {', '.join(RANK_ORDERS)} or auto",
                                 "use auto (EP inside a node on multi-GPU nodes) or name an order")
    return order


def world_rank(order: str, pp: int, dp: int, tp: int, p: int, c: int) -> int:
    """World rank of pipeline rank ``p`` at data-parallel position ``c`` (``0 <= c < dp*tp``) under
    the concrete ``order`` (module docstring)."""
    if order == "ep-dp-pp":
        return p * dp * tp + c
    return ((c // tp) * pp + p) * tp + c % tp


def position(order: str, pp: int, dp: int, tp: int, rank: int) -> tuple[int, int]:
    """``(p, c)`` of world rank ``rank`` (the inverse of :func:`world_rank`)."""
    if order == "ep-dp-pp":
        return divmod(rank, dp * tp)
    block, t = divmod(rank, tp)
    d, p = divmod(block, pp)
    return p, d * tp + t


def group_ranks(kind: str, order: str, pp: int, dp: int, ep: int, tp: int = 1) -> tuple[tuple[int, ...], ...]:
    """Every group of ``kind`` (:data:`GROUP_KINDS`) as tuples of world ranks, in a fixed order
    (module docstring): pipeline groups by position, the others by pipeline rank then index."""
    w = dp * tp
    r = lambda p, c: world_rank(order, pp, dp, tp, p, c)  # noqa: E731
    if kind == "pipeline":
        return tuple(tuple(r(p, c) for p in range(pp)) for c in range(w))
    if kind == "tp":
        return tuple(tuple(r(p, c) for c in range(d * tp, d * tp + tp)) for p in range(pp) for d in range(dp))
    if kind == "ep":
        return tuple(tuple(r(p, c) for c in range(g * ep, g * ep + ep)) for p in range(pp) for g in range(w // ep))
    if kind == "dense_dp":
        return tuple(tuple(r(p, c) for c in range(t, w, tp)) for p in range(pp) for t in range(tp))
    if kind == "expert_dp":
        return tuple(tuple(r(p, c) for c in range(j, w, ep)) for p in range(pp) for j in range(ep))
    raise ValueError(f"unknown group kind {kind!r}; use one of {GROUP_KINDS}")


@dataclass(frozen=True)
class GroupPlacement:
    """How the groups of one kind fall on nodes.

    Attributes:
        kind: one of :data:`GROUP_KINDS`.
        size: ranks per group; count: groups of this kind.
        nodes: the most nodes one group spans (1: every group of the kind inside one node).
        local: the fewest members of a group on any member's node, the member included (the
            NVLink peers + 1 the cost model gives that member; ``size`` when ``nodes == 1``).
    """

    kind: str
    size: int
    count: int
    nodes: int
    local: int

    @property
    def crosses_nodes(self) -> bool:
        """A group of this kind spans more than one node (its traffic takes the network)."""
        return self.nodes > 1


@dataclass(frozen=True)
class Placement:
    """The placement of one run (:func:`place`): concrete ``order``, node size, world and node
    counts, and one :class:`GroupPlacement` per kind of :data:`GROUP_KINDS`."""

    order: str
    gpus_per_node: int
    pp: int
    dp: int
    ep: int
    tp: int
    world: int
    num_nodes: int
    groups: tuple[GroupPlacement, ...]

    def group(self, kind: str) -> GroupPlacement:
        """The :class:`GroupPlacement` of ``kind``."""
        for g in self.groups:
            if g.kind == kind:
                return g
        raise KeyError(kind)

    def crossing(self) -> tuple[str, ...]:
        """The group kinds whose groups span more than one node, in :data:`GROUP_KINDS` order."""
        return tuple(g.kind for g in self.groups if g.crosses_nodes)

    def describe(self) -> str:
        """One line: order, nodes, the group kinds that cross nodes and those inside one (with
        members per node), e.g. ``ep-dp-pp, 8 nodes x 8 GPUs; across nodes: pipeline (8 nodes);
        inside a node: ep (8), dense_dp (8)`` (groups of one rank left out)."""
        multi = [g for g in self.groups if g.size > 1]
        across = ", ".join(f"{g.kind} ({g.nodes} nodes, {g.local} of {g.size} on a node)" if g.local > 1 else
                           f"{g.kind} ({g.nodes} nodes)" for g in multi if g.crosses_nodes) or "none"
        inside = ", ".join(f"{g.kind} ({g.size})" for g in multi if not g.crosses_nodes) or "none"
        g = self.gpus_per_node
        return (f"{self.order}, {self.num_nodes} node{'s' if self.num_nodes != 1 else ''} x {g} "
                f"GPU{'s' if g != 1 else ''}; across nodes: {across}; inside a node: {inside}")

    def node_of(self, p: int, c: int) -> int:
        """Node of pipeline rank ``p`` at data-parallel position ``c``."""
        return world_rank(self.order, self.pp, self.dp, self.tp, p, c) // self.gpus_per_node

    def to_dict(self) -> dict:
        """Plain JSON values (``plan.json``'s and ``--json``'s ``placement``): every field, the
        groups by kind with ``crosses_nodes``, and ``crossing``."""
        out = {k: v for k, v in asdict(self).items() if k != "groups"}
        out["groups"] = {g.kind: {**{k: v for k, v in asdict(g).items() if k != "kind"},
                                  "crosses_nodes": g.crosses_nodes} for g in self.groups}
        out["crossing"] = list(self.crossing())
        return out


def _summarise(kind: str, groups: tuple[tuple[int, ...], ...], node_of) -> GroupPlacement:
    """The :class:`GroupPlacement` of ``groups`` (tuples of slots) with slot ``s`` on node
    ``node_of(s)``."""
    size = len(groups[0]) if groups else 1
    nodes, local = 1, size
    for members in groups:
        per_node: dict[object, int] = {}
        for r in members:
            n = node_of(r)
            per_node[n] = per_node.get(n, 0) + 1
        nodes = max(nodes, len(per_node))
        local = min(local, min(per_node.values()))
    return GroupPlacement(kind, size, len(groups), nodes, local)


@lru_cache(maxsize=256)
def place(pp: int, dp: int, ep: int, gpus_per_node: int, order: str = "auto", tp: int = 1) -> Placement:
    """The placement of a run of ``pp * dp * tp`` ranks on nodes of ``gpus_per_node`` devices under
    ``order`` (``auto`` resolved by :func:`resolve_order`). Time and memory linear in the world
    size (12,288 ranks: well under a second).

    Raises:
        TesseraConfigError: an unknown order; a size < 1; ``ep`` not dividing ``dp * tp``."""
    for name, v in (("pp", pp), ("dp", dp), ("ep", ep), ("tp", tp), ("gpus_per_node", gpus_per_node)):
        if not isinstance(v, int) or v < 1:
            field = "hardware.gpus_per_node" if name == "gpus_per_node" else f"parallel.{name}"
            raise TesseraConfigError(field, v, "must be a positive integer", f"set {field} >= 1")
    if (dp * tp) % ep:
        raise TesseraConfigError("parallel.ep", ep, f"must divide dp*tp={dp * tp} (EP is carved from the data- and "
                                 "tensor-parallel ranks)", "choose ep among the divisors of dp*tp")
    concrete = resolve_order(order, gpus_per_node)
    world = pp * dp * tp
    groups = tuple(_summarise(k, group_ranks(k, concrete, pp, dp, ep, tp), lambda r: r // gpus_per_node)
                   for k in GROUP_KINDS)
    return Placement(concrete, gpus_per_node, pp, dp, ep, tp, world, -(-world // gpus_per_node), groups)


def placement_of(parallel, gpus_per_node: int) -> Placement:
    """:func:`place` for anything with ``pp``, ``dp``, ``ep``, ``tp`` and ``rank_order``
    attributes (a recipe's ``parallel`` section, :class:`tessera.cost.types.ParallelShape`);
    a missing ``rank_order`` is ``auto``."""
    return place(parallel.pp, parallel.dp, parallel.ep, gpus_per_node, getattr(parallel, "rank_order", "auto"),
                 parallel.tp)


def realised(planned: Placement, node_of_slot) -> Placement:
    """The placement ``planned`` gets when slot ``s`` (the world rank the rank formula gives) runs
    on node ``node_of_slot[s]`` (any hashable node label): same order and sizes, groups summarised
    on those nodes, ``num_nodes`` the distinct labels."""
    groups = tuple(_summarise(k, group_ranks(k, planned.order, planned.pp, planned.dp, planned.ep, planned.tp),
                              node_of_slot.__getitem__) for k in GROUP_KINDS)
    return Placement(planned.order, planned.gpus_per_node, planned.pp, planned.dp, planned.ep, planned.tp,
                     planned.world, len(set(node_of_slot)), groups)


def _as_good(got: Placement, planned: Placement) -> str | None:
    """None when every group kind of ``got`` spans at most the nodes ``planned`` assumes and has at
    least its members per node; else the first kind that does not, in words."""
    for g, want in zip(got.groups, planned.groups):
        if g.nodes > want.nodes or g.local < want.local:
            return (f"{g.kind} groups across {g.nodes} nodes ({g.local} of {g.size} members on a node) where the "
                    f"plan assumes {want.nodes} ({want.local} of {want.size})")
    return None


def map_ranks(planned: Placement, node_ids) -> tuple[int, ...]:
    """Slots -> world ranks that give the workers' nodes the placement ``planned`` assumes.

    ``node_ids[r]``: the node (any hashable label, Ray's node id) of world rank ``r``. Returns
    ``()`` when world rank ``s`` at slot ``s`` already does (every launcher that numbers the
    processes of a node consecutively with ``gpus_per_node`` per node); else the ranks of each
    node, nodes by their lowest rank and ranks ascending within a node, laid on consecutive slots
    (:class:`tessera.engine.groups.Layout` ``ranks``), when that does.

    Raises:
        TesseraConfigError: ``len(node_ids)`` is not the world size; or no such mapping exists
            (a node holds another number of workers than ``gpus_per_node``): the group kind that
            would cross nodes, the workers per node, and the fix.
    """
    ids = list(node_ids)
    if len(ids) != planned.world:
        raise TesseraConfigError("workers", len(ids), f"the placement needs {planned.world} workers (pp*dp*tp)",
                                 "start pp*dp workers")
    why = _as_good(realised(planned, ids), planned)
    if why is None:
        return ()
    by_node: dict[object, list[int]] = {}
    for r, n in enumerate(ids):
        by_node.setdefault(n, []).append(r)
    ranks = tuple(r for members in by_node.values() for r in members)
    if _as_good(realised(planned, [ids[r] for r in ranks]), planned) is None and _ascending(planned, ranks):
        return ranks
    counts = ", ".join(str(len(v)) for v in by_node.values())
    raise TesseraConfigError("parallel.rank_order", planned.order,
                             f"the workers' nodes put {why} ({counts} workers on {len(by_node)} nodes, "
                             f"hardware.gpus_per_node={planned.gpus_per_node})",
                             f"give every node {planned.gpus_per_node} workers (one per GPU), or set "
                             "hardware.gpus_per_node to the workers each node runs")


def _ascending(planned: Placement, ranks: tuple[int, ...]) -> bool:
    """Every group's world ranks ascend along the group under slot -> rank ``ranks`` (torch numbers
    a group's members by world rank: the EP rank and ordered reductions take that number)."""
    return all(list(m) == sorted(m) for k in GROUP_KINDS
               for g in group_ranks(k, planned.order, planned.pp, planned.dp, planned.ep, planned.tp)
               for m in [[ranks[s] for s in g]])


def check_nodes(planned: Placement, node_ids) -> dict:
    """:func:`map_ranks` of the workers' nodes, as plain JSON values: ``{"ranks"`` (the map, ``[]``
    for none), ``"order"``, ``"nodes"`` (node number of every world rank, numbered by first
    rank), ``"placement"`` (:meth:`Placement.to_dict` of what the nodes give), ``"remapped"}``.

    Raises:
        TesseraConfigError: as :func:`map_ranks`."""
    number: dict = {}
    nodes = [number.setdefault(n, len(number)) for n in node_ids]
    ranks = map_ranks(planned, nodes)
    slots = list(ranks) if ranks else list(range(len(nodes)))
    got = realised(planned, [nodes[r] for r in slots])
    return {"ranks": list(ranks), "order": planned.order, "nodes": nodes, "placement": got.to_dict(),
            "remapped": bool(ranks)}
