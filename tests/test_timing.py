"""The engine's timers (tessera.engine.timing) and communication streams (tessera.model.streams).

On CPU: host time is what the engine measured before (``perf_counter`` spans), the timer is picked
by device, spans resolve once, a CPU engine uses host time and no side streams, and the
deterministic-kernel switch leaves CPU as it was. The CUDA tests (events on a real kernel, the
side stream around a real NCCL all-to-all, the engine's CUDA path) are skipped, with the reason,
where there is no GPU; they are written to run as they stand on one.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tessera.engine import Batch, Engine
from tessera.engine.timing import CudaEventTimer, HostTimer, SpanLog, SpanTotal, first_device, make_timer
from tessera.model import StageModule
from tessera.model.determinism import CUBLAS_WORKSPACE_CONFIG, cuda_nondeterministic, use_deterministic
from tessera.model.streams import NO_STREAM, CommStream
from tessera.program.compiler import compile_plan
from tessera.program.plan import Partition, Plan
from tessera.spec.presets import get_model
from tessera.testing import run_local
from tessera.testing.launch_local import nccl_unavailable

NO_GPU = "no CUDA device on this machine (torch.cuda.is_available() is False)"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
NCCL1 = nccl_unavailable(1)


class _Deferred:
    """The timer interface with device-time semantics, marks as numbers: counts resolves."""

    device_time = True

    def __init__(self) -> None:
        self.resolves = 0

    def mark(self):
        return 0.0

    def ms(self, a, b):
        assert self.resolves, "a device span read before resolve"
        return (b - a) * 1e3

    def known_ms(self, a, b):
        return math.nan

    def resolve(self):
        self.resolves += 1


def test_host_timer_is_perf_counter_in_ms():
    t = HostTimer()
    assert not t.device_time
    assert t.ms(1.0, 1.5) == 500.0 and t.known_ms(2.0, 2.25) == 250.0
    a = t.mark()
    b = t.mark()
    assert isinstance(a, float) and b >= a
    t.resolve()  # nothing to wait for


def test_timer_is_picked_by_device():
    assert type(make_timer(None)) is HostTimer and type(make_timer("cpu")) is HostTimer
    assert type(make_timer(torch.device("cpu"))) is HostTimer
    cuda = make_timer("cuda:1")  # constructing touches no CUDA state
    assert type(cuda) is CudaEventTimer and cuda.device == torch.device("cuda", 1) and cuda.device_time
    assert math.isnan(cuda.known_ms(None, None))
    with pytest.raises(ValueError, match=r"CudaEventTimer device=cpu: must be a CUDA device; use HostTimer"):
        CudaEventTimer("cpu")


def test_host_spans_add_at_once():
    total, log = SpanTotal(HostTimer()), SpanLog(HostTimer())
    total.add(1.0, 1.25)
    total.add(2.0, 2.5)
    assert total.ms == 750.0
    log.add("a", 0.0, 0.001)
    log.add("b", 1.0, 1.002)
    assert list(log) == [("a", 1.0), ("b", pytest.approx(2.0, rel=1e-9))] and len(log) == 2
    log.clear()
    total.reset()
    assert list(log) == [] and total.ms == 0.0


def test_device_spans_resolve_once_when_read():
    timer = _Deferred()
    total, log = SpanTotal(timer), SpanLog(timer)
    for i in range(5):
        total.add(float(i), i + 0.5)
        log.add(i, float(i), i + 0.25)
    assert timer.resolves == 0  # nothing read yet: no synchronize
    assert total.ms == 2500.0 and [ms for _, ms in log] == [250.0] * 5
    assert timer.resolves == 2  # once per collection read, not per span
    assert total.ms == 2500.0 and len(log) == 5 and timer.resolves == 2  # resolved values are kept


def test_first_device_and_no_stream_on_cpu():
    spec = get_model("tiny-qwen3-next")
    assert first_device([]) == torch.device("cpu")
    assert first_device([StageModule(spec, (-1, 1), seed=0)]) == torch.device("cpu")
    assert not CommStream("cpu").active and not CommStream(None).active and not NO_STREAM.active

    class _Work:
        waited = 0

        def wait(self):
            self.waited += 1

    with CommStream("cpu").issue(torch.ones(2)):
        pass
    work = _Work()
    CommStream("cpu").land(work, torch.ones(2))
    assert work.waited == 1  # without a stream: exactly work.wait()


def _pp1(spec, m=2):
    return compile_plan(Plan("t", "1f1b", 1, 1, m, Partition((-1, spec.num_layers + 1)), False, False))[0]


def _spec():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:2])


def _batch(m=2, seq=8, device="cpu"):
    tokens = torch.randint(0, 256, (m, 1, seq + 1), generator=torch.Generator().manual_seed(0))
    return Batch.from_tokens(tokens.to(device))


def test_cpu_engine_times_on_the_host_without_side_streams():
    spec = _spec()
    mod = StageModule(spec, (-1, spec.num_layers + 1), seed=0)
    engine = Engine(_pp1(spec), [mod], None, None, profile=True)
    assert type(engine.timer) is HostTimer and engine.chunks[0].timer is engine.timer
    assert not engine.chunks[0].stream.active
    res = engine.run_iteration(_batch())
    assert res.profile and all(math.isfinite(r.ms) and r.ms >= 0 for r in res.profile)
    assert math.isfinite(res.wall_ms) and res.idle_ms == 0.0
    tasks = list(engine.chunks[0].timings)
    assert {str(k) for k, _ in tasks} >= {str(k) for k in engine.chunks[0].task_keys("F")}


def test_deterministic_switch_leaves_cpu_as_before_and_names_cuda_gaps():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        assert use_deterministic("cpu", _spec()) == ()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert CUBLAS_WORKSPACE_CONFIG == ":4096:8"
    gaps = cuda_nondeterministic(_spec())  # tiny-qwen3-next: layers 0 and 1 are DeltaNet layers
    assert len(gaps) == 1 and "cumsum" in gaps[0] and "layers [0, 1]" in gaps[0]
    attn_only = dataclasses.replace(_spec(), layers=tuple(l for l in get_model("tiny-qwen3-next").layers
                                                           if l.mixer is not None and l.mixer.kind == "attention"))
    assert cuda_nondeterministic(attn_only) == ()


# --- CUDA (skipped without a GPU) --------------------------------------------------------------

@cuda_only
def test_cuda_events_time_a_kernel_and_resolve_once():
    timer = make_timer("cuda")
    x = torch.randn(2048, 2048, device="cuda")
    a = timer.mark()
    for _ in range(4):
        x = x @ x / 2048
    b = timer.mark()
    total = SpanTotal(timer)
    total.add(a, b)
    assert total.ms > 0 and timer.ms(a, b) == total.ms


def _nccl_a2a(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from tessera.model.ep.plan import issue_all_to_all

    stream = CommStream(torch.device("cuda", torch.cuda.current_device()))
    x = torch.arange(64.0, device="cuda").reshape(16, 4) * 3  # produced on the compute stream
    with stream.issue(x):
        out, work = issue_all_to_all(x, [16], [16], dist.group.WORLD, async_op=True)
    y = torch.randn(1024, 1024, device="cuda") @ torch.randn(1024, 1024, device="cuda")  # compute meanwhile
    stream.land(work, out)
    return {"equal": bool(torch.equal(out, x)), "active": stream.active, "y": float(y.sum().isfinite())}


@pytest.mark.skipif(NCCL1 is not None, reason=str(NCCL1))
def test_side_stream_carries_a_real_nccl_all_to_all():
    (res,) = run_local(_nccl_a2a, 1, timeout_s=120, backend="nccl")
    assert res == {"equal": True, "active": True, "y": 1.0}


@cuda_only
def test_cuda_engine_uses_events():
    spec = _spec()
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        assert use_deterministic("cuda", spec) == cuda_nondeterministic(spec)  # DeltaNet: warn_only on CUDA
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        mod = StageModule(spec, (-1, spec.num_layers + 1), seed=0).cuda()
        engine = Engine(_pp1(spec), [mod], None, None, profile=True)
        assert type(engine.timer) is CudaEventTimer and engine.chunks[0].stream.active
        res = engine.run_iteration(_batch(device="cuda"))
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert res.profile and all(math.isfinite(r.ms) and r.ms >= 0 for r in res.profile)
    assert res.wall_ms > 0 and all(ms >= 0 for _, ms in engine.chunks[0].timings)
