"""The training step runner's two engines (tessera.train.worker.step.EngineStepRunner): ordinary steps on
the fast path (profile=False), timed steps (drift checks) on a profile=True engine over the same
modules; one process, the tiny recipe at pp=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config.load import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
ONE_RANK = ["parallel.pp=1", "parallel.vpp=1", "parallel.dp=1", "parallel.ep=1", "planner.template=1f1b",
            "parallel.num_microbatches=2", "parallel.seq_length=16"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread (:func:`conftest.one_thread`)."""


def _runner():
    from tessera.flow import build_baseline, build_costs, compile_programs, resolve
    from tessera.train.worker.step import RankInfo, make_step_runner

    recipe = load_recipe(TINY, ONE_RANK)
    res = resolve(recipe)
    program = compile_programs(build_baseline(res, build_costs(res)))[0]
    return make_step_runner(recipe, program, RankInfo(0, 1, 0, 0, 0), None, model=res.model)


def test_fast_and_timed_steps_train_the_same_bitwise():
    """Which steps are timed changes nothing but the timings: two runners, the timed step at
    another position, end with equal parameters; a fast step leaves no per-task times, a timed
    one has a time for every F, B and W task of the chunk."""
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, 2, 17), generator=g) for _ in range(3)]
    a, b = _runner(), _runner()
    assert a._engine.profile is False
    for i, tokens in enumerate(batches):
        ma, mb = a.run(tokens, timed=i == 0), b.run(tokens, timed=i == 2)
        assert ma.loss == mb.loss and ma.tasks > 0
        assert (len(a.last_timings) > 0) == (i == 0) and (len(b.last_timings) > 0) == (i == 2)
        assert ma.idle_ms == 0.0 and ma.slot_fill_ms == 0.0  # one rank: nothing to wait for, no slots
    chunk = b._timed.chunks[0]
    timed = {str(k) for k, _ in b.last_timings}
    want = {str(k) for phase in ("F", "B") for k in chunk.task_keys(phase)}
    if a.program.instructions and any(i.op.value == "W" for i in a.program.instructions):
        want |= {str(k) for k in chunk.task_keys("W")}
    assert want <= timed
    pa = dict(a.modules[0].named_parameters())
    for n, p in b.modules[0].named_parameters():
        assert torch.equal(p, pa[n]), n
