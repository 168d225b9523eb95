"""Kineto trace import: a PyTorch-profiler Chrome trace of an overlapped F&B pair into task times.

The input is what ``torch.profiler.profile(...).export_chrome_trace`` writes (Kineto's JSON):
``traceEvents`` with host annotations (``cat == "user_annotation"``, from
``torch.profiler.record_function``), host launches (``cuda_runtime`` / ``cuda_driver``, each with
``args.correlation``) and GPU activity (``kernel``, ``gpu_memcpy``, ``gpu_memset``, each with
``args.correlation`` and ``args.stream``). DeepSeek's public profile of DualPipe's overlapped
chunk pair (``../shared/data/deepseek-v3-h800-ep64-train-trace.json``; DeepSeek
``profile-data`` repository) names its annotations ``<op>(<phase>)``: ``attn``, ``mlp``,
``dispatch``, ``combine`` with ``F``, ``B`` or ``W``.

GPU work is attributed to annotations by launch correlation, not by the annotations' host
durations: a kernel belongs to the innermost ``<op>(<phase>)`` annotation whose host interval
contains the launch call with the kernel's correlation id (on any host thread of the process:
the backward's launches come from the autograd thread while the main thread sits inside the
annotation). The host blocks inside some annotations (DeepEP's dispatch waits for its receive
counts, about 20 ms), so annotation durations say little about the GPU; kernel times do.

Streams are given roles by what runs on them: the stream with the most kernel time of
``attn``/``mlp`` annotations is the compute stream, streams carrying ``dispatch``/``combine``
kernels are communication streams, other streams with compute kernels are auxiliary (DeepSeek
runs part of ``mlp(W)`` on a third stream).

Raises :class:`~tessera.errors.TesseraConfigError` (field ``planner.trace``) for unreadable files
and traces without annotated GPU work, naming the file, what is missing and the fix.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from tessera.errors import TesseraConfigError

__all__ = ["TraceKernel", "TraceInstance", "KinetoTrace", "load_kineto", "parse_kineto",
           "OP_ROLES"]

OP_ROLES = {"attn": "compute", "mlp": "compute", "dispatch": "comm", "combine": "comm"}
"""Annotation op -> the resource it runs on (DeepSeek's profile-data naming)."""

_ANNOTATION = re.compile(r"^(?P<op>[A-Za-z_][\w.]*)\((?P<phase>[FBW])\)$")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class TraceKernel:
    """One GPU activity: ``name``, ``stream`` id, ``start_us`` (from the first GPU activity of the
    trace) and ``dur_us``, microseconds; ``blocks``: thread blocks of its grid (0 for copies)."""

    name: str
    stream: int
    start_us: float
    dur_us: float
    blocks: int = 0


@dataclass(frozen=True)
class TraceInstance:
    """One annotation instance with the GPU work launched inside it.

    Attributes:
        op: annotation op, e.g. ``"dispatch"``; phase: ``"F"``, ``"B"`` or ``"W"``.
        index: issue order among all instances (by host start time).
        occurrence: how many earlier instances have the same ``op`` and ``phase`` (the layer
            position within the pair's chunk, in issue order).
        host_start_us, host_dur_us: the annotation on the host, us from the trace's first GPU
            activity.
        kernels: its GPU activities, by start time.
    """

    op: str
    phase: str
    index: int
    occurrence: int
    host_start_us: float
    host_dur_us: float
    kernels: tuple[TraceKernel, ...]

    @property
    def name(self) -> str:
        return f"{self.op}({self.phase})"

    def busy_ms(self, streams: frozenset[int] | None = None) -> float:
        """Summed kernel time on ``streams`` (all streams when ``None``), ms."""
        return sum(k.dur_us for k in self.kernels if streams is None or k.stream in streams) / 1e3

    def span_ms(self) -> float:
        """Union of its kernels' intervals over all streams (time its GPU work occupies), ms."""
        return _union_us([(k.start_us, k.start_us + k.dur_us) for k in self.kernels]) / 1e3


@dataclass(frozen=True)
class KinetoTrace:
    """A parsed trace: annotated instances in issue order and the stream roles.

    Attributes:
        path: the file read.
        device: GPU name from ``deviceProperties`` (``""`` when absent).
        world_size: from ``distributedInfo`` (0 when absent).
        trace_name: ``traceName`` (DeepSeek's encodes the layout, e.g.
            ``prof_ep64_tp1_varsm_hidden7168_seqlen4096``).
        instances: every ``<op>(<phase>)`` annotation with GPU work, in issue order.
        compute_stream: stream id of the compute stream; comm_streams, aux_streams: see module doc.
        window_us: first GPU activity start to last GPU activity end, over the whole trace, us.
        unattributed_us: GPU time of activities launched outside every ``<op>(<phase>)``
            annotation, us (kept out of the instances, reported so nothing is dropped silently).
    """

    path: str
    device: str
    world_size: int
    trace_name: str
    instances: tuple[TraceInstance, ...]
    compute_stream: int
    comm_streams: frozenset[int]
    aux_streams: frozenset[int]
    window_us: float
    unattributed_us: float

    @property
    def window_ms(self) -> float:
        """The pair's measured GPU window, ms."""
        return self.window_us / 1e3

    def totals_ms(self) -> dict[str, float]:
        """Summed kernel time per annotation name (e.g. ``"mlp(W)"``) over every instance and
        stream, ms."""
        out: dict[str, float] = {}
        for inst in self.instances:
            out[inst.name] = out.get(inst.name, 0.0) + inst.busy_ms()
        return out

    def stream_busy_ms(self, stream: int) -> float:
        """Summed kernel time on one stream, ms."""
        return sum(k.dur_us for i in self.instances for k in i.kernels if k.stream == stream) / 1e3

    def comm_blocks(self) -> int:
        """Thread blocks of the communication kernels, weighted by time (the most common grid of
        ``dispatch``/``combine`` kernels): DeepEP runs one block per SM it holds, so this is the
        SM count communication takes from compute while it runs (DeepSeek-V3 report sec. 3.2.2:
        20 SMs on H800). 0 when the trace has no communication kernels."""
        weight: dict[int, float] = {}
        for inst in self.instances:
            if self.role_of(inst) == "comm":
                for k in inst.kernels:
                    weight[k.blocks] = weight.get(k.blocks, 0.0) + k.dur_us
        return max(weight, key=weight.get) if weight else 0

    def role_of(self, inst: TraceInstance) -> str:
        """``"compute"`` or ``"comm"`` (:data:`OP_ROLES`; an unknown op counts as compute)."""
        return OP_ROLES.get(inst.op, "compute")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, cur = 0.0, None
    for a, b in sorted(intervals):
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


def load_kineto(path: str | Path) -> KinetoTrace:
    """Read and parse a Kineto Chrome trace, plain or gzip-compressed (``.json.gz``, as
    ``torch.profiler.tensorboard_trace_handler(use_gzip=True)`` writes) (module docstring).
    Raises TesseraConfigError."""
    p = Path(path)
    try:
        raw = p.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except OSError as e:
        raise TesseraConfigError("planner.trace", str(p), f"cannot read the file ({e.strerror})",
                                 "give the path of a PyTorch-profiler Chrome trace (JSON)") from None
    except json.JSONDecodeError as e:
        raise TesseraConfigError("planner.trace", str(p), f"not JSON ({e.msg} at line {e.lineno})",
                                 "give a trace written by torch.profiler's export_chrome_trace") from None
    return parse_kineto(data, str(p))


def parse_kineto(data: dict, path: str = "<trace>") -> KinetoTrace:
    """Parse the JSON object of a Kineto trace (module docstring). Raises TesseraConfigError."""
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise TesseraConfigError("planner.trace", path, "no 'traceEvents' list", "give a Kineto Chrome trace")
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
                    and _ANNOTATION.match(str(e.get("name", "")))), key=lambda e: (e["ts"], -e.get("dur", 0)))
    launch_ts = {e["args"]["correlation"]: float(e["ts"]) for e in events
                 if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in _GPU_CATS and e.get("ph") == "X"]
    if not gpu:
        raise TesseraConfigError("planner.trace", path, "no GPU activity (kernel events)",
                                 "profile with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]")
    t0 = min(float(e["ts"]) for e in gpu)
    per_mark: list[list[TraceKernel]] = [[] for _ in marks]
    unattributed = 0.0
    for e in gpu:
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        owner = _innermost(marks, ts) if ts is not None else None
        args = e.get("args", {})
        grid = args.get("grid") or [0]
        k = TraceKernel(str(e.get("name", "")), int(args.get("stream", e.get("tid", -1))),
                        float(e["ts"]) - t0, float(e.get("dur", 0.0)), int(grid[0]) * int(grid[1] if len(grid) > 1 else 1)
                        * int(grid[2] if len(grid) > 2 else 1))
        if owner is None:
            unattributed += k.dur_us
        else:
            per_mark[owner].append(k)
    instances: list[TraceInstance] = []
    seen: dict[tuple[str, str], int] = {}
    for m, ks in zip(marks, per_mark):
        if not ks:
            continue
        g = _ANNOTATION.match(m["name"])
        key = (g["op"], g["phase"])
        instances.append(TraceInstance(g["op"], g["phase"], len(instances), seen.get(key, 0), float(m["ts"]) - t0,
                                       float(m.get("dur", 0.0)), tuple(sorted(ks, key=lambda k: k.start_us))))
        seen[key] = seen.get(key, 0) + 1
    if not instances:
        raise TesseraConfigError("planner.trace", path, "no GPU work inside '<op>(<phase>)' annotations "
                                 "(e.g. 'attn(F)', 'dispatch(B)')", "wrap each task in torch.profiler.record_function")
    compute, comm, aux = _stream_roles(instances, path)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in gpu) - t0
    props = data.get("deviceProperties") or [{}]
    return KinetoTrace(path=path, device=str(props[0].get("name", "")),
                       world_size=int((data.get("distributedInfo") or {}).get("world_size", 0)),
                       trace_name=str(data.get("traceName", "")), instances=tuple(instances),
                       compute_stream=compute, comm_streams=comm, aux_streams=aux, window_us=end,
                       unattributed_us=unattributed)


def _innermost(marks: list[dict], ts: float) -> int | None:
    """Index of the innermost (latest-starting) annotation containing host time ``ts``."""
    best = None
    for i, m in enumerate(marks):
        if m["ts"] > ts:
            break
        if ts < m["ts"] + m.get("dur", 0.0):
            best = i
    return best


def _stream_roles(instances: list[TraceInstance], path: str) -> tuple[int, frozenset[int], frozenset[int]]:
    comp: dict[int, float] = {}
    comm: set[int] = set()
    for inst in instances:
        for k in inst.kernels:
            if OP_ROLES.get(inst.op, "compute") == "comm":
                comm.add(k.stream)
            else:
                comp[k.stream] = comp.get(k.stream, 0.0) + k.dur_us
    if not comp:
        raise TesseraConfigError("planner.trace", path, "no compute kernels (attn/mlp annotations)",
                                 "profile a training step with its compute annotated")
    main = max(comp, key=comp.get)
    return main, frozenset(comm - {main}), frozenset(set(comp) - {main} - comm)
