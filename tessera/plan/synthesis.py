"""Schedule synthesis: each rank's instruction order written by the planner, not taken from a template
(the list scheduler that writes one order: :mod:`tessera.plan.list_scheduler`; this module
searches its policies).

A template (:mod:`tessera.program.templates`) fixes which forward each rank runs when, which
backward it pairs with in an ``FB``, and where every W goes. The synthesizer keeps the template's
stage placement and writes the order itself (``docs/planner.md``, "Schedule synthesis").

The list scheduler (:func:`tessera.plan.list_scheduler.list_schedule`) writes one order under a
:class:`~tessera.plan.list_scheduler.Policy` (its module docstring gives the rules it keeps:
per-chunk microbatch order, memory, the in-flight cap). A policy sets which ready forward and
which ready backward go first, whether W runs right after its backward or waits for idle time,
how many microbatch-chunks each rank may hold beyond the template's warm-up, and how long a rank
waits for a message already on its way to pair two instructions.

:func:`synthesize` searches the policies (a grid, then a per-rank local search on the warm-up
caps and pair waits) with the caller's ``evaluate`` (compile, validate, memory check, simulate) in the loop and
keeps the fastest; the template's own order is its first candidate, so it never returns a
slower plan than the one it started from. What the list scheduler learned from: zero-bubble's
automatic scheduler (Qi et al., ICLR 2024, sec. 3: greedy placement of F, B, W with W filling
the bubbles under a memory limit), AdaPtis (schedule generated from a performance model, jointly
with the partition), torch.distributed.pipelining's ZB lowering passes (W split from B per
stage, per-chunk order kept), Kimi-K2's extra warm-up microbatches (the ``extra`` cap).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from itertools import product
from typing import Callable, Sequence

from tessera.cost.types import ModelCosts
from tessera.plan.list_scheduler import B_FIRST, Policy, RankChange, list_schedule, rank_changes
from tessera.plan.pair_cost import Scheduler
from tessera.program.plan import Plan

Evaluate = Callable[[Plan], float]


@dataclass(frozen=True)
class SynthesisResult:
    """What :func:`synthesize` found.

    Attributes:
        plan: the fastest plan (the start plan itself when nothing beat it).
        start: the plan it started from (the template's order; its partition and pair orders).
        start_ms, iteration_ms: the start plan's and the result's evaluated iteration, ms.
        policy: the policy that wrote the result's order (``None``: the template's order kept).
        evaluations: plans evaluated (the joint partition search's included); search_s: wall
            time, s.
        changes: per rank, what changed against the template (empty when the template's order won).
        cap_hit: the wall-clock safety cap stopped the search.
        joint_evaluations, joint_moves: plans the joint search (stage boundaries moved, the order
            re-synthesised under :attr:`policy`, :func:`tessera.plan.planner.make_plan`)
            evaluated, and the boundary moves it took.
        max_evals: the budget it was given, evaluations.
        written: rank orders the list scheduler wrote (distinct ones; those its own prediction
            put more than :data:`PREDICT_SLACK` above the best were not simulated).
    """

    plan: Plan
    start: Plan
    start_ms: float
    iteration_ms: float
    policy: Policy | None
    evaluations: int
    search_s: float
    changes: tuple[RankChange, ...] = ()
    cap_hit: bool = False
    joint_evaluations: int = 0
    joint_moves: int = 0
    max_evals: int = 0
    written: int = 0

    @property
    def improved(self) -> bool:
        return self.policy is not None


def policy_grid(pp: int, split_w: bool, overlap: bool) -> tuple[Policy, ...]:
    """The policies :func:`synthesize` tries first: every priority pair, W after its backward or
    deferred (with split W), a uniform warm-up allowance of 0, 2 or ``pp`` microbatch-chunks,
    and (with overlap) no wait, or a wait of half or a whole instruction to pair. The settings
    that won on the real presets come first (depth-first forwards, deferred W, the larger
    allowance and wait: Qwen3-Next-80B, ``docs/planner.md``), so a small budget tries them."""
    out = []
    for f, b, d, e, w in product(("depth", "breadth", "mb"), B_FIRST, (True, False) if split_w else (False,),
                                 (pp, 2, 0), (1.0, 0.5, 0.0) if overlap else (0.0,)):
        out.append(Policy(f, b, d, (e,) * pp, (w,) * pp))
    return tuple(out)


def _step_extra(d: int):
    def move(pol: Policy, r: int, pp: int) -> Policy | None:
        ex = list(pol.extra or (0,) * pp)
        ex[r] += d
        return None if ex[r] < 0 else replace(pol, extra=tuple(ex))
    return move


def _step_wait(d: float):
    def move(pol: Policy, r: int, pp: int) -> Policy | None:
        w = list(pol.pair_wait or (0.0,) * pp)
        w[r] = round(w[r] + d, 6)
        return None if w[r] < 0 else replace(pol, pair_wait=tuple(w))
    return move


_RANK_MOVES = (_step_extra(1), _step_extra(-1), _step_wait(0.5), _step_wait(-0.5))
"""The local search's moves on one rank: its warm-up allowance +-1, its pair wait +-0.5."""


PREDICT_SLACK = 0.01
""":func:`synthesize` simulates a candidate only when the list scheduler's own prediction of its
iteration is at most this much above the best simulated so far. The prediction leaves out what
the simulator adds (data-parallel gathers and reduce-scatters, p2p link queueing), so it sits
below the simulated time (Qwen3-Next-80B pp 8 vpp 2: 16-20 ms under 1440 ms): a candidate it
puts 1% above the best cannot win, and skipping it saves a compile, validation and
simulation (0.1-0.5 s on the real presets)."""


TRIES_PER_EVAL = 3
""":func:`synthesize` writes at most this many rank orders per evaluation of its budget (a list
scheduling pass costs 15-70 ms on the real presets; most are never simulated, :data:`PREDICT_SLACK`),
so a small budget (a layout's share under ``template: auto``) bounds the whole search."""


def apply_policy(costs: ModelCosts, plan: Plan, policy: Policy, *, scheduler: Scheduler,
                 avail_bytes: Sequence[float] | None = None, cache: dict | None = None) -> Plan | None:
    """``plan`` (its partition, placement and shape) with the order :func:`list_schedule` writes
    under ``policy`` and the pair orders its new ``FB`` pairs need; ``None`` when the list
    scheduler gets stuck. ``plan``'s own pair orders must belong to its partition (as
    :func:`tessera.plan.refine.with_scheduled_orders` writes them)."""
    plan = replace(plan, schedule=())
    sched, new, _ = list_schedule(costs, plan, policy, scheduler=scheduler, avail_bytes=avail_bytes, cache=cache)
    if not sched:
        return None
    return replace(plan, schedule=sched, pair_orders=plan.pair_orders + new)


def synthesize(costs: ModelCosts, plan: Plan, evaluate: Evaluate, *, scheduler: Scheduler,
               avail_bytes: Sequence[float] | None = None, start_ms: float | None = None,
               max_evals: int = 200, time_budget_s: float = math.inf, cache: dict | None = None,
               policies: Sequence[Policy] | None = None, screen: Evaluate | None = None) -> SynthesisResult:
    """The fastest rank orders for ``plan``'s partition: the template's order, or one the list
    scheduler writes (module docstring), by ``evaluate`` (the simulated iteration, ``inf`` when a
    plan does not fit memory or is invalid).

    Args:
        costs, plan: the cost model and the plan whose partition and placement are kept.
        evaluate: a plan's simulated iteration, ms.
        scheduler: the pair scheduler for ``FB`` pairs the plan has no order for.
        avail_bytes: per rank, bytes its live activations may take (:func:`list_schedule`).
        start_ms: ``evaluate(plan)`` where the caller knows it.
        max_evals: evaluations allowed (the policy grid first, then a per-rank local search on
            the warm-up caps and pair waits of the best policy, first improvement, until a full
            pass finds nothing), and :data:`TRIES_PER_EVAL` rank orders written per evaluation.
        time_budget_s: wall-clock safety cap, s (``SynthesisResult.cap_hit``).
        cache: durations kept across calls with the same costs.
        policies: the policies tried first (default :func:`policy_grid`).
        screen: what ranks the candidates during the search (default ``evaluate``), e.g. the
            same simulation without the Program validator; the winner is then confirmed by
            ``evaluate``, and one it rejects gives way to the best candidate before it.

    Returns:
        :class:`SynthesisResult`; its plan is never slower than ``plan`` under ``evaluate``.
    """
    t0 = time.perf_counter()
    cache = {} if cache is None else cache
    plan = replace(plan, schedule=())
    best_ms = start_ms0 = evaluate(plan) if start_ms is None else start_ms
    best_plan, best_policy, evals, seen, capped, written, tries = plan, None, 0, set(), False, 0, 0
    screen = evaluate if screen is None else screen
    winners: list[tuple[float, Plan, Policy]] = []  # every candidate that was the best when found

    def trial(pol: Policy) -> float:
        nonlocal best_ms, best_plan, best_policy, evals, written, tries
        tries += 1
        sched, new, predicted = list_schedule(costs, plan, pol, scheduler=scheduler, avail_bytes=avail_bytes,
                                              cache=cache)
        if not sched or sched in seen:
            return math.inf
        seen.add(sched)
        written += 1
        if predicted > best_ms * (1 + PREDICT_SLACK):  # its own prediction already loses: not simulated
            return math.inf
        cand = replace(plan, schedule=sched, pair_orders=plan.pair_orders + new)
        ms = screen(cand)
        evals += 1
        if ms < best_ms - 1e-9:
            best_ms, best_plan, best_policy = ms, cand, pol
            winners.append((ms, cand, pol))
        return ms

    def over() -> bool:
        nonlocal capped
        if time.perf_counter() - t0 > time_budget_s:
            capped = True
        return capped or evals >= max_evals or tries >= TRIES_PER_EVAL * max_evals

    for pol in (policy_grid(plan.pp, plan.split_w, plan.overlap) if policies is None else policies):
        if over():
            break
        trial(pol)
    if best_policy is not None:  # per-rank warm-up caps and pair waits around the best policy
        improved = True
        while improved and not over():
            improved = False
            for r, move in product(range(plan.pp), _RANK_MOVES):
                if over():
                    break
                pol = move(best_policy, r, plan.pp)
                if pol is None:
                    continue
                before = best_ms
                trial(pol)
                if best_ms < before - 1e-9:
                    improved = True
    if screen is not evaluate:  # confirm the winner; a rejected one gives way to the one before it
        best_ms, best_plan, best_policy = start_ms0, plan, None
        while winners:
            ms, cand, pol = winners.pop()
            ms = evaluate(cand)
            evals += 1
            if ms < start_ms0 - 1e-9:
                best_ms, best_plan, best_policy = ms, cand, pol
                break
    changes = rank_changes(plan, best_plan.schedule) if best_policy is not None else ()
    return SynthesisResult(best_plan, plan, start_ms0, best_ms, best_policy, evals, time.perf_counter() - t0, changes,
                           capped, max_evals=max_evals, written=written)
