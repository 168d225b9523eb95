"""The execution engine: interprets one rank's Program on torch, plan-agnostic.

The engine reads only ``Program.instructions``, ``stages`` and ``pair_orders`` (never the template
or plan name). It is a small state machine: :meth:`Engine.begin` starts an iteration,
:meth:`Engine.advance` runs to the next *task boundary* and returns what ran, and the iteration
ends after ``optimizer_step``. Each instruction expands, when reached, into steps:

Each Op has a handler method (:attr:`Engine.HANDLERS`, ``Op -> method name``, bound once per
engine) that returns the instruction's steps:

* ``F`` / ``B``: one step per task of the chunk (:meth:`TorchChunk.task_keys`); ``B`` with
  ``with_w=False`` records weight gradients for a later W; consecutive B tasks of a microbatch
  run as one autograd segment (:mod:`tessera.engine.segments`, computed once per engine);
* ``FB``: the tasks of both microbatches in the single-thread order of the pair order
  (:mod:`tessera.engine.pairs`); the pair's task structure comes from the model spec alone
  (:func:`tessera.sched.structure.pair_structure`) and the order names its tasks, so the engine
  needs no cost model;
* ``W``: the pending W of (mb, chunk) with its :meth:`MovablePool.due` predecessors, one step;
* ``register_w``: :meth:`register_task`; ``slot``: the slot policy may run movable tasks;
* ``recv_*``: post the receive (waited by the first task using it); ``send_*``: ``isend``, posted
  by the instruction producing the data right after its side's last task when only
  non-compute instructions lie between them (early sends, also inside ``FB`` pairs);
* ``reduce_grads``: sum over the dense / expert data-parallel groups, scale by
  ``1 / (num_microbatches * dp)`` once; ``optimizer_step``: step, zero grads, wait for sends.

Activations and gradients between two stages on the same rank are handed over locally. Times come from
:attr:`Engine.timer` (:mod:`tessera.engine.timing`: CUDA events on a GPU, resolved once per iteration, else
host time); on a GPU all-to-alls and p2p are issued from two side streams (:mod:`tessera.model.streams`).
``PipeComm`` posts the rank's sends and receives in the Program's p2p order, each batch one
``batch_isend_irecv`` on the pipeline group, receives as soon as every earlier batch is posted
(:mod:`tessera.engine.p2p`). :meth:`advance`
calls the :mod:`hooks <tessera.engine.hooks>` at iteration start and end, each slot and step.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Callable, ClassVar, Mapping, Sequence

import torch
import torch.distributed as dist

from tessera.engine.groups import CommTimeout, RankGroups, agree_shape, comm_timeout, reduce_gradients
from tessera.engine.hooks import Hooks, as_hooks
from tessera.engine.p2p import ACT, GRAD, MessageShape, PipeComm, program_order
from tessera.engine.tables import build_pairs, build_runs, check_fit, deferred_w, early_sends, split_params
from tessera.engine.pool import MovablePool, MovableTask, MovableUnit, SlotPolicy
from tessera.engine.steps import Step as _Step, bind as _bind, lone_steps
from tessera.engine.tasks import Lazy, TorchChunk
from tessera.engine.timing import SpanLog, SpanTotal, first_device, make_timer
from tessera.engine.values import Batch, EngineError, IterationResult, StepRecord
from tessera.model import gating
from tessera.model.hostsync import HostSyncs
from tessera.model.streams import CommStream
from tessera.program.instructions import COMM_OPS, Instr, Op, Program


class Engine:
    """Runs ``program`` on this rank's chunks.

    Args:
        program: this rank's Program (``program.rank`` = pipeline rank).
        chunks: per local chunk a :class:`~tessera.model.StageModule` (built with ``groups.ep``
            as EP group) or a chunk executor (:class:`TorchChunk`, :class:`NoopChunk`).
        groups: the rank's process groups (None: single process, ``pp == 1``, no EP / DP).
        optimizer: stepped at ``optimizer_step`` (None: grads are left in place).
        task_costs: where ``FB`` pairs get their task structure when the chunks are not torch
            modules: a :class:`~tessera.sched.structure.ModelStructure`, or any ModelCosts of
            the model (only its task lists are read). Default: the chunks' model spec
            (:meth:`ModelStructure.of_specs`).
        slot_policy: fills ``slot`` instructions from the movable pool (None: W at deadlines).
        ordered_reduce: gradient sums in replica order for groups of more than two ranks.
        check_shapes: agree the batch shape over the pipeline at each iteration start.
        profile: keep a :class:`StepRecord` per step and per-task times in the chunks
            (``TorchChunk.timings``); receives are waited at their instruction.
        eager_comm: wait for every all-to-all inside its task (profiling without overlap).
        max_pending_w: cap on registered, not yet run W tasks (None: no cap).
        hooks: a :class:`~tessera.engine.hooks.Hooks` or a list of them, called by
            :meth:`advance` (None: no-op).

    A failed step leaves the iteration unusable; :meth:`begin` starts over, which is safe after
    a batch or shape error (raised before any communication) but not after a failure in the
    middle of communication (messages may still be in flight: restart the process group).

    Raises:
        EngineError: the chunks or groups do not fit the Program, or an ``FB`` pair order names
            tasks the chunks do not have.
    """

    HANDLERS: ClassVar[Mapping[Op, str]] = MappingProxyType({
        Op.F: "_do_f", Op.B: "_do_b", Op.FB: "_do_fb", Op.W: "_do_w", Op.REGISTER_W: "_do_register_w",
        Op.SLOT: "_do_slot", Op.RECV_ACT: "_do_recv", Op.RECV_GRAD: "_do_recv", Op.SEND_ACT: "_do_send_act",
        Op.SEND_GRAD: "_do_send_grad", Op.REDUCE_GRADS: "_do_reduce", Op.OPTIMIZER_STEP: "_do_optimizer_step"})

    def __init__(self, program: Program, chunks: Sequence, groups: RankGroups | None = None, optimizer=None, *,
                 task_costs=None, slot_policy: SlotPolicy | None = None,
                 ordered_reduce: bool = False, check_shapes: bool = True, profile: bool = False,
                 eager_comm: bool = False, max_pending_w: int | None = None,
                 hooks: Hooks | Sequence[Hooks] | None = None) -> None:
        self.program, self.groups, self.optimizer = program, groups, optimizer
        self.slot_policy = slot_policy
        self.hooks = as_hooks(hooks)
        self._handlers: dict[Op, Callable[[Instr], list[_Step]]] = {op: getattr(self, m)
                                                                     for op, m in self.HANDLERS.items()}
        self.ordered_reduce, self.check_shapes, self.profile = ordered_reduce, check_shapes, profile
        ep_group = groups.ep if groups is not None else None
        counts_group = groups.ep_counts if groups is not None and groups.ep_counts is not None else ep_group
        self._device = first_device(chunks)
        self.timer = make_timer(self._device)  # CUDA events on a GPU, else host time
        a2a, p2p = CommStream(self._device), CommStream(self._device)  # side streams on a GPU, else none
        self.host_syncs = HostSyncs()  # host synchronisations of the iteration (IterationResult.host_syncs)
        self.chunks = tuple(TorchChunk(c, ep_group, eager_comm, profile, self.timer, a2a, counts_group, self.host_syncs)
                            if isinstance(c, torch.nn.Module) else c for c in chunks)
        check_fit(program, self.chunks, groups)
        stage_of = {s.chunk: s.stage for s in program.stages}
        self._stage = tuple(stage_of[c] for c in range(program.vpp))
        self._local = {s: c for c, s in enumerate(self._stage)}
        self.pool = MovablePool(max_pending_w)
        self._dp = groups.layout.dp if groups is not None else 1
        if groups is not None and groups.pipeline is not None and not program.p2p_batches \
                and dist.get_backend(groups.pipeline) == "nccl" and any(i.op in COMM_OPS for i in program.instructions):
            raise EngineError(f"rank {program.rank}: the Program has no p2p batches (it was not compiled by "
                              "tessera.program.compiler.compile_plan); NCCL needs both ends of a link to post one "
                              "agreed order: compile the plan, or run on gloo")
        self._comm = PipeComm(groups.peer, program.num_stages, program.num_microbatches, program_order(program),
                              groups.pipeline, self.timer, p2p) if groups else None
        self._pairs = build_pairs(program, self.chunks, self._stage_of, task_costs)
        self._b_runs = build_runs(program, self.chunks, self._pairs)
        self._defer_w = deferred_w(program)  # (chunk, mb) -> its backward defers W (the forward's fast path)
        self._early, self._early_sends = early_sends(program.instructions)
        self._deferred: list[tuple[int, Instr]] = []  # early sends waiting for their data (an all-to-all)
        self._dense, self._experts = split_params(self.chunks)
        self._routers = gating.sigmoid_routers(m for m in (getattr(c, "module", None) for c in self.chunks) if m is not None)
        self._batch: Batch | None = None
        self._pc = 0
        self._queue: list[_Step] = []
        self._step_cache: dict[int, list[_Step]] = {}  # compute instruction index -> its steps (_cached)
        self._arrived: dict[tuple[str, int, int], torch.Tensor] = {}
        self._records = SpanLog(self.timer)  # (StepRecord, ms) of the iteration's steps when profiling
        self._losses: dict[int, torch.Tensor] = {}
        self._t0 = self.timer.mark()
        self._slot_ms = SpanTotal(self.timer)  # time running W moved into slots this iteration (IterationResult.slot_ms)
        self._index, self._ins = -1, None
        self._fresh = False

    # --- construction ---------------------------------------------------------------------------
    def _stage_of(self, chunk: int) -> int:
        return next(s.stage for s in self.program.stages if s.chunk == chunk)

    # --- public API ----------------------------------------------------------------------------
    @property
    def sends_posted(self) -> int:
        """Point-to-point sends (``isend``) posted so far in this iteration (0 without groups)."""
        return self._comm.sends_posted if self._comm is not None else 0

    @property
    def idle_ms(self) -> float:
        """Time blocked waiting for pipeline receives so far in this iteration, ms (timed around each wait,
        wherever the data is first used; 0 without groups; CUDA: the compute stream's wait, read with a sync)."""
        return self._comm.wait_ms if self._comm is not None else 0.0

    @property
    def slot_ms(self) -> float:
        """Time spent in ``slot`` steps so far in this iteration, ms (on CUDA reading it synchronizes)."""
        return self._slot_ms.ms

    def register_task(self, task: MovableTask) -> None:
        """Hand a movable task (a deferred W) to the pool; a slot policy with ``on_register``
        (the DBO's memory cap) may have it, and its earlier microbatches, run at once."""
        self.pool.register(task)
        for t in getattr(self.slot_policy, "on_register", lambda *_: ())(task, self.pool):
            self._run_w(t, deadline=False)

    def begin(self, batch: Batch) -> None:
        """Start an iteration on ``batch`` (resets what a failed iteration left behind).

        Raises:
            EngineError: the batch has the wrong number of microbatches, or (``check_shapes``)
                another pipeline rank got a batch of another shape.
        """
        p = self.program
        m, mbs, seq = batch.input_ids.shape
        if m != p.num_microbatches:
            raise EngineError(f"rank {p.rank}: batch has {m} microbatches, the Program runs {p.num_microbatches}")
        for c in self.chunks:
            c.end_iteration()
        self.pool.reset()
        self._batch, self._pc, self._queue = batch, 0, []
        self._arrived.clear()
        self._deferred = []
        self._records.clear()
        self._losses = {}
        self._slot_ms.reset()
        self.host_syncs.reset()
        gating.reset_expert_load(self._routers)
        for c in self.chunks:
            if isinstance(c, TorchChunk):
                c.a2a_wait.reset()
        self._fresh = True
        if self._comm is not None:
            ref = next(iter(self._dense + self._experts), None)
            if ref is None:
                raise EngineError("pipeline communication needs torch chunks (parameters give dtype and device)")
            if self.check_shapes:
                agree_shape(self.groups, mbs, seq, ref.device)
            hidden = self.chunks[0].module.model_spec.hidden
            self._comm.begin(MessageShape((mbs, seq, hidden), ref.dtype, ref.device))
        self._t0 = self.timer.mark()

    def advance(self) -> StepRecord | None:
        """Run to the next task boundary; returns what ran, or None when the iteration is over.

        Raises:
            EngineError: the Program cannot run as given (the message names rank and instruction).
            CommTimeout: a wait outlived its group's timeout (gloo; one line: rank, instruction,
                what waited, on which group of which ranks, after how long; the group's error is
                its ``__cause__``).
        """
        if self._batch is None:
            raise EngineError("advance() before begin(batch)")
        if self._fresh:
            self._fresh = False
            self.hooks.iteration_start(self.program)
        while not self._queue:
            if self._pc >= len(self.program.instructions):
                self._batch = None
                self.hooks.iteration_end(self.program)
                return None
            index, ins = self._pc, self.program.instructions[self._pc]
            self._pc += 1
            try:
                steps = self._expand(ins)
            except EngineError as e:
                raise EngineError(f"rank {self.program.rank}, instruction {index} {ins}: {e}") from None
            self._queue = list(reversed(steps))
            self._index, self._ins = index, ins
            if ins.op == Op.SLOT:
                self.hooks.slot(index, ins)
        step = self._queue.pop()
        # CUDA events only where a time is kept (profiling, slots): elsewhere the live record's ms
        # is NaN anyway on a GPU (known only after the iteration's synchronize)
        timed = self.profile or not self.timer.device_time
        t0 = self.timer.mark() if timed else None
        try:
            step.fn()
        except CommTimeout:
            raise
        except EngineError as e:
            raise EngineError(f"rank {self.program.rank}, instruction {self._index} {self._ins}: {e}") from None
        except Exception as e:
            what = comm_timeout(e, self.groups)  # a wait outlived its group's timeout: one line (groups.py)
            if what is not None:
                rank = self.program.rank if self.groups is None else self.groups.rank
                raise CommTimeout(f"rank {rank}, instruction {self._index} {self._ins}: {what}") from e
            e.add_note(f"in tessera engine: rank {self.program.rank}, instruction {self._index} {self._ins}, "
                       f"task {step.name}")
            raise
        if self._deferred:
            self._post_deferred(False)
        t1 = self.timer.mark() if timed else None  # CUDA: the live record's ms is NaN, known at the iteration's end
        rec = StepRecord(self._index if step.index is None else step.index, self._ins.op.value if step.op is None
                         else step.op, step.name, step.mb, step.chunk,
                         self.timer.known_ms(t0, t1) if timed else float("nan"))
        if self.profile:
            self._records.add(rec, t0, t1)
        self.hooks.step_done(rec)
        return rec

    def run_iteration(self, batch: Batch) -> IterationResult:
        """:meth:`begin`, then :meth:`advance` until the Program ends."""
        self.begin(batch)
        steps = 0
        while self.advance() is not None:
            steps += 1
        return self._result(steps)

    # --- iteration internals -------------------------------------------------------------------
    def _result(self, steps: int) -> IterationResult:
        end = self.timer.mark()
        losses = self._losses
        loss = float(torch.stack([losses[mb] for mb in sorted(losses)]).mean()) if losses else None
        comm = [c for c in self.chunks if isinstance(c, TorchChunk) and c.comm]
        a2a = sum(c.a2a_wait.ms for c in comm) if comm else None
        return IterationResult(loss, steps, self.timer.ms(self._t0, end),  # CUDA: the iteration's one synchronize
                               tuple(replace(r, ms=ms) for r, ms in self._records), self.idle_ms, self.slot_ms, a2a,
                               self.host_syncs.count)

    def _recv_key(self, ins: Instr) -> tuple[str, int, int]:
        s = self._stage[ins.chunk]
        return (ACT, ins.mb, s - 1) if ins.op == Op.RECV_ACT else (GRAD, ins.mb, s + 1)

    def _post(self, ins: Instr, flush: bool = True) -> None:
        kind, mb, sender = self._recv_key(ins)
        self._comm.post_recv(kind, mb, sender, ins.peer, flush)

    def _received(self, key: tuple[str, int, int]) -> torch.Tensor:
        if key in self._arrived:
            return self._arrived.pop(key)
        if self._deferred and self._comm.blocked_by(*key) is not None:
            self._post_deferred(True)  # the receive is queued behind a send waiting for its all-to-all
        return self._comm.wait_recv(*key)

    def _f_source(self, mb: int, chunk: int) -> Lazy:
        s = self._stage[chunk]
        if s == 0:
            return Lazy(lambda: self._batch.input_ids[mb].to(self._device, non_blocking=True))
        if s - 1 in self._local:
            prev = self.chunks[self._local[s - 1]]
            return Lazy(lambda: prev.output(mb))
        if self._comm is None:
            raise EngineError(f"F(mb{mb}.c{chunk}): stage {s - 1} is on another rank and there are no groups")
        return Lazy(lambda: self._received((ACT, mb, s - 1)))

    def _b_source(self, mb: int, chunk: int) -> Lazy | None:
        s = self._stage[chunk]
        if s == self.program.num_stages - 1:
            return None
        if s + 1 in self._local:
            nxt = self.chunks[self._local[s + 1]]
            return Lazy(lambda: nxt.pop_input_grad(mb))
        if self._comm is None:
            raise EngineError(f"B(mb{mb}.c{chunk}): stage {s + 1} is on another rank and there are no groups")
        return Lazy(lambda: self._received((GRAD, mb, s + 1)))

    def _labels(self, chunk: int, mb: int):
        if self._stage[chunk] != self.program.num_stages - 1:
            return None
        return self._batch.labels[mb].to(self._device, non_blocking=True)

    def _expand(self, ins: Instr) -> list[_Step]:
        handler = self._handlers.get(ins.op)
        if handler is None:
            raise EngineError(f"unknown instruction {ins}")
        return handler(ins)

    # --- instruction handlers (HANDLERS): Instr -> its steps -----------------------------------
    def _do_f(self, ins: Instr) -> list[_Step]:
        mb, c = ins.mb, ins.chunk
        ch = self.chunks[c]
        ch.begin_forward(mb, self._f_source(mb, c), self._labels(c, mb), self._b_runs.get((c, mb)),
                         self._defer_w.get((c, mb)))
        return self._cached(lambda: lone_steps(ins, ch, "F") + self._send_steps(0))

    def _do_b(self, ins: Instr) -> list[_Step]:
        mb, c = ins.mb, ins.chunk
        ch = self.chunks[c]
        ch.begin_backward(mb, self._b_source(mb, c), defer_w=not ins.with_w)
        return self._cached(lambda: lone_steps(ins, ch, "B") + self._send_steps(1))

    def _cached(self, build: Callable[[], list[_Step]]) -> list[_Step]:
        """The steps of the current compute instruction, built on its first expansion: they
        depend only on the Program and the chunks (bound methods, task keys, early sends), so
        later iterations reuse them (no per-task names, closures or step objects per step)."""
        index = self._pc - 1
        steps = self._step_cache.get(index)
        if steps is None:
            steps = self._step_cache[index] = build()
        return steps

    def _send_steps(self, side: int) -> list[_Step]:
        """The early send of the current instruction's ``side`` (0: its forward's activation,
        1: its backward's input gradient), as a step carrying the send instruction's index."""
        early = self._early.get(self._pc - 1)
        if early is None or early[side] is None:
            return []
        j = early[side]
        send = self.program.instructions[j]
        return [_Step(str(send), send.mb, send.chunk, _bind(self._send_early, j, send), j, send.op.value)]

    def _send_early(self, index: int, ins: Instr) -> None:
        if ins.op == Op.SEND_ACT and not self.chunks[ins.chunk].output_ready(ins.mb):
            self._deferred.append((index, ins))  # its all-to-all is in flight: posted once it lands
            return
        self._send_now(ins)

    def _send_now(self, ins: Instr) -> None:
        c = self.chunks[ins.chunk]
        if ins.op == Op.SEND_ACT:
            self._send(ACT, ins.mb, ins.chunk, ins.peer, c.output(ins.mb))
        else:
            self._send(GRAD, ins.mb, ins.chunk, ins.peer, c.pop_input_grad(ins.mb))

    def _post_deferred(self, force: bool, index: int | None = None) -> None:
        left = []
        for j, ins in self._deferred:
            if force and (index is None or j == index) or self.chunks[ins.chunk].output_ready(ins.mb):
                self._send_now(ins)
            else:
                left.append((j, ins))
        self._deferred = left

    def _do_w(self, ins: Instr) -> list[_Step]:
        task = MovableTask(ins.chunk, ins.mb)
        return [_Step(str(task), ins.mb, ins.chunk, _bind(self._run_w, task, True))]

    def _do_register_w(self, ins: Instr) -> list[_Step]:
        return [_Step(str(ins), ins.mb, ins.chunk, _bind(self.register_task, MovableTask(ins.chunk, ins.mb)))]

    def _do_slot(self, ins: Instr) -> list[_Step]:
        return [_Step(str(ins), ins.mb, ins.chunk, _bind(self._slot, ins))]

    def _do_recv(self, ins: Instr) -> list[_Step]:
        return [_Step(str(ins), ins.mb, ins.chunk, _bind(self._recv, ins))]

    def _do_send_act(self, ins: Instr) -> list[_Step]:
        index = self._pc - 1
        if index in self._early_sends:  # posted by its producer (or waiting for its all-to-all)
            return [_Step(str(ins), ins.mb, ins.chunk, _bind(self._post_deferred, True, index))] \
                if any(j == index for j, _ in self._deferred) else []
        return [_Step(str(ins), ins.mb, ins.chunk, _bind(self._send_now, ins))]

    def _do_send_grad(self, ins: Instr) -> list[_Step]:
        if self._pc - 1 in self._early_sends:
            return []
        return [_Step(str(ins), ins.mb, ins.chunk, _bind(self._send_now, ins))]

    def _do_reduce(self, ins: Instr) -> list[_Step]:
        return [_Step(str(ins), -1, -1, self._reduce)]

    def _do_optimizer_step(self, ins: Instr) -> list[_Step]:
        return [_Step(str(ins), -1, -1, self._optimizer_step)]

    def _do_fb(self, ins: Instr) -> list[_Step]:
        f, b = self.chunks[ins.chunk], self.chunks[ins.chunk2]
        f.begin_forward(ins.mb, self._f_source(ins.mb, ins.chunk), self._labels(ins.chunk, ins.mb),
                        self._b_runs.get((ins.chunk, ins.mb)), self._defer_w.get((ins.chunk, ins.mb)))
        b.begin_backward(ins.mb2, self._b_source(ins.mb2, ins.chunk2), defer_w=True)
        return self._cached(lambda: self._fb_steps(ins, f, b))

    def _fb_steps(self, ins: Instr, f, b) -> list[_Step]:
        pair = self._pairs[(ins.chunk, ins.chunk2, ins.with_w, ins.order)]
        last_f = max(i for i, ps in enumerate(pair) if ps.side == "F")
        last_b = max(i for i, ps in enumerate(pair) if ps.side == "B" and ps.key.phase == "B")
        steps = []
        for i, ps in enumerate(pair):
            if ps.side == "F":
                steps.append(_Step(str(ps.key), ins.mb, ins.chunk, _bind(f.run, ps.key, ins.mb)))
            elif ps.key.phase == "W":
                steps.append(_Step(str(ps.key), ins.mb2, ins.chunk2, _bind(b.run_w, ins.mb2, ps.key)))
            else:
                steps.append(_Step(str(ps.key), ins.mb2, ins.chunk2, _bind(b.run, ps.key, ins.mb2)))
            if i == last_f:  # each side's send right after the task producing it
                steps += self._send_steps(0)
            if i == last_b:
                steps += self._send_steps(1)
        if not ins.with_w:
            return steps
        return steps + [_Step(f"W(mb{ins.mb2}.c{ins.chunk2})", ins.mb2, ins.chunk2, _bind(b.run_w, ins.mb2))]

    def _recv(self, ins: Instr) -> None:
        self._post(ins)
        if self.profile:
            key = self._recv_key(ins)
            self._arrived[key] = self._comm.wait_recv(*key)

    def _send(self, kind: str, mb: int, chunk: int, peer: int, tensor: torch.Tensor) -> None:
        self._comm.send(kind, mb, self._stage[chunk], peer, tensor)

    def _run_w(self, task: MovableTask, deadline: bool) -> None:
        if deadline and (note := getattr(self.slot_policy, "on_deadline", None)) is not None:
            note(task, task in self.pool)
        for t in self.pool.due(task):
            self.chunks[t.chunk].run_w(t.mb)
            self.pool.mark_done(t)
        if deadline and self.chunks[task.chunk].w_pending(task.mb):  # W without register_w
            self.chunks[task.chunk].run_w(task.mb)

    def _slot(self, ins: Instr) -> None:
        if self.slot_policy is None:
            return
        tasks = tuple(self.slot_policy.select(ins, self.pool))  # the policy's own time (and its live counts) is not fill
        if not tasks:
            return
        t0 = self._slot_ms.mark()
        self._run_slot_tasks(tasks)
        self._slot_ms.add(t0, self._slot_ms.mark())

    def _run_slot_tasks(self, tasks) -> None:
        for task in tasks:
            if isinstance(task, MovableUnit):  # one layer's W (its parameters: microbatch order kept)
                if not self.pool.unit_eligible(task):
                    raise EngineError(f"slot policy {type(self.slot_policy).__name__} chose {task}, which is not "
                                      "eligible (ran, not pending, or an earlier microbatch's unit has not run)")
                ch = self.chunks[task.chunk]
                for k in ch.task_keys("W"):
                    if k.layer == task.layer and (not task.kinds or k.kind in task.kinds):
                        ch.run_w(task.mb, k)
                self.pool.unit_done(task, whole=not ch.w_pending(task.mb))
                continue
            if not self.pool.eligible(task):  # a W before an unregistered earlier microbatch breaks accumulation order
                raise EngineError(f"slot policy {type(self.slot_policy).__name__} chose {task}, which is not eligible "
                                  "(not pending, or an earlier microbatch of its chunk is not registered yet)")
            self._run_w(task, deadline=False)

    def _reduce(self) -> None:
        left = [str(t) for t in self.pool.pending()]
        left += [f"W(mb{mb}.c{c})" for c, ch in enumerate(self.chunks) for mb in range(self.program.num_microbatches)
                 if ch.w_pending(mb)]
        if left:
            raise EngineError(f"weight gradients still pending at reduce_grads: {sorted(set(left))}")
        scale = 1.0 / (self.program.num_microbatches * self._dp)
        g = self.groups
        reduce_gradients(self._dense, g.dense_dp if g else None, scale, self.ordered_reduce)
        reduce_gradients(self._experts, g.expert_dp if g else None, scale, self.ordered_reduce)

    def _optimizer_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            gating.update_expert_bias(self._routers, self.groups.dense_dp if self.groups else None)
        if self._comm is not None:
            self._comm.finish()
        self._losses = {}
        for ch in self.chunks:
            self._losses.update(ch.end_iteration())
