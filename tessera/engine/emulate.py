"""Emulated devices: cost-model durations for compute, real communication (DBO checks, 2 cores).

An :class:`EmulatedChunk` has the task lists and protocol of
:class:`~tessera.engine.tasks.TorchChunk` (like :class:`~tessera.engine.noop.NoopChunk`), so the
unchanged :class:`~tessera.engine.Engine` runs it from any Program. Each rank has one
:class:`EmulatedDevice` (a :class:`~tessera.engine.hooks.Hooks`, pass it to the engine) holding
the rank's *virtual clock* (``time.monotonic()`` seconds, shared by every process of the host;
:meth:`EmulatedDevice.start_at` gives all ranks one start instant):

* a compute task advances the clock (never reading the host's time) by its ``TaskCost.ms``
  times ``scale`` (wall ms per cost-model ms); an ``expert`` task (F, B or W) by ``ms * n_e / n_mean``, a ``dispatch`` or
  ``combine`` by ``ms * n_max / n_mean`` (``n_e``: this EP rank's tokens of that microbatch and
  MoE layer from a :class:`~tessera.dbo.counts.TokenCounts`; the scaling of
  :mod:`tessera.dbo.predict` and :mod:`tessera.sim.dbo`);
* before every communication the rank sleeps until its clock (absolute targets: sleep
  granularity does not accumulate), so wall time follows the clock where the host keeps up
  (:attr:`EmulatedDevice.lag_ms` says how far it fell behind); :attr:`EmulatedDevice.iteration_ms`
  is the iteration on the clock, free of host overhead;
* every communication is real, over the process groups the engine was built with: the
  pipeline sends carry ``[mbs, seq, 1]`` float64 tensors holding their arrival time (send time
  + ``p2p_ms * scale``), the receiver's clock moves to it; a ``dispatch`` / ``combine`` is an
  asynchronous ``all_to_all_single`` of the issue times over the EP group, complete at
  ``max(issue times) + its duration`` and waited by the first task depending on it (tasks
  issued in between overlap it; one all-to-all at a time per rank), so a rank truly waits for
  its slowest peer. ``reduce_grads`` is the engine's real gradient all-reduce (one float64).

Movable W chosen at an EP slot (``resource == "ep_comm"``) run in the rank's idle time: the
device puts their duration in a background budget that the waits of the next compute
instruction consume; what is left is added at that instruction's end (a low-priority stream
beside the compute stream; the simulator's rule, :mod:`tessera.sim.dbo`). W chosen at a receive
slot, and W at their deadline, run at once. :attr:`EmulatedDevice.slot_idle_ms` records per EP
slot the measured routing idle of its instruction (waits for peers that issued later plus the
transfers' extra length over balanced routing), in cost-model ms, for the prediction error.

Usage, per rank: ``dev = EmulatedDevice(scale, groups.ep, groups.ep_rank, ep, counts)``,
``Engine(program, emulated_chunks(program, costs, dev), groups, slot_policy=..., hooks=[dev])``,
a :class:`~tessera.engine.Batch` of ``[M, 1, 1]`` zeros (only its shape is read); see
``benchmarks/dbo.py`` and ``tests/test_dbo_emulate.py``. With the same costs (data-parallel
costs zeroed), Programs and counts the clock ends where :func:`tessera.sim.dbo.simulate_dbo`
ends, optimizer off and on (``tests/test_dbo_emulate.py``).

A deferred W runs whole or one task at a time (``run_w(mb, key)``, as
:meth:`tessera.engine.tasks.TorchChunk.run_w`: the engine runs a layer-level unit of
:class:`~tessera.engine.dbo_joint.JointDBOPolicy` that way, the rest at its deadline);
:attr:`EmulatedChunk.last_w_log` lists the W tasks of the last iteration in the order they ran.

Not emulated: ``FB`` overlap slowdown, links shared by several sends, data-parallel collective
durations (zero them in the costs for a like-for-like simulator run). A deferred W adds its
tasks' ``deferred_ms`` unscaled (as :func:`tessera.dbo.predict.w_ms`); a fused one does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.cost.types import ModelCosts, TaskKey, TaskKind
from tessera.dbo.counts import TokenCounts
from tessera.engine.hooks import Hooks
from tessera.engine.segments import BackwardRuns, backward_runs

_COMM = (TaskKind.DISPATCH, TaskKind.COMBINE)
_FLUSH = frozenset({"register_w", "W", "recv_act", "recv_grad", "reduce_grads", "optimizer_step"})


@dataclass(frozen=True)
class _Spec:
    hidden: int = 1  # message width: one float64, the arrival time


class _Stub(torch.nn.Module):
    """What the engine reads of a torch chunk: one float64 parameter (message dtype, device and a
    real gradient reduction), ``layers`` (none with experts) and ``model_spec.hidden``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.layers = ()
        self.model_spec = _Spec()


class EmulatedDevice(Hooks):
    """One rank's virtual clock and EP exchange (module doc).

    Args:
        scale: wall ms per cost-model ms (> 0).
        ep_group: the rank's EP process group (None: no EP peers; all-to-alls are local).
        ep_rank, ep: this rank's EP rank and the EP group size (token loads of ``counts``).
        counts: token counts of the iteration (None: balanced routing, every factor 1).

    Raises:
        ValueError: ``scale`` <= 0, ``ep_rank`` outside ``[0, ep)``.
    """

    def __init__(self, scale: float, ep_group=None, ep_rank: int = 0, ep: int = 1,
                 counts: TokenCounts | None = None) -> None:
        if not scale > 0:
            raise ValueError(f"emulation scale={scale} must be > 0 (wall ms per cost-model ms)")
        if not 0 <= ep_rank < ep:
            raise ValueError(f"ep_rank={ep_rank} must be in [0, ep={ep})")
        self.scale, self.ep_group, self.ep_rank, self.ep, self.counts = scale, ep_group, ep_rank, ep, counts
        self._moe = set(counts.layers) if counts is not None else set()
        self.clock = self.start_clock = self.end_clock = time.monotonic()
        self._start: float | None = None
        self.lag_ms = 0.0  # largest lag of the host behind the clock at a sync, cost-model ms
        self.bg_ms = 0.0  # W chosen at an EP slot, not yet run in idle time (cost-model ms)
        self._slot = None
        self._armed = False
        self._comm_free = 0.0
        self._cur: int | None = None
        self.slot_idle_ms: dict[int, float] = {}
        self.bg_hidden_ms = 0.0  # background W time that ran inside waits (cost-model ms)

    # --- clock ---------------------------------------------------------------------------------
    def compute(self, ms: float) -> None:
        """Run ``ms`` cost-model ms of compute (advances the clock; sleeps happen at comm)."""
        self.clock += ms * self.scale / 1e3

    def sync(self) -> None:
        """Sleep until the clock (before any communication); when the host is already past it
        (Python overhead, a loaded machine), note how far in :attr:`lag_ms` (cost-model ms)."""
        d = self.clock - time.monotonic()
        if d > 0:
            time.sleep(d)
        else:
            self.lag_ms = max(self.lag_ms, -d * 1e3 / self.scale)

    def start_at(self, t: float | None) -> None:
        """Start the next iteration's clock at ``t`` (``time.monotonic()`` seconds; the same on
        every rank: no start skew between them); None: at the iteration's start."""
        self._start = t

    @property
    def iteration_ms(self) -> float:
        """The last iteration's length on the clock, cost-model ms (start to end)."""
        return (self.end_clock - self.start_clock) * 1e3 / self.scale

    def idle_until(self, t: float, routing_ms: float = 0.0) -> None:
        """Wait (virtually) until ``t``; the wait consumes background W. ``routing_ms``: the
        part of it due to routing skew (recorded for the current EP slot)."""
        idle = (t - self.clock) * 1e3 / self.scale
        if idle > 0:
            use = min(self.bg_ms, idle)
            self.bg_ms -= use
            self.bg_hidden_ms += use
            self.clock = t
        if self._cur is not None and routing_ms > 0:
            self.slot_idle_ms[self._cur] = self.slot_idle_ms.get(self._cur, 0.0) + routing_ms

    def load(self, mb: int, layer: int) -> tuple[float, float]:
        """(``n_e / n_mean``, ``n_max / n_mean``) of this EP rank for ``mb`` at ``layer``."""
        if layer not in self._moe or self.ep < 2:
            return 1.0, 1.0
        n = self.counts.rank_loads(mb, layer, self.ep)
        mean = sum(n) / self.ep
        return (1.0, 1.0) if mean <= 0 else (n[self.ep_rank] / mean, max(n) / mean)

    def run_w_ms(self, ms: float) -> None:
        """A movable W of ``ms``: in the background at an EP slot, else at once."""
        if self._slot is not None and self._slot.resource == "ep_comm":
            self.bg_ms += ms
        else:
            self.compute(ms)

    def issue(self, dur_ms: float, base_ms: float):
        """Start an all-to-all of ``dur_ms`` (``base_ms`` balanced); returns its handle."""
        self.sync()
        t = torch.full((self.ep,), self.clock, dtype=torch.float64)
        if self.ep_group is None:
            return (None, t, dur_ms, base_ms, self.clock)
        out = torch.empty_like(t)
        work = dist.all_to_all_single(out, t, group=self.ep_group, async_op=True)
        return (work, out, dur_ms, base_ms, self.clock)

    def wait(self, handle) -> None:
        """Wait for an all-to-all started by :meth:`issue`."""
        work, out, dur, base, mine = handle
        if work is not None:
            work.wait()
        last = float(out.max())
        start = max(last, self._comm_free)
        done = start + dur * self.scale / 1e3
        self._comm_free = done
        self.idle_until(done, max(0.0, last - mine) * 1e3 / self.scale + (dur - base))

    # --- hooks ---------------------------------------------------------------------------------
    def _flush(self) -> None:
        if self._armed and self.bg_ms > 0:
            self.compute(self.bg_ms)
            self.bg_ms = 0.0
        self._armed = False

    def iteration_start(self, program) -> None:
        t = time.monotonic() if self._start is None else self._start
        self.clock = self.start_clock = t
        self.bg_ms, self._comm_free, self._armed, self._cur, self.lag_ms = 0.0, 0.0, False, None, 0.0

    def slot(self, index: int, ins) -> None:
        self._flush()
        self._slot = ins
        self._cur = index if ins.resource == "ep_comm" else None

    def step_done(self, record) -> None:
        if record.op == "slot":
            self._slot = None
        elif record.op in ("F", "B", "FB"):
            self._armed = True
        elif record.op in _FLUSH:
            self._flush()
            self._cur = None

    def iteration_end(self, program) -> None:
        self._armed = True
        self._flush()
        self.end_clock = self.clock
        self.sync()


class _Micro:
    __slots__ = ("source", "bsource", "defer", "flight", "waited")

    def __init__(self, source) -> None:
        self.source, self.bsource, self.defer, self.flight, self.waited = source, None, False, {}, False


class EmulatedChunk:
    """One chunk's tasks as cost-model durations on an :class:`EmulatedDevice` (module doc).

    Args:
        costs: the cost model (task lists, ``ms``, ``deps``, ``p2p_ms``).
        start, stop: the chunk's extended layer range (a Program stage's: ``-1`` is the
            embedding, ``len(costs.layers)`` the head).
        device: the rank's device (shared by its chunks).
    """

    comm = False
    model_spec = None

    def __init__(self, costs: ModelCosts, start: int, stop: int, device: EmulatedDevice) -> None:
        self.costs, self.start, self.stop, self.device = costs, start, stop, device
        self.module = _Stub()
        ext = list(range(start, stop))  # extended layer range: -1 the embedding, len(costs.layers) the head
        self._keys = {p: tuple(TaskKey(p, l, t.kind.value) for l in (ext if p == "F" else ext[::-1])
                               for t in costs.layer(l).tasks if t.phase.value == p) for p in "FBW"}
        self._task = {TaskKey(t.phase.value, l, t.kind.value): (i, t) for l in ext
                      for i, t in enumerate(costs.layer(l).tasks)}
        self._ext = ext
        self._dep_cache: dict[TaskKey, list[TaskKey]] = {}
        self._micro: dict[int, _Micro] = {}
        self._w_left: dict[int, set[TaskKey]] = {}  # mb -> its deferred W task keys not yet run
        self.w_log: list[tuple[int, TaskKey]] = []  # (mb, W task) in the order they ran (deferred W only)
        self.last_w_log: list[tuple[int, TaskKey]] = []  # the last finished iteration's w_log
        self._last = {"F": self._keys["F"][-1], "B": self._keys["B"][-1]}

    # --- protocol ------------------------------------------------------------------------------
    def task_keys(self, phase: str) -> tuple[TaskKey, ...]:
        return self._keys[phase]

    def runs_for(self, order, breaks_before) -> BackwardRuns:
        return backward_runs(tuple(order), tuple(breaks_before), False)

    def lone_runs(self) -> BackwardRuns:
        return self.runs_for(self._keys["B"], [False] * len(self._keys["B"]))

    def fuses(self, mb) -> bool:  # every task is its own step (TorchChunk.fuses)
        return False

    def begin_forward(self, mb, source, labels, runs=None, defer_w=None) -> None:
        self._micro[mb] = _Micro(source)

    def begin_backward(self, mb, source, defer_w) -> None:
        m = self._micro[mb]
        m.bsource, m.defer, m.waited = source, defer_w, False
        if defer_w:
            self._w_left[mb] = set(self._keys["W"])

    def output_ready(self, mb) -> bool:
        return True

    def _arrive(self, lazy) -> None:
        t = float(lazy.get().reshape(-1)[0])
        self.device.idle_until(t)

    def _deps(self, key: TaskKey) -> list[TaskKey]:
        deps = self._dep_cache.get(key)
        if deps is None:
            deps = self._dep_cache[key] = self._find_deps(key)
        return deps

    def _find_deps(self, key: TaskKey) -> list[TaskKey]:
        i, t = self._task[key]
        layer = self.costs.layer(key.layer)
        same = [TaskKey(key.phase, key.layer, layer.tasks[d].kind.value) for d in t.deps
                if layer.tasks[d].phase == t.phase]
        if same:
            return same
        pos = self._ext.index(key.layer)
        prev = pos - 1 if key.phase == "F" else pos + 1
        if not 0 <= prev < len(self._ext):
            return []
        pl = self.costs.layer(self._ext[prev])
        idx = pl.phase_tasks(t.phase)
        used = {d for j in idx for d in pl.tasks[j].deps}
        return [TaskKey(key.phase, pl.index, pl.tasks[j].kind.value) for j in idx if j not in used]

    def run(self, key: TaskKey, mb: int) -> None:
        m, dev = self._micro[mb], self.device
        if key.phase == "F" and key == self._keys["F"][0] and self.start != -1 and m.source is not None:
            self._arrive(m.source)
        if key.phase == "B" and not m.waited:
            m.waited = True
            if m.bsource is not None:
                self._arrive(m.bsource)
        for d in self._deps(key):
            h = m.flight.pop((d.phase, d.layer, d.kind), None)
            if h is not None:
                dev.wait(h)
        _, t = self._task[key]
        own, mx = dev.load(mb, key.layer)
        if t.kind in _COMM:
            m.flight[(key.phase, key.layer, key.kind)] = dev.issue(t.ms * mx, t.ms)
        else:
            dev.compute(t.ms * (own if t.kind == TaskKind.EXPERT else 1.0))
        if key == self._last["B"] and key.phase == "B" and not m.defer:
            dev.compute(self._w_ms(mb, deferred=False))

    def _drain(self, mb: int) -> None:
        m = self._micro[mb]
        for h in list(m.flight.values()):
            self.device.wait(h)
        m.flight.clear()

    def _stamp(self, mb: int) -> torch.Tensor:
        self._drain(mb)
        self.device.sync()
        return torch.full((1, 1, 1), self.device.clock + self.costs.p2p_ms * self.device.scale / 1e3,
                          dtype=torch.float64)

    def output(self, mb):
        return self._stamp(mb)

    def pop_input_grad(self, mb):
        return self._stamp(mb)

    def loss(self, mb):
        return None

    def _w_ms(self, mb: int, deferred: bool = True, keys=None) -> float:
        total = 0.0
        for key in self._keys["W"] if keys is None else keys:
            _, t = self._task[key]
            total += t.ms * (self.device.load(mb, key.layer)[0] if t.kind == TaskKind.EXPERT else 1.0)
            total += t.deferred_ms if deferred else 0.0
        return total

    def w_ms(self, mb: int) -> float:
        """This chunk's W of ``mb`` on this EP rank, cost-model ms (as
        :func:`tessera.dbo.predict.w_ms`)."""
        return self._w_ms(mb)

    def w_pending(self, mb) -> bool:
        return mb in self._w_left

    def run_w(self, mb, key=None) -> int:
        """Run ``mb``'s deferred W task ``key`` (None: all that are left, in task order) on the
        device (:meth:`EmulatedDevice.run_w_ms`); returns how many tasks ran."""
        left = self._w_left.get(mb)
        if left is None or key is not None and key not in left:
            return 0
        keys = [k for k in self._keys["W"] if k in left] if key is None else [key]
        left.difference_update(keys)
        if not left:
            del self._w_left[mb]
        self.w_log += [(mb, k) for k in keys]
        self.device.run_w_ms(self._w_ms(mb, keys=keys))
        return len(keys)

    def end_iteration(self) -> dict:
        for mb in list(self._micro):
            self._drain(mb)
        self._micro.clear()
        self._w_left.clear()
        if self.w_log:
            self.last_w_log, self.w_log = self.w_log, []
        return {}

    def parameters(self):
        return self.module.parameters()


def emulated_chunks(program, costs: ModelCosts, device: EmulatedDevice) -> list[EmulatedChunk]:
    """One :class:`EmulatedChunk` per local chunk of ``program`` (chunk order)."""
    return [EmulatedChunk(costs, s.start, s.stop, device) for s in sorted(program.stages, key=lambda s: s.chunk)]


__all__ = ["EmulatedChunk", "EmulatedDevice", "emulated_chunks"]


def timed_iteration(engine, device: EmulatedDevice, batch, lead_s: float) -> tuple[float, float]:
    """Run one iteration of ``engine`` (hooked to ``device``) on every rank from one start instant:
    after a barrier, the ranks agree on the latest of their ``time.monotonic() + lead_s``
    (an all-reduce MAX over the default group), start their clocks there
    (:meth:`EmulatedDevice.start_at`), sleep until it, run the iteration and meet at a barrier.

    Returns:
        (wall ms from the common start to the closing barrier, the iteration on the emulated
        clock in cost-model ms: :attr:`EmulatedDevice.iteration_ms`).
    """
    dist.barrier()
    t = torch.tensor([time.monotonic() + lead_s], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    start = float(t)
    device.start_at(start)
    time.sleep(max(0.0, start - time.monotonic()))
    engine.run_iteration(batch)
    dist.barrier()
    return (time.monotonic() - start) * 1e3, device.iteration_ms
