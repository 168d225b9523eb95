"""The optimizer's choice at a slot and at registration: one rule for the engine and the simulator.

:func:`choose` fills a slot greedily. Running the W of (chunk, mb) first runs every pending W of
that chunk with a smaller microbatch (each parameter accumulates its gradient in microbatch
order, so results are bitwise the same whatever runs where), so the candidates are these
*chains*, and only chains whose every earlier microbatch is registered or done (``eligible``).
Repeatedly, among the chains that fit the time left, it takes the best fit (the longest), then
the earliest deadline, then the lowest (chunk, mb); it stops when none fits. Zero-length slots
and zero-length tasks are never filled (nothing to gain).

:func:`over_cap` is the pool's memory rule (``dbo.pool_mem_gb``): a task whose registration
would make the pending tasks hold more than the cap runs at once instead of waiting.

A task still pending at its deadline (its ``W`` instruction) runs there, in the main stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Mapping

Task = tuple[int, int]  # (chunk, mb)


@dataclass(frozen=True)
class SlotChoice:
    """What the optimizer did at one slot (the per-slot log).

    rank, ep_rank: where; index: the slot's instruction index; cause: the slot's cause;
    idle_ms: predicted idle time; usable_ms: ``idle / (1 + margin)``; tasks: the (chunk, mb)
    chosen, in run order (layer-level units, :mod:`tessera.dbo.joint`: (chunk, mb, layer,
    task kinds)); filled_ms: their predicted total duration."""

    rank: int
    ep_rank: int
    index: int
    cause: str
    idle_ms: float
    usable_ms: float
    tasks: tuple[tuple, ...]
    filled_ms: float


def choose(pending: Collection[Task], eligible: Callable[[Task], bool], ms: Mapping[Task, float],
           deadline: Mapping[Task, int], budget_ms: float) -> tuple[Task, ...]:
    """The tasks to run in a slot of ``budget_ms`` (usable length), in run order (module doc).

    Args:
        pending: registered, not yet run tasks.
        eligible: whether a pending task may start a chain (earlier microbatches of its chunk
            registered or done).
        ms: predicted duration of each pending task, ms.
        deadline: each pending task's deadline (instruction index of its ``W``).
        budget_ms: usable slot length, ms.

    Raises:
        KeyError: a pending task without a duration or deadline.
    """
    left = set(pending)
    out: list[Task] = []
    budget = budget_ms
    while budget > 0:
        best = None
        for t in sorted(left):
            if not eligible(t):
                continue
            chain = tuple(u for u in sorted(left) if u[0] == t[0] and u[1] <= t[1])
            d = sum(ms[u] for u in chain)
            if not 0 < d <= budget:
                continue
            key = (-d, min(deadline[u] for u in chain), t)
            if best is None or key < best[0]:
                best = (key, chain, d)
        if best is None:
            break
        _, chain, d = best
        out += chain
        left -= set(chain)
        budget -= d
    return tuple(out)


def over_cap(held_bytes: float, task_bytes: float, cap_bytes: float) -> bool:
    """Whether registering a task of ``task_bytes`` while the pool holds ``held_bytes`` would
    exceed ``cap_bytes`` (then it runs at once)."""
    return held_bytes + task_bytes > cap_bytes


def fill_rate(filled_ms: float, annotated_ms: float) -> float:
    """Bubble fill rate: filled slot time / annotated slot time (0 without annotated time)."""
    return filled_ms / annotated_ms if annotated_ms > 0 else 0.0
