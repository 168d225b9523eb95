"""The local launcher's backends: the same engine run on gloo and on NCCL.

One 2-rank launch per backend (pp=2, 1f1b with F&B overlap and split W, 2 microbatches,
tiny-qwen3-next cut to 2 layers, seq 8, one SGD step): gloo on CPU must give parameters bitwise
equal to the single-process reference; NCCL puts rank ``r`` on ``cuda:r`` (one GPU per rank) and
must agree with the same CPU reference within the GPU tolerance of docs/running.md (GPU section:
rtol 1e-4, atol 1e-5 times the largest update, on each parameter's update). The NCCL variant is
skipped, with the reason, where this machine has fewer than 2 CUDA devices.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tessera.engine import Batch, Engine, Layout, make_groups
from tessera.model import StageModule
from tessera.model.determinism import use_deterministic
from tessera.program.compiler import compile_plan
from tessera.program.plan import Partition, Plan
from tessera.spec.presets import get_model
from tessera.testing import global_state_dict, reference_train, run_local
from tessera.testing.launch_local import nccl_unavailable

SEED, LR, SEQ, M = 5, 1e-2, 8, 2
GPU_RTOL, GPU_ATOL_SCALE = 1e-4, 1e-5  # docs/running.md, GPU section

NCCL_SKIP = nccl_unavailable(2)
BACKENDS = [pytest.param("gloo", id="gloo"),
            pytest.param("nccl", id="nccl", marks=pytest.mark.skipif(NCCL_SKIP is not None, reason=str(NCCL_SKIP)))]


def model_spec():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:2])


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, foreach=False)


def programs():
    return compile_plan(Plan("backends", "1f1b", 2, 1, M, Partition((-1, 1, 3)), True, True))


def batches():
    g = torch.Generator().manual_seed(SEED)
    return [[Batch.from_tokens(torch.randint(0, 256, (M, 1, SEQ + 1), generator=g))]]


def world(rank: int, world_size: int, backend: str) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as on CPU
        use_deterministic(device, model_spec())
    else:
        torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    groups = make_groups(Layout(2, 1, 1))
    prog = programs()[groups.pipeline_rank]
    mods = [StageModule(model_spec(), (s.start, s.stop), seed=SEED).to(device) for s in prog.stages]
    engine = Engine(prog, mods, groups, make_optimizer([p for m in mods for p in m.parameters()]))
    for step in batches():
        engine.run_iteration(step[0])
    return {"state": {k: v.cpu() for m in mods for k, v in global_state_dict(m).items()},
            "timer": type(engine.timer).__name__, "streams": engine.chunks[0].stream.active}


@functools.lru_cache(maxsize=None)
def _reference() -> dict:
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)  # as the workers
    torch.use_deterministic_algorithms(True)
    try:
        return reference_train(model_spec(), batches(), seed=SEED, make_optimizer=make_optimizer).state
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_on_backend_matches_the_reference(backend):
    ranks = run_local(functools.partial(world, backend=backend), 2, timeout_s=300, backend=backend)
    got = {k: v for r in ranks for k, v in r["state"].items()}
    want = _reference()
    assert got.keys() == want.keys() and len(want) > 20
    if backend == "gloo":
        assert {(r["timer"], r["streams"]) for r in ranks} == {("HostTimer", False)}
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad, f"{len(bad)} of {len(want)} parameters differ, e.g. {bad[:4]}"
        return
    assert {(r["timer"], r["streams"]) for r in ranks} == {("CudaEventTimer", True)}
    init = global_state_dict(StageModule(model_spec(), (-1, model_spec().num_layers + 1), seed=SEED))
    for name, w in want.items():
        upd_want, upd_got = w - init[name], got[name] - init[name]
        scale = max(upd_want.abs().max().item(), 1e-12)
        torch.testing.assert_close(upd_got, upd_want, rtol=GPU_RTOL, atol=GPU_ATOL_SCALE * scale, msg=name)


def test_nccl_is_refused_with_the_reason_where_it_cannot_run():
    if NCCL_SKIP is None:
        pytest.skip("this machine can run 2 NCCL ranks (the refusal is for machines that cannot)")
    with pytest.raises(ValueError, match=r"run_local backend='nccl' world_size=2: NCCL needs .*; use backend='gloo'"):
        run_local(functools.partial(world, backend="nccl"), 2, timeout_s=30, backend="nccl")
    with pytest.raises(ValueError, match=r"run_local backend='mpi': must be one of \('gloo', 'nccl'\)"):
        run_local(functools.partial(world, backend="gloo"), 2, timeout_s=30, backend="mpi")
