"""A lower bound on the iteration time of *every* partition: what no stage boundaries can beat.

``partition_lower_bound(costs, template=..., pp=..., vpp=..., num_microbatches=..., overlap=...,
split_w=...) -> PartitionBound`` returns a time (ms) below the simulated iteration of every plan of
that shape (any partition of the layers into ``pp * vpp`` virtual stages, each with at least one
decoder layer, or the embedding alone on stage 0, or the head alone on the last stage; any pair
orders the planner stores) and below each such plan's own lower bound
(:func:`tessera.sim.bound.iteration_lower_bound`, the per-plan bound of ``docs/planner.md``,
"Lower bound"). ``baseline_ms / bound`` is then the largest iteration ratio any Tessera plan of
the shape could reach under the cost model (``max_iteration_ratio`` of ``benchmarks/planner.py``).
``tests/test_partition_bound.py`` checks it against every partition of small instances.

**Which plans.** The template fixes every rank's compute instructions (``F``, ``B``, ``W``, ``FB``:
:func:`tessera.program.templates.compute_schedule`); the partition fixes what each one computes.
An ``FB`` runs either *overlapped* (compute tasks slowed by
:func:`tessera.sched.chunkdag.pair_slowdown`, which depends on the pair's communication, so the
bound takes its least value, ``sd = 1``; any task order) or *back to back* (``PairOrder.overlapped=False``, full speed, every forward compute task
before every backward compute task, as :func:`tessera.sched.chunkdag.serial_order`, the only
non-overlapped order the planner stores: :func:`tessera.plan.pair_cost.best_pair`). The simulator
would also run a not-overlapped pair in an interleaved order at full speed; such hand-made plans
are outside the bound's claim.

**The per-plan bound relaxed** (all ms). The per-plan bound is, per rank, Carlier's one-machine
bound ``max over job sets J of min_J head + sum_J d + min_J tail``. Here every term is replaced by
a lower bound that is *linear* in the partition, and the partition is a variable of a SCIP MILP:

* per extended layer ``l`` (:func:`layer_terms`): ``pf_l``, ``pb_l`` its forward / backward
  critical path (longest task chain of the layer), ``cf_l, cb_l, cw_l`` its compute load per
  phase, its load on every other resource, the same paths with compute slowed; across layers of a
  chunk a layer's entry tasks wait for all exits of the previous layer, so a chunk's critical
  path is the sum of its layers' (``P_f(s)``, ``P_b(s)`` of stage ``s``);
* durations: an ``F`` lasts at least ``max(P_f, C_f, loads)`` of its stage, a ``B`` the same
  for the backward (its W's compute included when it keeps W), a ``W`` its compute; an ``FB`` of
  stages ``(f, b)``, overlapped, at least ``max(sd (C_f + C_b), E_f + E_b, P_f^sd, P_b^sd)``;
  back to back at least ``max(C_f + C_b, E_f + E_b, P_f + P_b - mu - lam)``: the last forward
  compute task ends at least ``P_f - mu`` after the pair's start and the backward's longest
  chain from a compute task, at least ``P_b - lam``, starts after it (``mu``, ``lam``: the
  largest over layers of the chain time after a layer's last forward compute task, before its
  first backward compute task). One binary per ``FB`` class chooses the mode (the MILP takes the
  cheaper);
* heads and tails: one path of the instruction DAG each, with every instruction on it at its
  chain term: ``F(m, s)`` after the forwards of stages ``< s``; a ``B`` (or an ``FB``, which holds
  one) of stage ``s`` after every forward and the backwards of stages ``> s``; a ``W`` after its
  ``B``; tails the mirror image down to stage 0 and its rank's optimizer step (a ``W``: its own
  rank's optimizer step and its chunk's gradient reduce-scatter); ``costs.p2p_ms`` per rank
  change on the path;
* job sets: per rank, every ``J = {jobs whose head and tail include given ones}``; heads and tails
  are sums of non-negative terms, so ``min_J head`` is at least the terms every job of ``J``
  shares (coefficient-wise minimum), exactly what the rank's per-plan bound sees for that ``J``.

So for every plan, each term of its per-plan bound is at least the MILP's term at its partition,
and the MILP's optimum (or SCIP's dual bound when its node limit or time cap stops it) is at most
every plan's per-plan bound, hence at most every simulated iteration. Not seen (only loosens it):
memory (every partition counts, even one that does not fit), zero1 gathers, FSDP gathers, the
data-parallel link, and ranks competing for the same microbatches' chains. Per-rank slowdown
(``ModelCosts.rank_scale``) is seen only as its least factor, every rank's compute scaled by it
(no rank's compute is shorter; a slowed rank is longer than the bound assumes).

Pure function of its arguments; the SCIP model lives in the call.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

from pyscipopt import SCIP_PARAMSETTING, Model, quicksum

from tessera.cost.types import ModelCosts
from tessera.program.instructions import Op
from tessera.program.plan import Partition
from tessera.program.templates import compute_schedule, rank_chunk_of, stage_of
from tessera.spec.tasks import Phase, Resource

_PHASES = (Phase.F, Phase.B, Phase.W)


@dataclass(frozen=True)
class LayerTerms:
    """Per extended layer (index ``l + 1`` for layer ``l``: 0 is the embedding, the last the
    head), the chain and load terms of the bound, ms (module docstring).

    Attributes:
        values: term name -> one value per extended layer. Names: ``pf``, ``pb`` (critical path
            of the layer's F / B tasks), ``pf_sd``, ``pb_sd`` (the same with compute slowed by
            ``sd``, the least overlap slowdown: module docstring), ``F:r``, ``B:r``, ``W:r`` (load of each phase on resource
            ``r``, a :class:`Resource` value), ``opt`` and ``red`` (optimizer step, gradient
            reduce-scatter: ``LayerDP``).
        mu: the most chain time after a layer's last F compute task (``inf`` if a layer has F
            tasks but none on compute).
        lam: the most chain time before a layer's first B compute task (``inf`` likewise).
        resources: the resources with load, sorted by value.
    """

    values: dict
    mu: float
    lam: float
    resources: tuple[str, ...]


def _paths(tasks, idx: list[int], scale) -> tuple[float, float, float]:
    """Longest entry-to-exit chain of the tasks ``idx`` (deps inside them), the longest chain
    ending with a compute task, and the longest starting with one, ms."""
    if not idx:
        return 0.0, 0.0, 0.0
    inside = set(idx)
    ms = {j: tasks[j].ms * scale(tasks[j]) for j in idx}
    preds = {j: [d for d in tasks[j].deps if d in inside] for j in idx}
    succs: dict[int, list[int]] = {j: [] for j in idx}
    for j in idx:
        for d in preds[j]:
            succs[d].append(j)
    end: dict[int, float] = {}
    tail: dict[int, float] = {}

    def end_of(j: int) -> float:  # longest chain ending at j's end
        if j not in end:
            end[j] = ms[j] + max((end_of(d) for d in preds[j]), default=0.0)
        return end[j]

    def tail_of(j: int) -> float:  # longest chain starting at j's start
        if j not in tail:
            tail[j] = ms[j] + max((tail_of(s) for s in succs[j]), default=0.0)
        return tail[j]

    comp = [j for j in idx if tasks[j].resource == Resource.COMPUTE]
    inf = float("inf")
    return (max(end_of(j) for j in idx), max((end_of(j) for j in comp), default=-inf),
            max((tail_of(j) for j in comp), default=-inf))


def layer_terms(costs: ModelCosts) -> LayerTerms:
    """The per-layer terms of ``costs`` (:class:`LayerTerms`)."""
    sd = 1.0  # the least compute slowdown of an overlapped pair (chunkdag.pair_slowdown: 1 with no communication)
    n = len(costs.layers)
    vals: dict[str, list[float]] = {}
    mu = lam = 0.0
    res: set[str] = set()

    def put(name: str, k: int, v: float) -> None:
        vals.setdefault(name, [0.0] * (n + 2))[k] += v

    for k, l in enumerate(range(-1, n + 1)):
        lc = costs.layer(l)
        tasks = lc.tasks
        for ph in _PHASES:
            idx = [j for j, t in enumerate(tasks) if t.phase == ph]
            for j in idx:
                res.add(tasks[j].resource.value)
                put(f"{ph.value}:{tasks[j].resource.value}", k, tasks[j].ms)
                if ph == Phase.W:  # a W run as its own instruction also pays its host cost
                    put(f"Wd:{tasks[j].resource.value}", k, tasks[j].ms + tasks[j].deferred_ms)
            if ph == Phase.W:
                continue
            p, ends_c, starts_c = _paths(tasks, idx, lambda t: 1.0)
            p_sd = _paths(tasks, idx, lambda t: sd if t.resource == Resource.COMPUTE else 1.0)[0]
            key = "pf" if ph == Phase.F else "pb"
            put(key, k, p)
            put(key + "_sd", k, p_sd)
            if idx and ph == Phase.F:
                mu = max(mu, p - ends_c)
            elif idx:
                lam = max(lam, p - starts_c)
        put("opt", k, lc.dp.optimizer_ms)
        put("red", k, lc.dp.reduce_ms)
    for name in ("pf", "pb", "pf_sd", "pb_sd"):
        vals.setdefault(name, [0.0] * (n + 2))
    return LayerTerms({k: tuple(v) for k, v in vals.items()}, mu, lam, tuple(sorted(res)))


@dataclass(frozen=True)
class PartitionBound:
    """What :func:`partition_lower_bound` proved.

    Attributes:
        ms: the bound (SCIP's dual bound: the optimum when ``optimal``; 0 when a limit
            stopped SCIP before its root LP), ms.
        optimal: SCIP closed the gap (``ms`` is the relaxation's optimum, reached by ``partition``).
        partition: the relaxation's best partition found (not a plan recommendation: the
            relaxation ignores memory and the rest listed in the module docstring).
        relaxed_ms: the relaxation's value at ``partition``, ms (``>= ms``).
        solve_s: wall seconds of the call.
        n_vars, n_conss: size of the MILP.
        nodes: branch-and-bound nodes SCIP explored (at most ``node_limit``).
        cap_hit: the wall-clock safety cap (``time_limit_s``) stopped SCIP before its node limit
            or the optimum: ``ms`` then depends on the machine's speed and load (still a valid
            bound).
    """

    ms: float
    optimal: bool
    partition: Partition | None
    relaxed_ms: float
    solve_s: float
    n_vars: int
    n_conss: int
    nodes: int = 0
    cap_hit: bool = False


BOUND_WORK = 150_000
"""The deterministic limit of :func:`partition_lower_bound` by default, in node-rows: SCIP may
explore ``BOUND_WORK // rows`` branch-and-bound nodes (``limits/totalnodes``; a node's LP work
grows with the model's rows), so the same costs give the same bound on any machine at any load.
Small instances close well within it (``tests/test_partition_bound.py``: at most 591 nodes);
the real-model bounds of ``benchmarks/planner.py`` stop after 45-90 nodes, 10-18 s in all on
the 2-core machine at load 1 (most of it the root node; ``docs/planner.md``, "Deterministic
budgets")."""


def _job_classes(template: str, pp: int, vpp: int, m: int, overlap: bool, split_w: bool) -> list[Counter]:
    """Per rank, ``(op, f_stage, b_stage, with_w) -> count`` of its compute instructions
    (``f_stage`` / ``b_stage`` the stage whose forward / backward (or W) it runs, else -1)."""
    out = []
    for r, instrs in enumerate(compute_schedule(template, pp, vpp, m, overlap, split_w)):
        c: Counter = Counter()
        for i in instrs:
            st = stage_of(template, r, i.chunk, pp, vpp) if i.op != Op.REGISTER_W else -1
            if i.op == Op.F:
                c[("F", st, -1, False)] += 1
            elif i.op == Op.B:
                c[("B", -1, st, i.with_w)] += 1
            elif i.op == Op.W:
                c[("W", -1, st, False)] += 1
            elif i.op == Op.FB:
                c[("FB", st, stage_of(template, r, i.chunk2, pp, vpp), i.with_w)] += 1
        out.append(c)
    return out


def _chains(owner: Sequence[int]):
    """Head and tail of each job class as ``{atom: coefficient}`` (atoms ``("pf", s)``,
    ``("pb", s)``, ``("opt", r)``, ``("red", s)``, ``"lag"``)."""
    S = len(owner)
    cross_f = [0] + [int(owner[k] != owner[k - 1]) for k in range(1, S)]  # arc F(k-1) -> F(k)
    cross_b = [int(owner[k] != owner[k + 1]) for k in range(S - 1)] + [0]  # arc B(k+1) -> B(k)

    def fwd(lo: int, hi: int) -> dict:  # forwards of stages lo..hi-1 and the arcs into lo+1..hi
        d: dict = {("pf", k): 1 for k in range(lo, hi)}
        d["lag"] = sum(cross_f[k] for k in range(lo + 1, min(hi, S - 1) + 1)) if hi > lo else 0
        return d

    def add(*ds: dict) -> dict:
        out: dict = {}
        for d in ds:
            for a, v in d.items():
                out[a] = out.get(a, 0) + v
        return out

    def head_b(s: int) -> dict:  # every forward, then the backwards of stages S-1 .. s+1
        return add(fwd(0, S), {"lag": 0}, {("pb", k): 1 for k in range(s + 1, S)},
                   {"lag": sum(cross_b[k] for k in range(s, S - 1))})

    def tail_b(s: int) -> dict:  # the backwards of stages s-1 .. 0, then rank owner[0]'s optimizer
        return add({("pb", k): 1 for k in range(s)}, {"lag": sum(cross_b[k] for k in range(s))},
                   {("opt", owner[0]): 1})

    def head(key) -> dict:
        op, f, b, _ = key
        if op == "F":
            return fwd(0, f)
        if op == "W":
            return add(head_b(b), {("pb", b): 1})
        return head_b(b)

    def tail(key, rank: int) -> dict:
        op, f, b, _ = key
        if op == "W":
            return {("opt", rank): 1, ("red", b): 1}
        if op == "B":
            return tail_b(b)
        # F / FB: the forwards after f, every backward, rank owner[0]'s optimizer
        return add({("pf", k): 1 for k in range(f + 1, S)}, {"lag": sum(cross_f[k] for k in range(f + 1, S))},
                   tail_b(S) if S else {}, {"lag": 0})

    return head, tail


def _covers(big: dict, small: dict) -> bool:
    return all(big.get(a, 0) >= v for a, v in small.items())


def _meet(ds: list[dict]) -> dict:
    """Coefficient-wise minimum (the terms every one of ``ds`` has), in ``ds[0]``'s order (no set
    order: string hashes differ per process, and SCIP's path depends on the order of terms)."""
    return {a: min(d[a] for d in ds) for a in ds[0] if all(a in d for d in ds[1:])}


def partition_lower_bound(costs: ModelCosts, *, template: str, pp: int, vpp: int, num_microbatches: int,
                          overlap: bool = True, split_w: bool = True, time_limit_s: float = 60.0,
                          warm_start: Partition | None = None, fixed: Partition | None = None,
                          alone: bool = True, work: int = BOUND_WORK, node_limit: int | None = None) -> PartitionBound:
    """The least iteration time any partition of this shape can reach (module docstring), ms.

    Args:
        costs: per-task costs.
        template, pp, vpp, num_microbatches, overlap, split_w: the pipeline shape.
        time_limit_s: wall-clock safety cap, s; when it stops the solve first, ``ms`` is SCIP's
            dual bound then (still a valid bound, ``optimal=False``) and ``cap_hit`` is set.
        warm_start: a partition to give SCIP as its first incumbent (e.g. the baseline's).
        fixed: evaluate the relaxation at this one partition instead (``ms`` is then its value:
            at most the per-plan bound of every plan with that partition).
        alone: the partitions include those whose stage 0 holds the embedding alone or whose
            last stage holds the head alone (the planner's search offers them); ``False``: every
            stage holds a decoder layer.
        work, node_limit: the deterministic limit: SCIP's branch-and-bound nodes, ``node_limit``
            or else ``work // rows`` (at least 1; :data:`BOUND_WORK`); when it stops the solve,
            ``ms`` is SCIP's dual bound there (``optimal=False``).

    Raises:
        TesseraConfigError: a shape the template cannot run (``compute_schedule``), or fewer
            decoder layers than stages.
    """
    t0 = time.perf_counter()
    L, S = len(costs.layers), pp * vpp
    classes = _job_classes(template, pp, vpp, num_microbatches, overlap, split_w)
    if L < S:
        from tessera.errors import TesseraConfigError

        raise TesseraConfigError("parallel.pp", pp, f"{S} virtual stages need at least {S} decoder layers, "
                                 f"the model has {L}", "lower parallel.pp or parallel.vpp")
    owner = [rank_chunk_of(template, s, pp, vpp)[0] for s in range(S)]
    if costs.rank_scale:  # every rank at the least factor: no rank runs faster (module docstring)
        costs = replace(costs, rank_scale=()).scaled(min(costs.rank_scale))
    lt = layer_terms(costs)
    m = Model("partition_bound")
    m.hideOutput()
    m.setSeparating(SCIP_PARAMSETTING.OFF)
    m.setPresolve(SCIP_PARAMSETTING.FAST)  # default presolving took > 2 s on Qwen3-Next-80B pp 8 vpp 2
    m.setParam("randomization/randomseedshift", 0)
    # v[s][l] = 1: decoder layer l lies in a stage <= s (prefix form; stage s+1 starts where v drops)
    v = [[None] * L for _ in range(S)]
    a = int(alone and S > 1)  # stage 0 and the last stage may hold no decoder layer
    for s in range(S):
        for l in range(L):
            if s == S - 1 or l <= s - a:  # every (middle) stage holds at least one decoder layer
                v[s][l] = 1
            elif l >= L - (S - 1 - s) + a:
                v[s][l] = 0
            else:
                v[s][l] = m.addVar(f"v_{s}_{l}", vtype="B")
    for s in range(S):
        for l in range(L):
            if l + 1 < L and not isinstance(v[s][l], int):
                m.addCons(v[s][l] >= v[s][l + 1])
            if s + 1 < S and not isinstance(v[s][l], int) and not isinstance(v[s + 1][l], int):
                m.addCons(v[s][l] <= v[s + 1][l])

    def u(s: int, l: int):
        return v[s][l] - (v[s - 1][l] if s else 0)

    for s in range(S):
        if not (a and s in (0, S - 1)):
            m.addCons(quicksum(u(s, l) for l in range(L)) >= 1)
    cache: dict = {}

    def stage(name: str, s: int):
        """Sum of term ``name`` over stage ``s``'s extended layers (linear in ``v``)."""
        if (name, s) not in cache:
            vals = lt.values.get(name, (0.0,) * (L + 2))
            e = quicksum(vals[l + 1] * u(s, l) for l in range(L) if vals[l + 1])
            const = (vals[0] if s == 0 else 0.0) + (vals[L + 1] if s == S - 1 else 0.0)
            y = m.addVar(f"{name}_{s}", lb=None)  # one variable per stage term keeps the rows sparse
            m.addCons(y == e + const)
            cache[(name, s)] = y
        return cache[(name, s)]

    comm = [r for r in lt.resources if r != Resource.COMPUTE.value]
    C = Resource.COMPUTE.value
    sd = 1.0  # the least compute slowdown of an overlapped pair (chunkdag.pair_slowdown: 1 with no communication)

    def most(name: str) -> float:
        """An upper bound on term ``name`` of any stage: its ``L - S + 1`` (``+ 2`` with
        ``alone``) largest decoder layers, the embedding and the head."""
        vals = lt.values.get(name, (0.0,) * (L + 2))
        return sum(sorted(vals[1:L + 1], reverse=True)[:min(L, L - S + 1 + 2 * a)]) + vals[0] + vals[L + 1]

    dvar: dict = {}

    def lower(var, exprs) -> None:
        for e in exprs:
            m.addCons(var >= e)

    def dur(key):
        """The duration variable of a job class (>= its lower bounds)."""
        if key in dvar:
            return dvar[key]
        op, f, b, ww = key
        x = m.addVar(f"d_{op}_{f}_{b}_{int(ww)}", lb=0.0)
        dvar[key] = x

        def load(r: str, fs: int | None, bs: int | None, w: bool):
            parts = ([stage(f"F:{r}", fs)] if fs is not None else []) + \
                    ([stage(f"B:{r}", bs)] if bs is not None else []) + ([stage(f"W:{r}", bs)] if w else [])
            return quicksum(parts)

        if op == "F":
            lower(x, [stage("pf", f), load(C, f, None, False)] + [load(r, f, None, False) for r in comm])
        elif op == "B":
            lower(x, [stage("pb", b), load(C, None, b, ww)] + [load(r, None, b, ww) for r in comm])
        elif op == "W":
            lower(x, [stage(f"Wd:{r}", b) for r in lt.resources])
        else:  # FB: overlapped (z = 0) or back to back (z = 1)
            z = m.addVar(f"z_{f}_{b}_{int(ww)}", vtype="B")
            loads = [load(r, f, b, ww) for r in comm]
            # either mode: the unslowed loads and chains (no binary; they carry the LP relaxation)
            lower(x, [load(C, f, b, ww), stage("pf", f), stage("pb", b)] + loads)
            # overlapped: each slowed term exceeds its unslowed one by at most (sd - 1) x its most
            # over any stage, so that big-M switches it off exactly when z = 1
            lower(x, [sd * load(C, f, b, ww) - (sd - 1) * (most(f"F:{C}") + most(f"B:{C}") + ww * most(f"W:{C}")) * z,
                      stage("pf_sd", f) - (sd - 1) * most(f"F:{C}") * z,
                      stage("pb_sd", b) - (sd - 1) * most(f"B:{C}") * z])
            if lt.mu < float("inf") and lt.lam < float("inf"):  # back to back: the chains one after the other
                lower(x, [stage("pf", f) + stage("pb", b) - (lt.mu + lt.lam)
                          - min(most("pf"), most("pb")) * (1 - z)])
        return x

    head, tail = _chains(owner)

    def atom(a):
        if a == "lag":
            return costs.p2p_ms
        kind, i = a
        if kind == "opt":
            return quicksum(stage("opt", s) for s in range(S) if owner[s] == i)
        return stage("pf" if kind == "pf" else "pb" if kind == "pb" else "red", i)

    T = m.addVar("T", lb=0.0)
    n_rows = 0
    for r, cls in enumerate(classes):
        keys = sorted(cls)
        hs = {k: head(k) for k in keys}
        qs = {k: tail(k, r) for k in keys}
        seen = set()
        # rows in a fixed order (sorted, not set order: the model and SCIP's path would differ
        # between processes, string hashes being salted per process)
        for A in sorted({()} | {tuple(sorted(h.items(), key=str)) for h in hs.values()}, key=str):  # (): no threshold
            for B in sorted({()} | {tuple(sorted(q.items(), key=str)) for q in qs.values()}, key=str):
                J = tuple(k for k in keys if _covers(hs[k], dict(A)) and _covers(qs[k], dict(B)))
                if not J or J in seen:
                    continue
                seen.add(J)
                h, q = _meet([hs[k] for k in J]), _meet([qs[k] for k in J])
                expr = quicksum(c * atom(a) for a, c in h.items() if c) + quicksum(c * atom(a) for a, c in q.items() if c)
                m.addCons(T >= expr + quicksum(cls[k] * dur(k) for k in J))
                n_rows += 1
    m.setObjective(T, "minimize")
    if node_limit is None:
        node_limit = max(1, work // max(m.getNConss(transformed=False), 1))
    m.setParam("limits/totalnodes", int(node_limit))
    m.setParam("limits/time", max(float(time_limit_s), 0.1))
    if fixed is not None:
        for s in range(S - 1):
            for l in range(L):
                if not isinstance(v[s][l], int):
                    val = 1.0 if l < fixed.bounds[s + 1] else 0.0
                    m.chgVarLb(v[s][l], val)
                    m.chgVarUb(v[s][l], val)
    elif warm_start is not None and warm_start.num_stages == S:
        sol = m.createPartialSol()
        for s in range(S - 1):
            cut = warm_start.bounds[s + 1]  # stage s holds extended layers < cut
            for l in range(L):
                if not isinstance(v[s][l], int):
                    m.setSolVal(sol, v[s][l], 1.0 if l < cut else 0.0)
        m.addSol(sol)
    m.optimize()
    part, relaxed = None, float("inf")
    if m.getNSols() > 0:
        best = m.getBestSol()
        bounds = [-1]
        for s in range(S - 1):
            bounds.append(sum(1 for l in range(L) if round(v[s][l] if isinstance(v[s][l], int)
                                                          else m.getSolVal(best, v[s][l])) == 1))
        bounds.append(L + 1)
        part, relaxed = Partition(tuple(bounds)), m.getSolObjVal(best)
    status = m.getStatus()
    dual = float(m.getDualbound())  # -1e20 when a limit stops SCIP before the root LP
    return PartitionBound(ms=max(dual, 0.0), optimal=status == "optimal", partition=part,
                          relaxed_ms=float(relaxed), solve_s=time.perf_counter() - t0, n_vars=m.getNVars(),
                          n_conss=m.getNConss(), nodes=int(m.getNTotalNodes()), cap_hit=status == "timelimit")
