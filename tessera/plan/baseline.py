"""The baseline: a serial-balanced partition and the template's fixed overlap order.

This is what a conventional PP framework does: cut the layers into contiguous virtual stages so
that the largest per-stage *serial* time (F + B + W of one microbatch, ignoring overlap) is as
small as possible, then run the template's fixed F&B overlap order. Tessera's planner starts its
candidate search from this partition and must beat this plan.
"""

from __future__ import annotations

from tessera.cost.types import ModelCosts
from tessera.errors import TesseraConfigError
from tessera.program.plan import Partition, Plan
from tessera.program.templates import check_shape

_REL_TOL = 1e-9


def _stage_items(costs: ModelCosts) -> list[float]:
    """Serial time of each decoder layer, with the embedding folded into layer 0 and the head into
    the last layer (they always share a stage with them)."""
    n = len(costs.layers)
    items = [costs.serial_ms(i) for i in range(n)]
    items[0] += costs.serial_ms(-1)
    items[-1] += costs.serial_ms(n)
    return items


def _min_max_cost(prefix: list[float], num_stages: int) -> float:
    """Smallest achievable maximum stage cost (exact DP over cut positions)."""
    n = len(prefix) - 1
    inf = float("inf")
    best = [inf] * (n + 1)  # best[j]: k stages over items [0, j)
    for j in range(1, n - num_stages + 2):
        best[j] = prefix[j]
    for k in range(2, num_stages + 1):
        new = [inf] * (n + 1)
        for j in range(k, n - num_stages + k + 1):
            cur = inf
            for i in range(j - 1, k - 2, -1):  # last stage = items [i, j); cost grows as i falls
                seg = prefix[j] - prefix[i]
                if seg >= cur:
                    break
                v = best[i] if best[i] > seg else seg
                if v < cur:
                    cur = v
            new[j] = cur
        best = new
    return best[n]


def _min_sum_squares_cuts(prefix: list[float], num_stages: int, cap: float) -> list[int]:
    """Cut positions minimising the sum of squared stage costs subject to every stage <= cap
    (the tie-break among min-max partitions: spread the slack evenly)."""
    n = len(prefix) - 1
    inf = float("inf")
    cost = [inf] * (n + 1)
    for j in range(1, n - num_stages + 2):
        if prefix[j] <= cap:
            cost[j] = prefix[j] ** 2
    back: list[list[int]] = [[0] * (n + 1)]
    for k in range(2, num_stages + 1):
        new, arg = [inf] * (n + 1), [-1] * (n + 1)
        for j in range(k, n - num_stages + k + 1):
            for i in range(j - 1, k - 2, -1):
                seg = prefix[j] - prefix[i]
                if seg > cap:
                    break
                v = cost[i] + seg * seg
                if v < new[j]:
                    new[j], arg[j] = v, i
        cost = new
        back.append(arg)
    cuts, j = [], n
    for k in range(num_stages - 1, 0, -1):
        j = back[k][j]
        cuts.append(j)
    return cuts[::-1]


def serial_balanced_partition(costs: ModelCosts, num_stages: int) -> Partition:
    """Contiguous partition into ``num_stages`` virtual stages minimising the largest per-stage
    serial time ``sum(costs.serial_ms(i))`` over the stage's extended layers.

    Every stage gets at least one decoder layer, the embedding goes to stage 0 and the head to the
    last stage; layer counts may be uneven (30 layers on 4 stages: 8, 8, 7, 7 in some order) and no
    layer is ever dropped. The minimum is exact (dynamic programming); among the optimal
    partitions the one with the smallest sum of squared stage times is returned (remaining ties:
    earlier stages take the larger share), so the slack is spread rather than piled on one stage.

    Raises:
        TesseraConfigError: ``num_stages`` < 1 or more stages than decoder layers.
    """
    n = len(costs.layers)
    if not isinstance(num_stages, int) or num_stages < 1 or num_stages > n:
        raise TesseraConfigError("pp*vpp", num_stages, f"each virtual stage needs at least one layer; the model has "
                                 f"{n} layers", f"use between 1 and {n} virtual stages")
    prefix = [0.0]
    for x in _stage_items(costs):
        prefix.append(prefix[-1] + x)
    best = _min_max_cost(prefix, num_stages)
    cap = best + _REL_TOL * max(abs(best), 1.0)
    cuts = _min_sum_squares_cuts(prefix, num_stages, cap)
    return Partition((-1, *cuts, n + 1))


def alone_partition(costs: ModelCosts, num_stages: int, *, embedding: bool = False, head: bool = True) -> Partition:
    """The serial-balanced partition with the embedding and/or the head on a stage of its own:
    stage 0 is ``[-1, 0)`` (``embedding``) and the last stage ``[L, L+1)`` (``head``), the decoder
    layers (with the embedding or head not placed alone) balanced over the other stages as
    :func:`serial_balanced_partition` balances them (min-max serial time, then the least sum of
    squares). A start of the planner's iteration search (:func:`tessera.plan.planner.make_plan`).

    Raises:
        TesseraConfigError: fewer decoder layers than the stages left for them.
    """
    n, k = len(costs.layers), num_stages - int(embedding) - int(head)
    if k < 1 or k > n:
        raise TesseraConfigError("pp*vpp", num_stages, f"with the embedding{' and' if embedding and head else ''}"
                                 f"{' head' if head else ''} alone, {k} stages remain for {n} decoder layers",
                                 f"use between {1 + int(embedding) + int(head)} and {n + int(embedding) + int(head)} "
                                 "virtual stages")
    items = [costs.serial_ms(i) for i in range(n)]
    if not embedding:
        items[0] += costs.serial_ms(-1)
    if not head:
        items[-1] += costs.serial_ms(n)
    prefix = [0.0]
    for x in items:
        prefix.append(prefix[-1] + x)
    best = _min_max_cost(prefix, k)
    cuts = _min_sum_squares_cuts(prefix, k, best + _REL_TOL * max(abs(best), 1.0))
    return Partition((-1, *((0,) if embedding else ()), *cuts, *((n,) if head else ()), n + 1))


def stage_serial_ms(costs: ModelCosts, partition: Partition) -> tuple[float, ...]:
    """Serial F+B+W time (ms, one microbatch) of each stage of ``partition``."""
    return tuple(sum(costs.serial_ms(i) for i in range(*partition.stage_range(s)))
                 for s in range(partition.num_stages))


def baseline_plan(costs: ModelCosts, template: str, pp: int, vpp: int, num_microbatches: int,
                  overlap: bool = True, split_w: bool = True) -> Plan:
    """The baseline Plan: :func:`serial_balanced_partition` over ``pp*vpp`` stages, the template's
    fixed overlap order (no ``pair_orders``), name ``"baseline"``.

    Raises:
        TesseraConfigError: the shape does not fit the template or the model (see
            :func:`tessera.program.templates.check_shape`).
    """
    check_shape(template, pp, vpp, num_microbatches, len(costs.layers))
    partition = serial_balanced_partition(costs, pp * vpp)
    return Plan(name="baseline", template=template, pp=pp, vpp=vpp, num_microbatches=num_microbatches,
                partition=partition, overlap=overlap, split_w=split_w)
