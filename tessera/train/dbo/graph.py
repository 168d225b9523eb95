"""The compiled-graph side of the token-count transport: slots, graph tasks, the decision rule.

The graph (one per EP group, built and driven by EP rank 0's Train worker,
:mod:`tessera.train.dbo.graph_transport`): EP rank 0's training thread executes one step per
exchange with its own counts as the input; every other peer's worker actor
(``ray.get_runtime_context().current_actor``) runs two tasks, bound with
``handle.__ray_call__.bind(fn, ...)``: :func:`_produce` hands the graph this rank's counts (waiting
at most ``timeout_s`` for its training thread), :func:`_consume` takes the input and every
peer's output and puts the outcome in the rank's outbox. The graph runs only while an exchange
is in progress (nothing executes between exchanges; but Ray 2.60's channel reads busy-wait, so
the execution loops of EP ranks > 0 keep about 0.7 of a core busy each while they wait).

A worker's training thread and the graph's execution thread meet through the process's
:class:`Slot` for the transport (found by the transport's key in this module's process-wide
registry: the one piece of state the two threads share). Every peer applies :func:`decide` to the
same rows, so every peer decides each exchange the same way: all counts present and of one length
-> the ``(ep, n)`` result; a peer's task failed or a peer gave nothing within ``timeout_s`` -> the
exchange failed, and every peer exchanges those counts over the all-gather instead.
Arrays read from graph channels are copied at once (zero-copy results pin channel buffers).
"""

from __future__ import annotations

import queue
import re
import threading
import time

import numpy as np

MIN_RAY = (2, 60)  # the version measured (../shared/design/RAY-NOTES.md)
MAX_RAY = (3, 0)  # exclusive: compiled graphs are announced for deprecation upstream


class Slot:
    """One transport's meeting point in one worker process: the counts offered for the next
    exchange (taken by :func:`_produce`) and the outbox of decided exchanges."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.item: tuple | None = None  # (seq, counts, error)
        self.outbox: queue.Queue = queue.Queue()  # (seq, (ep, n) array or None, error or None)

    def offer(self, seq: int, counts: np.ndarray, error: str | None = None) -> None:
        with self.cond:
            self.item = (seq, counts, error)
            self.cond.notify_all()

    def retract(self, seq: int) -> bool:
        """Withdraw exchange ``seq``'s counts; False when the graph took them already."""
        with self.cond:
            if self.item is not None and self.item[0] == seq:
                self.item = None
                return True
            return False

    def take(self, seq: int, timeout_s: float) -> tuple | None:
        """The counts of exchange ``seq`` (older ones are dropped), or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                if self.item is not None and self.item[0] >= seq:
                    item, self.item = self.item, None
                    return item
                self.item = None  # an exchange already decided
                left = deadline - time.monotonic()
                if left <= 0 or not self.cond.wait(left):
                    return None

    def wait(self, seq: int, timeout_s: float) -> tuple[np.ndarray | None, str | None] | None:
        """``(result, error)`` of exchange ``seq`` from the outbox, None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got, result, error = self.outbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if got == seq:
                return result, error


_SLOTS: dict[str, Slot] = {}
_SLOTS_LOCK = threading.Lock()


def slot(key: str) -> Slot | None:
    """This process's slot of transport ``key`` (None: not open here, or closed)."""
    with _SLOTS_LOCK:
        return _SLOTS.get(key)


def open_slot(key: str) -> Slot:
    """Make this process's slot of transport ``key`` (before the graph is compiled)."""
    with _SLOTS_LOCK:
        return _SLOTS.setdefault(key, Slot())


def close_slot(key: str) -> None:
    """Forget this process's slot of ``key``; no error if absent."""
    with _SLOTS_LOCK:
        _SLOTS.pop(key, None)


def decide(rows) -> tuple[int, np.ndarray | None, str | None]:
    """``(seq, result, error)`` of one exchange from ``rows[r] = (seq, counts, error)`` of EP
    rank ``r``: the stacked ``(ep, n)`` int64 counts (a copy), or None and why the exchange
    failed (a peer's error, exchanges out of step, counts of different lengths)."""
    seq = rows[0][0]
    for r, (s, counts, err) in enumerate(rows):
        if err is not None:
            return seq, None, f"EP rank {r}: {err}"
        if s != seq:
            return seq, None, f"EP rank {r} sent exchange {s} while exchange {seq} was open (out of step)"
    sizes = {r: len(row[1]) for r, row in enumerate(rows)}
    if len(set(sizes.values())) > 1:
        return seq, None, f"EP ranks passed counts of different lengths {sizes} for exchange {seq}"
    return seq, np.stack([np.array(row[1], dtype=np.int64, copy=True) for row in rows]), None


def _produce(_actor, key: str, ep_rank: int, timeout_s: float, inp: tuple) -> tuple:
    """Graph task on EP rank ``ep_rank`` > 0: ``(seq, counts, None)`` for the exchange ``inp``
    opens, ``(seq, None, error)`` when the counts do not come within ``timeout_s`` or taking them
    failed. Never raises."""
    seq = inp[0]
    try:
        own = slot(key)
        item = None if own is None else own.take(seq, timeout_s)
        if item is None:
            return seq, None, f"gave no counts for exchange {seq} within {timeout_s} s"
        return item
    except Exception as e:  # noqa: BLE001 - handed to every peer, which all fall back
        return seq, None, f"{type(e).__name__}: {e}"


def _consume(_actor, key: str, inp: tuple, *outs) -> int:
    """Graph task on EP ranks > 0: :func:`decide` on ``inp`` (EP rank 0's row) and the
    :func:`_produce` rows, into the rank's outbox. Returns the exchange number. Never raises."""
    try:
        seq, result, error = decide((inp, *outs))
    except Exception as e:  # noqa: BLE001 - malformed rows: the exchange failed
        seq, result, error = inp[0], None, f"{type(e).__name__}: {e}"
    own = slot(key)
    if own is not None:
        own.outbox.put((seq, result, error))
    return seq


def compile_graph(handles: list, key: str, timeout_s: float):
    """The compiled graph over the worker actors ``handles`` of EP ranks 1.. (in order), for
    EP rank 0 to execute with ``(seq, counts, error)``; outputs: the produce rows, then the
    consume acks.

    Raises:
        Whatever Ray raises when it cannot compile.
    """
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as inp:
        outs = [h.__ray_call__.bind(_produce, key, r + 1, timeout_s, inp) for r, h in enumerate(handles)]
        acks = [h.__ray_call__.bind(_consume, key, inp, *outs) for h in handles]
        dag = MultiOutputNode(outs + acks)
    return dag.experimental_compile(_submit_timeout=timeout_s + 10.0)


def graph_support() -> str | None:
    """None when this process can take part in a compiled graph, else why not (Ray missing, a
    version outside [:data:`MIN_RAY`, :data:`MAX_RAY`), no ``ray.dag`` / ``experimental_compile``,
    Ray not initialised, not inside a Ray actor)."""
    try:
        import ray
        from ray.dag import DAGNode, InputNode, MultiOutputNode
    except ImportError as e:
        return f"ray.dag is not importable ({e})"
    version = tuple(int(x) for x in re.findall(r"\d+", ray.__version__)[:2])
    if not MIN_RAY <= version < MAX_RAY:
        return f"Ray {ray.__version__} is outside the supported {MIN_RAY}..{MAX_RAY} (exclusive)"
    if not (hasattr(DAGNode, "experimental_compile") and InputNode and MultiOutputNode):
        return "ray.dag.DAGNode has no experimental_compile"
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return "not inside a Ray actor (the graph runs on the Train workers' actors)"
    return None
