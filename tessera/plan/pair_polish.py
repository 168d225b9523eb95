"""Improvement steps of the pair scheduler (:mod:`tessera.plan.pair_scheduler`), bounded budgets.

* :func:`sequence_search`: hill-climb the order of one resource (the EP-comm stream) by shifting
  a task past up to three tasks of the other chain, re-running the list scheduler for the other
  resources around each trial order. One swap there changes the compute order too, which single-resource moves
  cannot do; it finds the schedules where a backward A2A waits for a critical forward one.
* :func:`tabu_search`: tabu search over all resource orders in the job-shop N1 neighbourhood
  (swap two adjacent tasks of one resource on a critical path; van Laarhoven, Aarts and Lenstra,
  Oper. Res. 1992), with Taillard's estimate of each swap's makespan from heads and tails
  (Taillard, ORSA J. Computing 1994), plus exact re-insertion of a critical W task at a
  position that keeps the orders acyclic; one full evaluation per step, optionally ending after
  ``patience`` steps without a shorter makespan (a stagnation rule).

Both return the best (score, order) seen and stop early at the problem's lower bound. Times in
ms; scores as :func:`tessera.plan.pair_problem.score_of`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from tessera.plan.pair_problem import EPS, INF, Order, PairProblem, Score, proven_optimal, run_order, score_of

Relist = Callable[[tuple[int, Sequence[int]]], "tuple[Order, list[float]] | None"]


def sequence_search(p: PairProblem, order: Order, score: Score, r: int, relist: Relist, evals: int,
                    reach: int = 3) -> tuple[Score, Order]:
    """First-improvement search over the sequence of resource ``r``.

    Moves: shift one task of ``r`` later past the next 1 to ``reach`` tasks, or earlier past the
    previous 2 to ``reach`` tasks, when all the tasks it passes belong to the other chain (forward
    vs backward; the tasks of one chain on one resource are ordered by their dependencies). A
    shift by one is the swap of two adjacent tasks. Each trial sequence is scored by
    ``relist((r, sequence))`` (a list-scheduling pass that keeps ``r``'s sequence fixed) and kept
    when the score improves. Scans repeat until one finds nothing, the lower bound is reached or
    ``evals`` trials are spent; a trial sequence scored before is skipped (it was no better than
    the best then, so it is not now) but still counts as one trial.

    Returns:
        (best score, its order); ``(score, order)`` itself when nothing better was found.
    """
    best_sc, best = score, order
    seq = list(order[r])
    fwd = p.forward
    shifts = list(range(1, reach + 1)) + list(range(-2, -reach - 1, -1))
    used = 0
    tried: set[tuple[int, ...]] = set()  # trial sequences already scored
    improved = True
    while improved and used < evals and not proven_optimal(p, best_sc):
        improved = False
        for k in range(len(seq)):
            u = seq[k]
            for step in shifts:
                j = k + step
                lo, hi = (k + 1, j + 1) if step > 0 else (j, k)
                if not 0 <= j < len(seq) or any(fwd[x] == fwd[u] for x in seq[lo:hi]):
                    continue
                trial = seq[:k] + seq[k + 1:]
                trial.insert(j, u)
                key = tuple(trial)
                used += 1
                if key in tried:  # scored before against a best no better than now: no gain
                    if used >= evals:
                        break
                    continue
                tried.add(key)
                out = relist((r, trial))
                if out is not None and (sc := score_of(p, out[1])) < best_sc:
                    best_sc, best, seq, improved = sc, out[0], trial, True
                    break
                if used >= evals:
                    break
            if used >= evals or proven_optimal(p, best_sc):
                break
    return best_sc, best


def tabu_search(p: PairProblem, order: Order, score: Score, steps: int, tenure: int = 8,
                patience: int | None = None) -> tuple[Score, Order]:
    """Tabu search within ``steps`` steps.

    Each step computes heads (semi-active starts) and tails (longest path from a task's end to
    the makespan, over dependencies and resource orders) and picks the best of two move kinds:

    * N1 swaps: adjacent tasks ``u, v`` of one resource on a critical path
      (``end_u + ms_v + tail_v == makespan``, no idle time between them), priced by Taillard's
      estimate (the longest path through ``v`` then ``u`` after the swap);
    * re-insertions of a critical movable task without dependants (a W) anywhere in its
      resource's order, priced exactly (:func:`_best_insertion`).

    Tabu moves are skipped unless they beat the best makespan; after a move, its reverse (or
    moving the same W again) is tabu for ``tenure`` steps. The chosen order is evaluated exactly.
    With ``patience``, the search also ends once that many steps have passed since the last
    step that shortened the best makespan (or lateness).

    Returns:
        (best score, its order) over all steps, the input if nothing was better.
    """
    ms, preds, succs = p.ms, p.preds, p.succs
    cur = [list(s) for s in order]
    out = run_order(p, cur)
    assert out is not None
    start, end, timed = out
    best_sc, best = score, order
    tabu: dict[tuple[int, int], int] = {}
    bad: set[tuple[int, int]] = set()  # swaps that deadlock
    last = 0  # step of the last makespan improvement
    for step in range(steps):
        if proven_optimal(p, best_sc) or (patience is not None and step - last > patience):
            break
        mk = max(end)
        mprev, mnext = _links(p, cur)
        q = _tails(p, mnext, timed)
        pick: tuple[float, int, int, int] | None = None
        for ri, seq in enumerate(cur):
            for k in range(len(seq) - 1):
                u, v = seq[k], seq[k + 1]
                if end[u] + ms[v] + q[v] < mk - 1e-7 or start[v] > end[u] + 1e-7 or u in preds[v] or (u, v) in bad:
                    continue
                a = mprev[u]
                rv = end[a] if a >= 0 else 0.0  # head of v when it moves before u
                for d in preds[v]:
                    if end[d] > rv:
                        rv = end[d]
                ru = rv + ms[v]
                for d in preds[u]:
                    if end[d] > ru:
                        ru = end[d]
                b = mnext[v]
                qu = q[b] + ms[b] if b >= 0 else 0.0  # tail of u when it moves after v
                for x in succs[u]:
                    if q[x] + ms[x] > qu:
                        qu = q[x] + ms[x]
                qv = qu + ms[u]
                for x in succs[v]:
                    if q[x] + ms[x] > qv:
                        qv = q[x] + ms[x]
                est = max(rv + ms[v] + qv, ru + ms[u] + qu)
                if tabu.get((u, v), -1) >= step and not est < best_sc[1] - EPS:
                    continue
                if pick is None or est < pick[0] - EPS:
                    pick = (est, ri, k, u)
        ins = _best_insertion(p, cur, start, end, q, mk, tabu, step, best_sc)
        if ins is not None and (pick is None or ins[0] <= pick[0] + EPS):
            _, ri, seq, w = ins
            cur[ri] = seq
            out = run_order(p, cur)
            assert out is not None  # the insertion position keeps the order acyclic
            tabu[(w, -1)] = step + tenure
            sc = score_of(p, out[1])
        elif pick is not None:
            _, ri, k, u = pick
            seq = cur[ri]
            v = seq[k + 1]
            seq[k], seq[k + 1] = v, u
            out = run_order(p, cur)
            if out is None:  # the swap closes a cycle through another resource: undo, forbid
                seq[k], seq[k + 1] = u, v
                bad.add((u, v))
                continue
            tabu[(v, u)] = step + tenure
            sc = score_of(p, out[1])
        else:
            break
        start, end, timed = out
        if sc < best_sc:
            if sc[:2] < best_sc[:2]:
                last = step
            best_sc, best = sc, [list(x) for x in cur]
    return best_sc, best


def _links(p: PairProblem, order: Order) -> tuple[list[int], list[int]]:
    """Previous and next task of each task on its resource (-1: none)."""
    n = len(p.ms)
    mprev, mnext = [-1] * n, [-1] * n
    for seq in order:
        prev = -1
        for i in seq:
            mprev[i] = prev
            if prev >= 0:
                mnext[prev] = i
            prev = i
    return mprev, mnext


def _tails(p: PairProblem, mnext: list[int], timed: list[int]) -> list[float]:
    """Longest path from each task's end to the makespan over dependants and resource
    successors, ms (tasks not in ``timed``: 0)."""
    ms, succs = p.ms, p.succs
    q = [0.0] * len(ms)
    for i in reversed(timed):
        t = 0.0
        for x in succs[i]:
            if q[x] + ms[x] > t:
                t = q[x] + ms[x]
        x = mnext[i]
        if x >= 0 and q[x] + ms[x] > t:
            t = q[x] + ms[x]
        q[i] = t
    return q


def _best_insertion(p: PairProblem, cur: Order, start: list[float], end: list[float], q: list[float], mk: float,
                    tabu: dict[tuple[int, int], int], step: int, best_sc: Score
                    ) -> tuple[float, int, list[int], int] | None:
    """Best re-insertion of a critical movable task without dependants (a W) into its resource's
    order: (makespan, resource, new sequence, task) or None.

    With the task taken out, the schedule of the others gives heads ``h`` and tails ``q`` and
    makespan ``C``; inserted between ``a`` and ``b`` the task adds exactly the paths through it,
    so the makespan there is ``max(C, max(release, end_a) + ms + ms_b + q_b)``. Only positions
    after every task of the resource that precedes the task (through dependencies and the other
    resource orders) are feasible, the others would close a cycle; for those the formula is
    exact. Returns the position of least makespan (ties: earliest). Only the first such task with
    a new position is tried; a task moved within the tenure is skipped unless the move beats
    ``best_sc``."""
    ms, preds = p.ms, p.preds
    for ri, seq in enumerate(cur):
        for k, w in enumerate(seq):
            if not p.movable[w] or p.succs[w] or start[w] + ms[w] + q[w] < mk - 1e-7:
                continue
            rest = seq[:k] + seq[k + 1:]
            cur[ri] = rest
            base = run_order(p, cur, absent=w)
            cur[ri] = seq
            if base is None:
                continue
            s0, e0, t0 = base
            mprev, mnext = _links(p, [rest] + [x for x in cur if x is not seq])
            q0 = _tails(p, mnext, t0)
            c0 = max(e0)
            rel = max((e0[d] for d in preds[w]), default=0.0)
            # tasks that precede w in the order without it: w must go after all of them
            anc: set[int] = set()
            todo = list(preds[w])
            while todo:
                x = todo.pop()
                if x in anc:
                    continue
                anc.add(x)
                todo.extend(preds[x])
                if mprev[x] >= 0:
                    todo.append(mprev[x])
            lo = 0
            for j, x in enumerate(rest):
                if x in anc:
                    lo = j + 1
            pick, pos = INF, -1
            for j in range(lo, len(rest) + 1):
                h = e0[rest[j - 1]] if j > 0 else 0.0
                if rel > h:
                    h = rel
                c = h + ms[w] + (ms[rest[j]] + q0[rest[j]] if j < len(rest) else 0.0)
                if c < c0:
                    c = c0
                if c < pick - EPS and j != k:
                    pick, pos = c, j
            if pos < 0 or (tabu.get((w, -1), -1) >= step and not pick < best_sc[1] - EPS):
                continue
            return pick, ri, rest[:pos] + [w] + rest[pos:], w
    return None
