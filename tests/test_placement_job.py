"""The node check of a running job on local gloo ranks: workers whose nodes interleave are mapped to
the planned placement and train as workers that came node by node; and hot upgrades to and from
synthesized rank orders (``Plan.schedule``) in that job, bitwise.

The tiny recipe (pp=2 x dp=2, ep=2: 4 ranks) on 2-GPU nodes (``hardware.inline.gpus_per_node=2``:
rank order ``ep-dp-pp``, each EP group inside a node, the pipeline across nodes), cut to 4 layers,
32-token sequences and 4 steps, planned with overlap and split W and the template's order
(``planner.synthesis=false``), runs twice through the job's worker loop
(tests/local_job.py, the driver's :meth:`~tessera.train.job.driver.Driver.place_ranks` answered
by :func:`tessera.spec.placement.check_nodes` on the planned placement): once with the ranks' nodes
``a a b b`` (as Ray Train numbers them: as planned, nothing mapped) and on the template's order
throughout, once ``a b a b`` (a launcher that deals ranks round-robin: slots mapped to ranks
``0 2 1 3``, so each EP group is again one node's two ranks) with three plan versions accepted by
the driver before the launch and switched to at their steps as in a Ray job: at step 2 the
synthesized order the planner writes for the same partition (``planner.synthesis=true``: FB pairs
the template does not form, W deferred, deeper warm-up), at step 3 a synthesized order on another
partition (layers move between the ranks), at step 4 the template's order again. Per chunk a
synthesized order keeps the microbatch order, so both runs give the same losses, step by step, and
bitwise the same checkpoint, part by part (parts are numbered by replica and pipeline rank, not
world rank). The same node check on a real multi-node Ray cluster: tests/test_multinode.py; hot
upgrades in a Ray job: tests/test_upgrade_ray.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tessera.config.load import load_recipe

pytestmark = pytest.mark.xdist_group("placement-job")  # the two runs, built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
STEPS = 4
CUT = ("hardware.inline.gpus_per_node=2", "model.num_layers=4", "parallel.seq_length=32", "planner.overlap=true",
       "planner.split_w=true", "planner.synthesis=false", "job.upgrade_lead_steps=1", f"train.steps={STEPS}",
       f"train.checkpoint_every={STEPS}", "logging.wandb_mode=disabled")
OTHER = (-1, 2, 3, 4, 5)  # layers 0-1 with the embedding, the head alone on the last stage


def _plans(recipe):
    """(the template-order plan, the synthesized plan of its partition, a synthesized plan of
    :data:`OTHER` under the same synthesis policy)."""
    from tessera.flow import build_costs, plan_recipe, resolve
    from tessera.plan.pair_scheduler import schedule_pair
    from tessera.plan.synthesis import apply_policy
    from tessera.program.plan import Partition

    res = resolve(recipe.with_overrides(["planner.synthesis=true"]))
    costs = build_costs(res)
    report = plan_recipe(res, costs)
    syn, template = report.tessera, report.synthesis.start
    other = apply_policy(costs, replace(template, partition=Partition(OTHER), pair_orders=()), report.synthesis.policy,
                         scheduler=schedule_pair)
    return template, syn, other


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from local_job import run_local_job
    from tessera.train.job.driver import Driver

    tmp = tmp_path_factory.mktemp("placement")
    out, plans = {}, None
    for name, node_ids in (("grouped", ["a", "a", "b", "b"]), ("interleaved", ["a", "b", "a", "b"])):
        recipe = load_recipe(TINY, [*CUT, f"logging.out_dir={tmp}", f"job.run_name={name}"])
        run_dir = str(tmp / name)
        driver = Driver(recipe.to_dict(), run_dir, name)  # it plans the template's order
        plans = plans or _plans(recipe)
        if name == "interleaved":  # versions 1-3, at steps 2-4 (job.upgrade_lead_steps=1, the driver at step 0)
            answers = [driver.upgrade_plan(json.dumps(p.to_dict())) for p in (plans[1], plans[2], plans[0])]
        else:
            answers = []
        results: list[dict] = []
        rows = run_local_job(recipe, run_dir, driver, node_ids=node_ids, out=results)
        out[name] = {"rows": rows, "ranks": results, "run_dir": run_dir, "driver": driver, "plans": plans,
                     "answers": answers}
    return out


def test_interleaved_nodes_are_mapped_to_the_planned_placement(runs):
    from tessera.spec.placement import place

    planned = place(2, 2, 2, 2).to_dict()
    same, mixed = runs["grouped"]["ranks"], runs["interleaved"]["ranks"]
    for placed in (r["placed"] for r in same):  # every rank got the driver's same answer
        assert (placed["remapped"], placed["ranks"], placed["nodes"]) == (False, [], [0, 0, 1, 1])
        assert placed["placement"] == planned
    for placed in (r["placed"] for r in mixed):
        assert (placed["remapped"], placed["ranks"], placed["nodes"]) == (True, [0, 2, 1, 3], [0, 1, 0, 1])
        assert placed["placement"] == planned  # mapped: each EP group on one node, the pipeline across
    # position (replica * pp + pipeline rank) of each world rank: ranks 0 and 2 share node a, so
    # they hold stage 0 of replicas 0 and 1 (one EP group) in the mapped run
    assert [r["slot"] for r in same] == [0, 2, 1, 3]
    assert [r["slot"] for r in mixed] == [0, 1, 2, 3]


def test_upgrades_to_and_from_synthesized_orders_switch_at_their_steps(runs):
    from tessera.program.compiler import compile_plan
    from tessera.program.plan import Plan

    run = runs["interleaved"]
    template, syn, other = run["plans"]
    # the plans: the template's order (no "schedule" key), and two synthesized orders
    assert not template.synthesized and "schedule" not in template.to_dict()
    assert syn.synthesized and syn.partition == template.partition and syn.schedule != template.schedule
    assert other.synthesized and other.partition.bounds == OTHER != template.partition.bounds
    assert compile_plan(syn) != compile_plan(replace(syn, schedule=()))  # another order, not the template's
    d = run["driver"]
    assert d.history.at(0).plan == json.loads(json.dumps(template.to_dict()))
    assert run["answers"] == [{"version": 1, "effective_step": 2}, {"version": 2, "effective_step": 3},
                              {"version": 3, "effective_step": 4}]
    for v, p in ((1, syn), (2, other), (3, template)):  # the versions keep each plan's order (JSON round trip)
        assert Plan.from_dict(d.history.at(v).plan) == p
        assert ("schedule" in d.history.at(v).plan) == p.synthesized
    # every rank switched before steps 2, 3, 4; rank 0 confirmed each; the grouped run never did
    assert [r["confirmed"] for r in run["ranks"]] == [[[1, 2], [2, 3], [3, 4]], [], [], []]
    rows = run["rows"]
    assert [r["plan_version"] for r in rows] == [0, 1, 2, 3]
    assert [r["plan_switch_from"] for r in rows] == [None, 0, 1, 2]
    moved = [r["plan_switch_moved_bytes"] for r in rows]
    assert moved[1] == 0 and moved[2] > 0 and moved[3] > 0  # the same partition moves nothing; OTHER moves layers
    assert [r["plan_version"] for r in runs["grouped"]["rows"]] == [0] * STEPS


def test_both_runs_train_bitwise_alike(runs):
    """Remapped and upgraded through three versions, the job trains as the planned, never
    upgraded one: the same losses step by step and bitwise the same final checkpoint."""
    from local_job import assert_parts_equal

    from tessera.train.worker import checkpoint as ckpt

    same, mixed = runs["grouped"], runs["interleaved"]
    assert [r["step"] for r in same["rows"]] == [r["step"] for r in mixed["rows"]] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in mixed["rows"]] == [r["loss"] for r in same["rows"]]
    a, b = ckpt.latest_complete(same["run_dir"]), ckpt.latest_complete(mixed["run_dir"])
    assert a.step == b.step == STEPS
    assert_parts_equal(a.path, b.path, 4)
