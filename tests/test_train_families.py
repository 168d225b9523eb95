"""Every tiny family trains on 4 gloo workers from its shipped recipe, bitwise as the reference.

``recipes/tiny-deepseek-v3.yaml`` (MLA, a dense first layer, sigmoid-routed MoE with groups and an
ungated shared expert), ``recipes/tiny-nemotron-h.yaml`` (Mamba-2, MoE with squared-ReLU experts,
attention without RoPE, a dense squared-ReLU MLP) and ``recipes/tiny-qwen3-moe.yaml`` (GQA
attention, softmax-routed MoE, no shared expert), each at its recipe's layout (pp 2 x vpp 2,
ep 2, dp 2: 4 ranks; the planner's template, overlap and W split) with 2 microbatches of one
32-token sequence (:data:`SHAPE`), for :data:`STEPS` steps with a checkpoint at the last, each
through the worker loop of a Ray Train job on 4 local gloo processes (tests/local_job.py), on
the plan of a driver built in this process: a Ray job of a family would prove nothing more about
Ray than the tiny-qwen3-next jobs of tests/test_train_ray.py do (the same launcher, driver and
worker loop; the model code is the worker loop's).

Each run's loss falls, and the parameters of its final checkpoint (every replica's, experts under
global ids) equal bitwise those of :func:`tessera.testing.reference.reference_train` in this
process on the same data (each replica's :func:`tessera.train.worker.data.shard_for`), seed
and optimizer (AdamW at the recipe's ``train.lr``), with the same losses per step up to the
order of the job's mean.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tessera.config.load import load_recipe

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
SHAPE = ("parallel.seq_length=32", "parallel.micro_batch_size=1", "parallel.num_microbatches=2")
"""Each recipe's layout with 2 microbatches (interleaved 1F1B's least: ``pp``) of one 32-token
sequence: 2 x 32 tokens per replica and step, where the recipe has 4 x 2 x 64."""


def _recipe(name: str, out: Path):
    return load_recipe(str(ROOT / "recipes" / f"{name}.yaml"), [
        *SHAPE, f"train.steps={STEPS}", f"train.checkpoint_every={STEPS}", f"logging.out_dir={out}",
        "logging.wandb_mode=disabled", "job.run_name=run"])


def _reference(recipe):
    """:func:`reference_train` of ``recipe`` for :data:`STEPS` steps on the job's own batches
    (replica ``d`` reads ``shard_for(recipe, d)``), on one torch thread as the workers run."""
    from tessera.config.resolve import resolve_model
    from tessera.engine import Batch
    from tessera.testing import reference_train
    from tessera.train.worker.data import shard_for

    p, t = recipe.parallel, recipe.train
    shards = [shard_for(recipe, d) for d in range(p.dp)]
    batches = [[Batch.from_tokens(s.next_batch()) for s in shards] for _ in range(STEPS)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_train(resolve_model(recipe), batches, ep=p.ep, seed=t.seed,
                               make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=t.lr, weight_decay=t.weight_decay))
    finally:
        torch.set_num_threads(threads)


def _checkpoint_params(run_dir: str, recipe) -> dict[str, torch.Tensor]:
    """The parameters (and routers' correction biases) of the run's last checkpoint under the
    reference's global names: each replica's pipeline ranks joined
    (:func:`tessera.train.upgrade.reshard.state_from_parts`), routed experts renamed from EP-local
    to global ids (EP rank ``replica % ep`` holds ``num_experts / ep`` of them). A name two
    replicas hold must be bitwise the same in both."""
    from tessera.config.resolve import resolve_model
    from tessera.train.upgrade.reshard import state_from_parts
    from tessera.train.worker import checkpoint as ckpt

    p = recipe.parallel
    final = ckpt.latest_complete(run_dir)
    assert final.step == STEPS and final.world_size == p.pp * p.dp, final
    local = resolve_model(recipe).moe.num_experts // p.ep
    out: dict[str, torch.Tensor] = {}
    for d in range(p.dp):  # world rank = replica * pp + pipeline rank (tessera.engine.groups)
        parts = [ckpt.load_part(final.path, d * p.pp + k)["state"] for k in range(p.pp)]
        for name, entry in state_from_parts(parts).items():
            if ".moe.experts." in name:
                layer, rest = name.split(".moe.experts.")
                e, tail = rest.split(".", 1)
                name = f"{layer}.moe.experts.{int(e) + (d % p.ep) * local}.{tail}"
            if name in out:
                assert torch.equal(out[name], entry["param"]), f"replicas differ on {name}"
            out[name] = entry["param"]
    return out


def _check(recipe, run_dir: str, rows: list[dict]) -> None:
    """Steps 1..STEPS in order, the loss falls, the losses and final parameters are the reference's."""
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses) and abs(losses[0] - math.log(256)) < 0.5, losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    ref = _reference(recipe)
    # the job's loss is the mean over replicas of each replica's FP32 mean: another order of the same sums
    assert losses == pytest.approx(list(ref.losses), rel=1e-5, abs=0), (losses, ref.losses)
    got = _checkpoint_params(run_dir, recipe)
    assert got.keys() == ref.state.keys(), sorted(set(got) ^ set(ref.state))[:8]
    unequal = [n for n in ref.state if not torch.equal(got[n], ref.state[n])]
    assert not unequal, f"{len(unequal)} of {len(got)} tensors differ from the reference, e.g. {unequal[:4]}"


@pytest.mark.xdist_group("train-families-local")  # scheduled with the groups, ahead of single tests
@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-nemotron-h", "tiny-qwen3-moe"])
def test_tiny_family_trains_on_local_gloo_workers_as_the_reference(name, tmp_path):
    """The worker loop of a job on 4 local gloo processes (tests/local_job.py), the driver's plan:
    20 steps, the MoE all-to-alls ran (ep=2), the loss falls, the final checkpoint's parameters
    equal the reference bitwise."""
    from local_job import run_local_job
    from tessera.train.job.driver import Driver

    recipe = _recipe(name, tmp_path)
    run_dir = os.path.join(tmp_path, "run")
    driver = Driver(recipe.to_dict(), run_dir, "run")
    assert driver.error is None, driver.error
    rows = run_local_job(recipe, run_dir, driver)
    assert all(r["exposed_a2a_ms"] is not None for r in rows)  # ep=2: the MoE all-to-alls ran
    _check(recipe, run_dir, rows)
