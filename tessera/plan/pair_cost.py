"""Post-overlap cost of one (F chunk, B chunk) pair: the better of running it overlapped (the
pair scheduler's order, compute slowed while communication kernels hold SMs) and running the two
chunks back to back at full speed.

Overlapping pays only where there is communication to hide: communication kernels slow the
compute beside them (``ModelCosts.overlap_slowdown`` while they run,
:func:`tessera.sched.chunkdag.pair_slowdown`), and an order that serialises a chain behind the
other's communication can lose to the back-to-back pair. The engine runs whichever order the plan
stores (``PairOrder.overlapped``).

With measured pair times (``ModelCosts.measured_pairs``, ``planner.cost_source: profile``) a
pair whose chunks were timed co-executed on the workers costs its measured median instead of the
schedule's makespan (the order is still the scheduler's: the one the profile ran).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from tessera.cost.profile_costs import measured_pair_ms
from tessera.cost.types import ModelCosts
from tessera.program.instructions import PairOrder
from tessera.sched.chunkdag import pair_dag, serial_order
from tessera.sched.dag import TaskDAG, TaskSchedule, run_in_order
from tessera.sched.structure import named_order

Scheduler = Callable[[TaskDAG], TaskSchedule]


@dataclass(frozen=True)
class PairChoice:
    """The chosen way to run one pair.

    Attributes:
        makespan_ms: its cost, ms.
        overlapped: ``True``: the overlapped schedule; ``False``: the chunks back to back.
        schedule: the per-task schedule (task ids of ``dag``).
        dag: the pair DAG it schedules (:func:`tessera.sched.chunkdag.pair_dag`; with
            ``slowdown=1.0`` when not overlapped).
        measured: ``makespan_ms`` is the pair's measured time (module docstring), not the
            schedule's makespan.
    """

    makespan_ms: float
    overlapped: bool
    schedule: TaskSchedule
    dag: TaskDAG
    measured: bool = False

    def pair_order(self, f_stage: int, b_stage: int, with_w: bool) -> PairOrder:
        """The PairOrder a Program stores for this choice (tasks named, resources in the
        schedule's order)."""
        return PairOrder(f_stage, b_stage, with_w, named_order(self.dag, self.schedule.order_dict()), self.overlapped)


def best_pair(costs: ModelCosts, f_range: tuple[int, int], b_range: tuple[int, int], with_w: bool,
              scheduler: Scheduler, serial_fallback: bool = True) -> PairChoice:
    """Schedule the pair overlapped with ``scheduler`` and, with ``serial_fallback``, also back to
    back without slowdown; return the cheaper (ties: overlapped)."""
    dag = pair_dag(costs, f_range, b_range, with_w)
    over = scheduler(dag)
    best = PairChoice(over.makespan, True, over, dag)
    if serial_fallback:
        dag = pair_dag(costs, f_range, b_range, with_w, slowdown=1.0)
        ser = run_in_order(dag, serial_order(dag))
        if ser.makespan < best.makespan_ms:
            best = PairChoice(ser.makespan, False, ser, dag)
    ms = measured_pair_ms(costs, f_range, b_range, with_w)
    return best if ms is None else replace(best, makespan_ms=ms, measured=True)
