"""The dynamic bubble optimizer in the real training job, and token counts from the real router.

The tiny recipe (4 gloo workers, pp=2 x dp=2, ep=2, vpp=2 as shipped, cut to 4 layers and 32-token
sequences for time; planned without the host cost of deferred W, see ``NO_W_HOST_COST``): 3 steps
with ``dbo.enabled`` true (zipf routing at skew 1.3), by the worker loop of a job on local gloo
ranks (tests/local_job.py) on the plan of a driver built in this process, and, as a Ray Train job
on the run's shared Ray head (tests/conftest.py), 5 steps of a job started with the optimizer off
and switched on live after step 1 (``upgrade_dbo``, what ``tessera upgrade --dbo on`` sends; on from step 3; planned with
the cpu preset's host cost of a deferred W, as a user's job, so its first plan keeps W inside B
and the switch splits W), which then
predicts from live router counts (``dbo.routing=router``: each EP group exchanges its routers'
counts over the all-gather transport every iteration); the same 5 steps with ``dbo.enabled``
false on the first job's plan, by the same worker loop on local gloo ranks.
Losses must be bitwise equal (W of a parameter run in microbatch order either way); with the
optimizer on, ``metrics.jsonl`` carries the ``dbo_*`` fields and slots were filled; switched on
live, it moves W units on every following step and only then is the fill rate above 0; with live
counts every EP peer received the same counts (equal digests), each (mb, layer) row holding the
EP group's ``ep * micro_batch_size * seq_length * top_k`` routes. The recorder
(:func:`tessera.train.profile.routes.record_router_counts`) runs a real forward pass of the tiny
model on the ``pydoc`` corpus: every (microbatch, MoE layer) row sums to
``ep * micro_batch_size * seq_length * top_k``, the file it writes is what ``dbo.routing:
recorded`` reads, and the pre-flight and the driver accept it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessera.config.load import load_recipe
from tessera.dbo.counts import recorded_counts
from tessera.errors import TesseraConfigError

pytestmark = pytest.mark.xdist_group("ray-dbo")  # on the run's shared Ray head (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
SMALL = ("model.num_layers=4", "parallel.seq_length=32")  # the tiny recipe, quicker
# The CPU preset's measured host cost of a deferred W GEMM (hardware.deferred_w_us, 120 us) makes
# every W of this tiny model longer than any slot skewed routing leaves (and the planner then keeps
# W inside B: nothing is movable), so the optimizer rightly moves none; both jobs plan without
# that cost, so W are split, fit the slots and fill them.
NO_W_HOST_COST = ("hardware.inline.deferred_w_us=0",)
JOB = ("job.cpus_per_worker=0.25", "job.max_failures=0", "job.pg_timeout_s=120", "logging.wandb_mode=disabled",
       "train.checkpoint_every=0")
SKEW = ("dbo.routing=zipf", "dbo.skew_target=1.3", "dbo.seed=1")
LIVE = ("dbo.routing=router", "dbo.transport=auto")
STEPS = 3
LIVE_STEPS = 5  # the job whose optimizer is switched on live: 2 steps without it, 3 with it


def _rows(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if "event" not in r]


# --------------------------------------------------------------------------- recorder (no Ray)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from tessera.train.profile.routes import main

    recipe = load_recipe(TINY, [*SMALL, *NO_W_HOST_COST])
    out = tmp_path_factory.mktemp("counts") / "counts.json"
    assert main([TINY, *SMALL, *NO_W_HOST_COST, "--steps", "2", "--out", str(out)]) == 0
    return recipe, out


def test_recorder_counts_sum_to_tokens_times_top_k(recorded):
    from tessera.config.resolve import resolve_model

    recipe, out = recorded
    counts = recorded_counts(out)
    model = resolve_model(recipe)
    moe = [l for l in model.layers if getattr(l.mlp, "kind", None) == "moe"]
    p = recipe.parallel
    assert counts.layers == tuple(l.index for l in moe) and counts.num_experts == moe[0].mlp.num_experts
    assert counts.num_microbatches == 2 * p.num_microbatches
    per = p.ep * p.micro_batch_size * p.seq_length * moe[0].mlp.top_k
    assert all(sum(row) == per for rows in counts.counts for row in rows)
    assert len({row for rows in counts.counts for row in rows}) > 1  # real routing, not a uniform table
    assert "router" in counts.source


def test_recorded_counts_are_accepted_by_preflight_and_the_driver(recorded, tmp_path):
    from tessera.flow import resolve
    from tessera.program.instructions import Program
    from tessera.train.dbo.table import table_from_dict
    from tessera.train.job.driver import Driver
    from tessera.train.job.preflight import check_memory

    recipe, out = recorded
    r = recipe.with_overrides(["dbo.enabled=true", "dbo.routing=recorded", f"dbo.counts_path={out}"])
    assert len(check_memory(resolve(r))) == 2
    d = Driver(r.to_dict(), str(tmp_path), "rec")
    assert d.error is None, d.error
    got = d.get_program(0)
    assert got["dbo"]["rank"] == 0 and got["dbo"]["slots"] and got["dbo"]["tasks"]
    assert any(i["op"] == "slot" for i in got["program"]["instructions"])
    program = Program.from_dict(got["program"])
    assert table_from_dict(json.loads(json.dumps(got["dbo"])), program) == d.dbo_tables[0]  # plain values
    with pytest.raises(ValueError, match="is for pipeline rank 0, the Program for rank 1"):
        table_from_dict(got["dbo"], Program.from_dict(d.get_program(1)["program"]))

    few = tmp_path / "few.json"
    c = recorded_counts(out)
    few.write_text(type(c)(c.layers, c.num_experts, c.counts[:1], "one mb").to_json())
    bad = recipe.with_overrides(["dbo.enabled=true", "dbo.routing=recorded", f"dbo.counts_path={few}"])
    with pytest.raises(TesseraConfigError, match=r"dbo.counts_path=.*few.json.*hold 1 microbatches"):
        check_memory(resolve(bad))


# --------------------------------------------------------------------------- the Ray Train job


@pytest.fixture(scope="module")
def jobs(ray_cluster, tmp_path_factory):
    """On with live router counts: a Ray Train job; on (zipf counts) and off (the same training
    on the "on" run's plan): the same worker loop on local gloo ranks (tests/local_job.py; a
    second and third Ray job would prove nothing more about Ray than the live one does), each a
    ``SimpleNamespace`` of its rows (as the job's ``metrics.jsonl`` would hold them) and its
    run directory."""
    from local_job import run_local_job
    from tessera.train.job.driver import Driver
    from tessera.train.job.run import run_job
    from tessera.train.upgrade.versions import load_history

    out = tmp_path_factory.mktemp("runs")
    base = load_recipe(TINY, [*SMALL, *NO_W_HOST_COST, *JOB, f"train.steps={STEPS}", f"logging.out_dir={out}"])
    from tessera.train.worker.hooks import HookSpec

    on = base.with_overrides(["dbo.enabled=true", *SKEW, "job.run_name=dbo-on"])
    on_dir = str(out / "dbo-on")
    on_driver = Driver(on.to_dict(), on_dir, "dbo-on")
    assert on_driver.error is None, on_driver.error
    results = {"on": SimpleNamespace(rows=run_local_job(on, on_dir, on_driver), run_dir=on_dir)}
    # off at the start; after step 1 switched on live (tessera upgrade --dbo on), by the driver's rule with
    # the router's live counts; a lead of one step
    # with the cpu preset's host cost of a deferred W, as a user's job: its plan keeps W inside B, and the
    # switch splits W (so the optimizer has W to move)
    live = load_recipe(TINY, [*SMALL, *JOB, f"logging.out_dir={out}", "dbo.enabled=false", "dbo.transport=auto",
                              "job.upgrade_lead_steps=1", f"train.steps={LIVE_STEPS}", "job.run_name=dbo-live"])
    results["live"] = run_job(live, progress=False,
                              hooks=(HookSpec("tessera.testing.upgrades:requests_at",
                                              {"actions": [[1, "upgrade_dbo", True]]}),))
    off = base.with_overrides(["dbo.enabled=false", "job.run_name=dbo-off", f"train.steps={LIVE_STEPS}"])
    plan = load_history(on_dir).at(0).plan
    local_dir = str(out / "dbo-off")
    results["off"] = run_local_job(off, local_dir, Driver(off.to_dict(), local_dir, "dbo-off", plan_dict=plan))
    return results


def _ran(job, extra, host_cost: bool = False):
    """What job ``job`` (its recipe: the module's plus ``extra``) ran with the optimizer: its recipe,
    the plan's slot-annotated Programs as the driver compiles them (the plan read back from the run's
    ``plan_history.json``), the costs, the recipe's token counts (the prior with live counts) and
    the rank tables with their W units (:func:`tessera.train.dbo.table.dbo_tables`)."""
    from tessera.flow import build_costs, compile_programs, resolve
    from tessera.program.plan import Plan
    from tessera.sim.dbo import recipe_counts
    from tessera.train.dbo.table import dbo_tables
    from tessera.train.upgrade.versions import load_history

    recipe = load_recipe(TINY, [*SMALL, *(() if host_cost else NO_W_HOST_COST), "dbo.enabled=true", *extra])
    res = resolve(recipe)
    costs = build_costs(res)
    version = load_history(job.run_dir).running()  # the last: the one with the optimizer on
    assert version.dbo
    programs = compile_programs(Plan.from_dict(version.plan), costs)
    prior = recipe.with_overrides(["dbo.routing=uniform"]) if recipe.dbo.routing == "router" else recipe
    return recipe, programs, costs, recipe_counts(prior, costs, res.model), dbo_tables(recipe, programs, costs,
                                                                                        res.model)


def _w_tasks(programs, dp: int) -> tuple[int, int]:
    """(W tasks of an iteration over the job's ranks, those with no annotated slot between their
    ``register_w`` and their ``W``): each pipeline rank's Program runs on ``dp`` ranks."""
    from tessera.program.instructions import Op

    total = unslotted = 0
    for prog in programs:
        ins = prog.instructions
        reg = {(x.chunk, x.mb): i for i, x in enumerate(ins) if x.op == Op.REGISTER_W}
        dead = {(x.chunk, x.mb): i for i, x in enumerate(ins) if x.op == Op.W}
        slots = [i for i, x in enumerate(ins) if x.op == Op.SLOT and x.cause]
        total += len(reg)
        unslotted += sum(1 for k, i in reg.items() if not any(i < s < dead[k] for s in slots))
    return total * dp, unslotted * dp


def test_losses_bitwise_equal_with_the_optimizer_on_and_off(jobs):
    off, on = jobs["off"], jobs["on"].rows
    assert [r["step"] for r in on] == [r["step"] for r in off[:STEPS]] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in off)
    assert [r["loss"] for r in on] == [r["loss"] for r in off[:STEPS]]


def test_metrics_carry_the_optimizer_fields(jobs):
    for r in jobs["off"][:STEPS]:
        assert r["dbo_slots"] is None and r["dbo_tasks_moved"] is None and r["bubble_fill_rate"] == 0.0
    rows = jobs["on"].rows
    # The policy decides from predictions only (the recipe's zipf counts, the same every iteration;
    # reset each iteration), so every iteration's counts are those of the simulator running the
    # same rule on the job's Programs, costs and counts (JointDBOPolicy and simulate_dbo, split W
    # units), summed over the pp x ep ranks: slots reached, units moved, and chunk W still pending
    # at their W instruction (forced; some, not all: slots left W to force, moves drained others).
    from tessera.sim.dbo import simulate_dbo
    from tessera.train.dbo.table import UNIT_GRANULARITY

    recipe, programs, costs, counts, _ = _ran(jobs["on"], SKEW)
    d = recipe.dbo
    sim = simulate_dbo(programs, costs, counts, recipe.parallel.ep, margin=d.margin, pool_mem_gb=d.pool_mem_gb,
                       unit=UNIT_GRANULARITY)
    total, unslotted = _w_tasks(programs, recipe.parallel.dp)
    assert 0 < unslotted <= sim.forced < total and sim.at_once == 0, (unslotted, sim.forced, total)
    for r in rows:
        assert r["dbo_slots"] > 0 and r["dbo_tasks_moved"] > 0, r
        assert r["dbo_pred_fill_rate"] > 0 and r["bubble_fill_rate"] > 0, r
        assert (r["dbo_slots"], r["dbo_tasks_moved"], r["dbo_forced_deadline_runs"]) == (
            sim.slots, sim.moved, sim.forced), (r["step"], sim)
        assert r["dbo_pred_fill_rate"] == pytest.approx(sim.bubble_fill_rate, rel=1e-9)
        assert r["dbo_pool_mem_peak_gb"] > 0
        assert r["dbo_overhead_ms"] > 0 and r["dbo_slot_pred_err"] is not None


def test_live_router_counts_keep_losses_bitwise_and_agree_on_every_ep_peer(jobs):
    from tessera.engine.groups import Layout
    from tessera.train.upgrade.versions import load_history

    off, rows = jobs["off"], _rows(jobs["live"].metrics_path)
    assert [r["step"] for r in rows] == [r["step"] for r in off] == list(range(1, LIVE_STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in off]  # moving W never changes a value
    # switched on live after step 1 with a one-step lead: from step 3 on, with the router's live counts
    with open(jobs["live"].metrics_path) as f:
        switches = [e for e in map(json.loads, f) if e.get("event") == "plan_switch"]
    assert [e["step"] for e in switches] == [3], switches
    before, live = rows[:2], rows[2:]
    for r in before:  # no optimizer: nothing moved, nothing filled
        assert r["dbo_slots"] is None and r["dbo_tasks_moved"] is None and r["bubble_fill_rate"] == 0.0, r
    for r in live:  # it moves W units into slots on every step, and the fill rate is their measured time
        assert r["plan_version"] == 1 and r["dbo_tasks_moved"] > 0 and r["bubble_fill_rate"] > 0, r
        assert r["dbo_live_loads"] > 0, r
    recipe = load_recipe(TINY, [*SMALL, *NO_W_HOST_COST])
    p = recipe.parallel
    layout = Layout(p.pp, p.dp, p.ep)
    per_row = p.ep * p.micro_batch_size * p.seq_length * 2  # every rank's tokens, top-2 routes each
    # Forced deadline runs with live counts (which no one predicts ahead): every chunk W whose
    # register_w and W have no annotated slot between them is forced on every rank; a chunk W
    # leaves the count only when every unit of it ran in slots, so at most moved units / the
    # fewest units of a chunk W leave it; and each W instruction counts at most once.
    _, programs, _, _, tables = _ran(jobs["live"], LIVE, host_cost=True)
    first = load_history(jobs["live"].run_dir).at(0).plan
    assert first["split_w"] is False and load_history(jobs["live"].run_dir).running().plan["split_w"] is True
    total, unslotted = _w_tasks(programs, p.dp)
    per_task: dict = {}
    for t in tables:
        for u in t.units.units:
            per_task[(t.rank, u.chunk, u.mb)] = per_task.get((t.rank, u.chunk, u.mb), 0) + 1
    fewest = min(per_task.values())
    assert len(per_task) * p.dp == total and 0 < unslotted < total and fewest >= 1
    for r in live:
        digests = r["dbo_count_digests"]
        assert len(digests) == layout.world_size
        groups = {}
        for rank, d in enumerate(digests):
            groups.setdefault((layout.pipeline_rank(rank), layout.replica(rank) // p.ep), set()).add(d)
        assert all(len(g) == 1 for g in groups.values()), (r["step"], digests)  # the same counts on every peer
        assert len({d for g in groups.values() for d in g}) == len(groups)  # and other layers' on other groups
        # every rank: 4 microbatches x 2 own MoE layers, those routed after the last slot dropped
        assert 0 < r["dbo_count_rows"] <= layout.world_size * p.num_microbatches * 2
        assert r["dbo_count_tokens"] == r["dbo_count_rows"] * per_row
        assert r["dbo_live_loads"] == r["dbo_count_rows"] and r["dbo_count_exchange_ms"] > 0
        assert 0 < r["dbo_count_exchanges"] <= r["dbo_count_rows"]
        assert r["dbo_slots"] > 0 and r["dbo_slot_pred_err"] > -1  # the live counts predicted idle time (prior: 0)
        assert 0 <= r["bubble_fill_rate"] <= 1
        low = max(unslotted, total - r["dbo_tasks_moved"] // fewest)
        assert low <= r["dbo_forced_deadline_runs"] <= total, (r["step"], low, r["dbo_forced_deadline_runs"], total)
