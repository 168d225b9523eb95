"""Pair scheduler: order the tasks of one overlapped F&B pair on the rank's unary resources.

A pair DAG (:func:`tessera.sched.chunkdag.pair_dag`) holds two independent chains (the forward
of one chunk, the backward of another) and movable W tasks that depend on their B tasks. Each
resource (compute, EP comm, PP comm) runs one task at a time, without preemption. Goal: the
smallest makespan with every task done, W included, each movable task by its ``deadline_ms``
(``None``: by the end of the pair). Times in ms.

Method (paper summary ``shared/seeds/000_cc179fc699121f47.txt``, 核心方法;
``shared/design/ARCHITECTURE.md``, "Pair scheduler"), an event-driven list scheduler:

1. *Backbone first*: Giffler-Thompson list scheduling of the non-movable tasks by critical-path
   priority (:meth:`TaskDAG.tail_lengths`), ties by remaining load on the busiest resource, then
   id; ``alpha`` is the conflict window (0: non-delay; 1: active, may wait for a more urgent task).
2. *Gap-fit*: each movable task, readiest first, goes into the earliest idle gap of its resource
   after its dependencies where it fits entirely, else where the tasks it delays absorb the shift.
3. *Delay and backfill*: a movable task that would lengthen the makespan is deferred, then placed
   where it costs least, before its deadline if any place meets it (a task that would miss it goes
   back into the main stream where it finishes earliest: correctness first).

Variants of step 1 (``eager``: movable tasks fill a resource during the pass when no backbone
task is ready; ``pilot``: greedy rollouts rank a decision's best candidates) widen the search.
Each result is compacted by forward-backward justification, the best kept (lateness, makespan,
sum of ends, variant order) and polished by a short tabu search; all deterministic. The result
is the semi-active run (:func:`run_in_order`) of its per-resource order. The exact optimum is
:mod:`tessera.plan.pair_ilp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tessera.cost.types import Resource
from tessera.sched.dag import TaskDAG, TaskSchedule, run_in_order

_EPS = 1e-9  # ms; slack for comparisons of accumulated float times


@dataclass(frozen=True)
class SchedulerVariant:
    """One rule for the backbone pass (step 1).

    Attributes:
        name: short id used in reports.
        priority: ``"tail"`` (critical path over the backbone, W excluded) or ``"tail_w"`` (W
            counted, so B tasks that release W rank higher).
        alpha: Giffler-Thompson conflict window in [0, 1]; 0: non-delay, 1: active schedules.
        alpha_comm: the window on communication resources (``None``: ``alpha``); 1 lets an A2A
            wait for a more critical one about to become ready.
        eager: movable tasks join the pass at the lowest priority instead of waiting for gap-fit.
        pilot: if > 0, each decision tries its ``pilot`` best candidates by greedy rollout.
    """

    name: str
    priority: str
    alpha: float
    eager: bool = False
    pilot: int = 0
    alpha_comm: float | None = None


VARIANTS: tuple[SchedulerVariant, ...] = (
    SchedulerVariant("tail/a0", "tail", 0.0),
    SchedulerVariant("tail_w/a0.5", "tail_w", 0.5),
    SchedulerVariant("tail/a0/eager", "tail", 0.0, eager=True),
    SchedulerVariant("tail/a0/eager/pilot3", "tail", 0.0, eager=True, pilot=3),
    SchedulerVariant("tail_w/a0.5c1/eager/pilot3", "tail_w", 0.5, eager=True, pilot=3, alpha_comm=1.0),
)


def schedule_pair(dag: TaskDAG, variants: Sequence[SchedulerVariant] = VARIANTS, polish: int = 1500) -> TaskSchedule:
    """Schedule one pair DAG: backbone-first list scheduling, gap-fit, delay and backfill.

    Args:
        dag: the pair's tasks (durations in ms).
        variants: backbone rules to try (default :data:`VARIANTS`); the best result is kept.
        polish: evaluation budget of the tabu search that polishes the best result (0: off).

    Returns:
        TaskSchedule (ms) whose per-resource order is sorted by start time; replaying the order
        with :func:`run_in_order` gives the same times.

    Raises:
        ValueError: on a cyclic DAG, or if no variant meets every deadline of the movable tasks
            (each is already pulled into the main stream at its earliest point).
    """
    if not dag.tasks:
        return TaskSchedule((), (), 0.0, ())
    if not variants:
        raise ValueError("schedule_pair needs at least one variant")
    ctx = _Context.build(dag)
    best: tuple[tuple[float, float, float], int] | None = None
    best_seqs: dict[Resource, list[int]] = {}
    for k, v in enumerate(variants):
        seqs = _justify(ctx, _gap_fit(ctx, _backbone(ctx, ctx.keys[v.priority], _alphas(ctx, v), v.eager, v.pilot)))
        score = (_score(ctx, seqs), k)
        if best is None or score < best:
            best, best_seqs = score, seqs
    assert best is not None
    if polish > 0:
        best_seqs = _polish(ctx, best_seqs, polish)
        best = (_score(ctx, best_seqs), best[1])
    if best[0][0] > _EPS:
        end = _times(ctx, best_seqs)[1]  # type: ignore[index]
        late = [dag.tasks[i].name for i in ctx.movable
                if (d := ctx.deadline[i]) is not None and end[i] > d + _EPS]
        raise ValueError(f"pair scheduler cannot meet the deadlines of movable tasks {late[:5]} "
                         f"(total lateness {best[0][0]:.6g} ms)")
    return run_in_order(dag, {r: tuple(best_seqs[r]) for r in ctx.resources})


def check_schedule(dag: TaskDAG, schedule: TaskSchedule, tol: float = 1e-6) -> None:
    """Validate a schedule of ``dag``; return None or raise ValueError naming the first fault.

    Checks: one start/end per task with ``end - start == ms`` and ``start >= 0``; every
    dependency ends before its dependant starts; the order lists every task exactly once on its
    own resource, sorted by start time; tasks on one resource do not overlap; movable tasks end by
    their deadline; the makespan is the latest end. ``tol`` is an absolute slack in ms.
    """
    n = len(dag.tasks)
    if len(schedule.start) != n or len(schedule.end) != n:
        raise ValueError(f"schedule has {len(schedule.start)} starts / {len(schedule.end)} ends for {n} tasks")
    for t in dag.tasks:
        s, e = schedule.start[t.id], schedule.end[t.id]
        if s < -tol:
            raise ValueError(f"{t.name} starts at {s} < 0")
        if abs(e - s - t.ms) > tol:
            raise ValueError(f"{t.name} runs {e - s} ms, its duration is {t.ms} ms")
        for d in t.deps:
            if schedule.end[d] > s + tol:
                raise ValueError(f"{t.name} starts at {s} before its dependency {dag.tasks[d].name} "
                                 f"ends at {schedule.end[d]}")
        if t.movable and t.deadline_ms is not None and e > t.deadline_ms + tol:
            raise ValueError(f"movable {t.name} ends at {e} after its deadline {t.deadline_ms}")
    seen = [False] * n
    for r, seq in schedule.order:
        prev = None
        for i in seq:
            if not 0 <= i < n or seen[i]:
                raise ValueError(f"order lists task {i} twice or out of range")
            if dag.tasks[i].resource != r:
                raise ValueError(f"{dag.tasks[i].name} runs on {dag.tasks[i].resource.value}, ordered on {r.value}")
            seen[i] = True
            if prev is not None:
                if schedule.start[i] < schedule.start[prev] - tol:
                    raise ValueError(f"order on {r.value} is not sorted by start at {dag.tasks[i].name}")
                if schedule.start[i] < schedule.end[prev] - tol:
                    raise ValueError(f"{dag.tasks[prev].name} and {dag.tasks[i].name} overlap on {r.value}")
            prev = i
    if not all(seen):
        raise ValueError(f"order misses {[dag.tasks[i].name for i in range(n) if not seen[i]][:5]}")
    if abs(schedule.makespan - max(schedule.end, default=0.0)) > tol:
        raise ValueError(f"makespan {schedule.makespan} is not the latest end {max(schedule.end, default=0.0)}")


# ----------------------------------------------------------------------------------------------
# internals


@dataclass(frozen=True)
class _Context:
    """Per-DAG arrays shared by all variants (read-only)."""

    resources: tuple[Resource, ...]  # resources present, in enum order
    res: tuple[int, ...]  # resource index of each task
    ms: tuple[float, ...]
    deps: tuple[tuple[int, ...], ...]
    movable: tuple[int, ...]  # movable task ids, by id
    deadline: tuple[float | None, ...]
    keys: dict[str, tuple[tuple[float, ...], ...]]  # priority name -> per-task key (larger first)
    backbone: tuple[bool, ...]  # not movable
    tail: tuple[float, ...]  # longest path to the end over backbone successors, ms
    succs: tuple[tuple[int, ...], ...]

    @staticmethod
    def build(dag: TaskDAG) -> "_Context":
        tasks = dag.tasks
        n = len(tasks)
        resources = tuple(r for r in Resource if any(t.resource == r for t in tasks))
        ridx = {r: k for k, r in enumerate(resources)}
        succ = dag.successors()
        topo = dag.topo_order()
        bb = [not t.movable for t in tasks]
        tail_w = dag.tail_lengths()
        tail = [0.0] * n  # critical path over backbone tasks only
        desc = [0] * n  # bitset of descendants (self included)
        for i in reversed(topo):
            tail[i] = tasks[i].ms + max((tail[s] for s in succ[i] if bb[s]), default=0.0)
            m = 1 << i
            for s in succ[i]:
                m |= desc[s]
            desc[i] = m
        loads = [sum(t.ms for t in tasks if t.resource == r) for r in resources]
        hot = ridx[resources[max(range(len(resources)), key=lambda k: (loads[k], -k))]]
        on_hot = sum(1 << t.id for t in tasks if ridx[t.resource] == hot)
        rem = [sum(tasks[j].ms for j in range(n) if (desc[i] & on_hot) >> j & 1) for i in range(n)]
        keys = {
            "tail": tuple((tail[i], rem[i], -i) for i in range(n)),
            "tail_w": tuple((tail_w[i], rem[i], -i) for i in range(n)),
        }
        return _Context(resources, tuple(ridx[t.resource] for t in tasks), tuple(t.ms for t in tasks),
                        tuple(t.deps for t in tasks), tuple(t.id for t in tasks if t.movable),
                        tuple(t.deadline_ms if t.movable else None for t in tasks), keys, tuple(bb), tuple(tail), succ)


def _backbone(ctx: _Context, key: tuple[tuple[float, ...], ...], alpha: tuple[float, ...], eager: bool = False,
              pilot: int = 0) -> dict[Resource, list[int]]:
    """Giffler-Thompson list scheduling; per-resource orders.

    Without ``eager`` only the non-movable tasks are scheduled (movable ones are left to gap-fit;
    a movable task some non-movable task waits for is scheduled here too). With ``eager`` movable
    tasks take part at the lowest priority: they fill a resource only when no backbone task is
    ready there. With ``pilot > 0`` every decision with several candidates tries the ``pilot``
    best of them, completes each trial greedily (non-delay), and keeps the one with the best
    score (a rollout, or "pilot method"); ties go to the priority order."""
    n = len(ctx.ms)
    needed = [eager or ctx.backbone[i] for i in range(n)]
    for i in range(n):  # a movable task with a non-movable successor belongs to the backbone
        if needed[i]:
            stack = list(ctx.deps[i])
            while stack:
                d = stack.pop()
                if not needed[d]:
                    needed[d] = True
                    stack.extend(ctx.deps[d])
    order = sorted(range(n), key=lambda i: (not ctx.backbone[i] if eager else False, tuple(-x for x in key[i])))
    rank = [0] * n  # 0 = most urgent
    for k, i in enumerate(order):
        rank[i] = k
    st = _GTState([-1.0] * n, [0.0] * len(ctx.resources), [[] for _ in ctx.resources],
                  [len(ctx.deps[i]) for i in range(n)], {i for i in range(n) if needed[i] and not ctx.deps[i]},
                  sum(needed), tuple(needed))
    greedy = tuple(0.0 for _ in alpha)
    while st.left:
        conflict = _conflict(ctx, st, rank, alpha)
        pick = conflict[0]
        if pilot > 0 and len(conflict) > 1:
            best = None
            for c in conflict[:pilot]:
                trial = st.copy()
                _apply(ctx, trial, c)
                while trial.left:
                    _apply(ctx, trial, _conflict(ctx, trial, rank, greedy)[0])
                sc = _eval_score(ctx, trial.end)
                if best is None or sc < best:
                    best, pick = sc, c
        _apply(ctx, st, pick)
    return {res: st.seqs[k] for k, res in enumerate(ctx.resources)}


def _alphas(ctx: _Context, v: SchedulerVariant) -> tuple[float, ...]:
    """Conflict window of each resource present."""
    comm = v.alpha if v.alpha_comm is None else v.alpha_comm
    return tuple(v.alpha if r == Resource.COMPUTE else comm for r in ctx.resources)


@dataclass
class _GTState:
    """Mutable state of one list-scheduling pass (local to :func:`_backbone`)."""

    end: list[float]
    free: list[float]
    seqs: list[list[int]]
    missing: list[int]  # unfinished dependencies per task
    ready: set[int]  # tasks of the pass whose dependencies are all done
    left: int  # tasks of the pass not yet started
    needed: tuple[bool, ...]  # task takes part in the pass

    def copy(self) -> "_GTState":
        return _GTState(list(self.end), list(self.free), [list(s) for s in self.seqs], list(self.missing),
                        set(self.ready), self.left, self.needed)


def _conflict(ctx: _Context, st: _GTState, rank: list[int], alpha: tuple[float, ...]) -> list[int]:
    """Giffler-Thompson conflict set of the next decision, most urgent first."""
    free, end, res, ms = st.free, st.end, ctx.res, ctx.ms
    est = {i: max([free[res[i]]] + [end[d] for d in ctx.deps[i]]) for i in st.ready}
    star = min(est, key=lambda i: (est[i] + ms[i], rank[i]))
    r = res[star]
    on_r = [i for i in est if res[i] == r]
    lo = min(est[i] for i in on_r)
    limit = lo + alpha[r] * (est[star] + ms[star] - lo) + _EPS
    return sorted((i for i in on_r if est[i] <= limit), key=rank.__getitem__)


def _apply(ctx: _Context, st: _GTState, i: int) -> None:
    """Start task ``i`` as early as its dependencies and its resource allow."""
    r = ctx.res[i]
    s = max([st.free[r]] + [st.end[d] for d in ctx.deps[i]])
    st.end[i] = st.free[r] = s + ctx.ms[i]
    st.seqs[r].append(i)
    st.ready.discard(i)
    st.left -= 1
    for j in ctx.succs[i]:
        st.missing[j] -= 1
        if st.missing[j] == 0 and st.needed[j]:
            st.ready.add(j)


def _times(ctx: _Context, seqs: dict[Resource, list[int]]) -> tuple[list[float], list[float]] | None:
    """Semi-active execution of per-resource orders (each task as early as its order predecessor
    and dependencies allow); None if the order deadlocks. Tasks absent from ``seqs`` are skipped."""
    n = len(ctx.ms)
    start, end = [0.0] * n, [-1.0] * n
    listed = [False] * n
    for seq in seqs.values():
        for i in seq:
            listed[i] = True
    queues = list(seqs.values())
    pos, free = [0] * len(queues), [0.0] * len(queues)
    todo = sum(len(q) for q in queues)
    while todo:
        moved = False
        for k, seq in enumerate(queues):
            while pos[k] < len(seq):
                i = seq[pos[k]]
                t = free[k]
                for d in ctx.deps[i]:
                    if listed[d]:
                        if end[d] < 0:
                            break
                        if end[d] > t:
                            t = end[d]
                else:
                    start[i], end[i] = t, t + ctx.ms[i]
                    free[k] = end[i]
                    pos[k] += 1
                    todo -= 1
                    moved = True
                    continue
                break
        if not moved:
            return None
    return start, end


def _lateness(ctx: _Context, end: list[float]) -> float:
    """Sum of deadline overruns of movable tasks, ms."""
    return sum(max(0.0, end[i] - d) for i in ctx.movable if (d := ctx.deadline[i]) is not None and end[i] >= 0)


def _gap_fit(ctx: _Context, backbone: dict[Resource, list[int]]) -> dict[Resource, list[int]]:
    """Insert the movable tasks missing from ``backbone`` (gap-fit, then delay and backfill).

    Pass 1 takes them readiest first (each after its movable dependencies) and places each
    without lengthening the makespan, or defers it; pass 2 backfills the deferred ones."""
    seqs = {r: list(s) for r, s in backbone.items()}
    placed = {i for s in seqs.values() for i in s}
    todo = [i for i in ctx.movable if i not in placed]
    for backfill in (False, True):
        deferred: list[int] = []
        while todo:
            avail = [i for i in todo if all(d in placed for d in ctx.deps[i])]
            if not avail:  # pass 1 only: the rest waits for deferred tasks
                break
            _, end = _times(ctx, seqs)  # type: ignore[misc]
            i = min(avail, key=lambda i: (max((end[d] for d in ctx.deps[i]), default=0.0), i))
            todo.remove(i)
            pos = _insertion(ctx, seqs, i, backfill)
            if pos is None:
                deferred.append(i)
                continue
            seqs[ctx.resources[ctx.res[i]]].insert(pos, i)
            placed.add(i)
        todo = deferred + todo
    return seqs


def _insertion(ctx: _Context, seqs: dict[Resource, list[int]], i: int, backfill: bool) -> int | None:
    """Position in its resource's order for movable task ``i``.

    First the earliest idle gap where ``i`` fits entirely (nothing moves), then the earliest
    position that changes neither the makespan nor any deadline; failing both, None, or with
    ``backfill`` the position of least (lateness, own end if late, makespan): a task that would
    miss its deadline goes where it finishes earliest (correctness before makespan)."""
    start, end = _times(ctx, seqs)  # type: ignore[misc]
    seq = seqs[ctx.resources[ctx.res[i]]]
    mk = max((end[j] for s in seqs.values() for j in s), default=0.0)
    ready = max((end[d] for d in ctx.deps[i]), default=0.0)
    dl = ctx.deadline[i]
    horizon = mk if dl is None else min(mk, dl)
    same = set(ctx.deps[i])
    first = max((k + 1 for k, j in enumerate(seq) if j in same), default=0)
    for k in range(first, len(seq) + 1):
        s = max(ready, end[seq[k - 1]] if k > 0 else 0.0)
        if s + ctx.ms[i] <= min(start[seq[k]] if k < len(seq) else mk, horizon) + _EPS:
            return k
    late0 = _lateness(ctx, end)
    best: tuple[float, float, float, int] | None = None
    for k in range(first, len(seq) + 1):
        seq.insert(k, i)
        t = _times(ctx, seqs)
        del seq[k]
        if t is None:
            continue
        late, mk_k = _lateness(ctx, t[1]), max(t[1])
        if mk_k <= mk + _EPS and late <= late0 + _EPS and (dl is None or t[1][i] <= dl + _EPS):
            return k
        score = (late, t[1][i] if late > _EPS else 0.0, mk_k, k)
        if best is None or score < best:
            best = score
    return best[3] if backfill and best is not None else None


def _score(ctx: _Context, seqs: dict[Resource, list[int]]) -> tuple[float, float, float]:
    """Score of an order, smaller is better: (total lateness, makespan, sum of ends), ms."""
    t = _times(ctx, seqs)
    assert t is not None
    return _eval_score(ctx, t[1])


def _eval_score(ctx: _Context, end: list[float]) -> tuple[float, float, float]:
    return _lateness(ctx, end), max(end), sum(end)


def _sgs(ctx: _Context, seq: list[int], preds: tuple[tuple[int, ...], ...]) -> list[float]:
    """Serial schedule generation with insertion: take tasks in ``seq`` (predecessors first) and
    start each at the earliest time after its ``preds`` where its resource has a gap that fits it.
    Returns the end times (ms)."""
    n = len(ctx.ms)
    end = [0.0] * n
    busy: list[list[tuple[float, float]]] = [[] for _ in ctx.resources]
    for i in seq:
        p = ctx.ms[i]
        s = max((end[d] for d in preds[i]), default=0.0)
        iv = busy[ctx.res[i]]
        k = 0
        while k < len(iv):
            a, b = iv[k]
            if s + p <= a + _EPS:
                break
            if b > s:
                s = b
            k += 1
        iv.insert(k, (s, s + p))
        end[i] = s + p
    return end


def _justify(ctx: _Context, seqs: dict[Resource, list[int]], rounds: int = 4) -> dict[Resource, list[int]]:
    """Forward-backward improvement: right-justify the schedule (tasks by decreasing end, each as
    late as possible), then left-justify it (tasks by increasing start of the right-justified
    schedule, each as early as possible), keeping the result while the score improves. Slack
    tasks drift out of the way of critical ones; this never makes a schedule worse."""
    best, best_sc = seqs, _score(ctx, seqs)
    n = len(ctx.ms)
    for _ in range(rounds):
        start, end = _times(ctx, best)  # type: ignore[misc]
        mk = max(end)
        back = sorted(range(n), key=lambda i: (-end[i], -start[i], i))
        rend = _sgs(ctx, back, ctx.succs)  # mirrored time: task i runs [mk - rend[i], mk - rend[i] + ms]
        rstart = [mk - rend[i] for i in range(n)]
        fwd = sorted(range(n), key=lambda i: (rstart[i], i))
        fend = _sgs(ctx, fwd, ctx.deps)
        fstart = [fend[i] - ctx.ms[i] for i in range(n)]
        new = {r: sorted(seq, key=lambda i: (fstart[i], fend[i], i)) for r, seq in best.items()}
        if _times(ctx, new) is None:
            break
        sc = _score(ctx, new)
        if not sc < best_sc:
            break
        best, best_sc = new, sc
    return best


def _critical(ctx: _Context, seqs: dict[Resource, list[int]], start: list[float], end: list[float]) -> list[bool]:
    """Tasks on a tight chain (dependency or resource order) that ends at the makespan."""
    prev = [-1] * len(ctx.ms)
    for seq in seqs.values():
        for a, b in zip(seq, seq[1:]):
            prev[b] = a
    mk = max(end)
    crit = [False] * len(ctx.ms)
    stack = [i for i, e in enumerate(end) if e >= mk - _EPS]
    while stack:
        i = stack.pop()
        if not crit[i]:
            crit[i] = True
            stack.extend(d for d in ctx.deps[i] + ((prev[i],) if prev[i] >= 0 else ())
                         if not crit[d] and end[d] >= start[i] - _EPS)
    return crit


def _polish(ctx: _Context, seqs: dict[Resource, list[int]], budget: int, tenure: int = 6) -> dict[Resource, list[int]]:
    """Tabu search on the per-resource orders within ``budget`` order evaluations.

    Moves: swap two adjacent critical tasks of a resource (the job-shop N1 neighbourhood), or
    move a critical movable task up to 3 places earlier, 4 later, or to the end. Each step takes
    the best non-tabu move, even a worsening one (a tabu move only if it beats the best); undoing a
    swap or moving the same movable task again is tabu for ``tenure`` steps. Returns the best
    order seen (score: lateness, makespan, sum of ends)."""
    cur = {r: list(s) for r, s in seqs.items()}
    best, best_sc = {r: list(s) for r, s in cur.items()}, _score(ctx, cur)
    tabu: dict[tuple[int, int], int] = {}
    evals = step = 0
    while evals < budget:
        step += 1
        start, end = _times(ctx, cur)  # type: ignore[misc]
        crit = _critical(ctx, cur, start, end)
        pick = None
        for r, seq in cur.items():
            moves = [(k, k + 1, (seq[k + 1], seq[k])) for k in range(len(seq) - 1)
                     if crit[seq[k]] and crit[seq[k + 1]] and seq[k] not in ctx.deps[seq[k + 1]]]
            for k, i in enumerate(seq):
                if crit[i] and not ctx.backbone[i]:
                    js = sorted(set(range(max(0, k - 3), min(len(seq), k + 5))) | {len(seq)})
                    moves.extend((k, j, (i, -1)) for j in js if j not in (k, k + 1))
            for k, j, attr in moves:
                if evals >= budget:
                    break
                trial = list(seq)
                if j == k + 1:
                    trial[k], trial[j] = trial[j], trial[k]
                else:
                    trial.insert(j if j < k else j - 1, trial.pop(k))
                cur[r] = trial
                t = _times(ctx, cur)
                cur[r] = seq
                evals += 1
                if t is None:
                    continue
                sc = _eval_score(ctx, t[1])
                if tabu.get(attr, 0) >= step and not sc < best_sc:
                    continue
                if pick is None or sc < pick[0]:
                    pick = (sc, r, trial, (attr[1], attr[0]) if attr[1] >= 0 else attr)
        if pick is None:
            break
        sc, r, cur[r], undo = pick
        tabu[undo] = step + tenure
        if sc < best_sc:
            best, best_sc = {q: list(v) for q, v in cur.items()}, sc
    return best
