"""Plan upgrades on the driver, without Ray: validation (a refused plan leaves the job as it was),
versions in order with their hashes and steps, rollback, the DBO switch, the history saved in the
run directory (a restarted driver comes back on the plan the workers run), and the switch step the
ranks agree on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.config.load import load_recipe
from tessera.errors import UpgradeRefused

pytestmark = pytest.mark.xdist_group("upgrade")  # module fixtures built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
PP2 = ["parallel.dp=1", "parallel.ep=1", "planner.overlap=false", "planner.split_w=false"]


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(TINY, PP2)


def _driver(recipe, run_dir, **kw):
    from tessera.train.job.driver import Driver

    d = Driver(recipe.to_dict(), str(run_dir), "r", **kw)
    assert d.error is None, d.error
    return d


def _moved(plan: dict, bounds) -> dict:
    """``plan`` with another partition (the pair orders are per stage: dropped)."""
    return dict(plan, partition={"bounds": list(bounds)}, pair_orders=[])


def test_upgrades_are_validated_versioned_in_order_and_saved(recipe, tmp_path):
    from tessera.train.upgrade.versions import load_history, plan_sha256

    d = _driver(recipe, tmp_path / "run")
    v0 = d.plan_dict()
    assert v0["plan_version"] == 0 and d.status()["versions"][0]["source"] == "initial"
    bounds = v0["plan"]["partition"]["bounds"]
    assert bounds[0] == -1 and bounds[-1] == 9 and len(bounds) == 5  # pp2 x vpp2 stages of 8 layers
    other = [-1, 1, 4, 6, 9] if bounds != [-1, 1, 4, 6, 9] else [-1, 2, 4, 7, 9]
    d.step = 3  # as if rank 0 had reported step 3
    first = d.upgrade_plan(json.dumps(_moved(v0["plan"], other)))
    assert first == {"version": 1, "effective_step": 3 + 1 + recipe.job.upgrade_lead_steps}  # step 4 runs
    # a second request at once: validated against version 1 and applied after it
    second = d.upgrade_dbo(True)
    assert second == {"version": 2, "effective_step": first["effective_step"] + 1}
    assert d.pending_versions() == [[1, 6], [2, 7]]
    status = d.status()
    assert status["plan_version"] == 0 and status["pending_upgrade"] == {"version": 1, "effective_step": 6}
    v1 = status["versions"][1]
    assert v1["partition"].startswith("S0[emb") and v1["sha256"] == plan_sha256(
        json.loads(json.dumps(d.history.at(1).plan)), False) and not v1["applied"]
    # the new version's Programs: another partition, and with the DBO the rank's table
    p1 = d.get_program(0, 1)
    assert p1["plan_shape"]["bounds"] == other and not p1["dbo_enabled"]
    assert d.get_program(1, 2)["dbo_enabled"] and "dbo" in d.get_program(1, 2)
    assert d.get_program(0)["plan_version"] == 0  # the running version until a worker confirms
    d.confirm_version(1, 7, {"from": 0, "moved_bytes": 123, "switch_s": 0.5})  # rank 0 learned late: step 7
    assert d.plan_version == 1 and d.history.at(1).effective_step == 7
    switch = [r for r in d.records if r.get("event") == "plan_switch"]
    assert switch == [dict(switch[0], step=7, from_version=0, plan_version=1, moved_bytes=123, switch_s=0.5)]
    saved = load_history(str(tmp_path / "run"))
    assert saved == d.history
    # a driver restarted now comes back on the version the workers run (no checkpoint holds it)
    again = _driver(recipe, tmp_path / "run")
    assert again.plan_version == 1 and again.plan.partition.bounds == tuple(other)
    assert again.pending_versions() == [[2, 7]]


def test_refused_plans_leave_the_job_untouched(recipe, tmp_path):
    d = _driver(recipe, tmp_path / "run")
    plan = d.plan_dict()["plan"]
    before = d.history
    cases = {
        "plan.pp": dict(plan, pp=4),
        "plan.partition": _moved(plan, [-1, 2, 4, 6, 8]),  # the head is missing
        "plan.num_microbatches": dict(plan, num_microbatches=8),
        "plan.template": dict(plan, template="zigzag"),
    }
    for field, bad in cases.items():
        with pytest.raises(UpgradeRefused) as e:
            d.upgrade_plan(json.dumps(bad))
        assert e.value.field == field and "fix:" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UpgradeRefused, match="not JSON"):
        d.upgrade_plan("{not json")
    with pytest.raises(UpgradeRefused, match="needs a version before the newest"):
        d.rollback()
    with pytest.raises(UpgradeRefused, match="already off"):
        d.upgrade_dbo(False)
    assert d.history == before and d.pending_versions() == []
    assert [r["field"] for r in d.records if r.get("event") == "plan_refused"] == [
        "plan.pp", "plan.partition", "plan.num_microbatches", "plan.template", "plan", "rollback", "dbo"]


def test_a_plan_over_memory_is_refused(recipe, tmp_path):
    from tessera.config.resolve import resolve_hardware
    from tessera.flow import compile_programs
    from tessera.program.memory import rank_memory_bytes
    from tessera.program.plan import Plan

    d = _driver(recipe, tmp_path / "a")
    plan = d.plan_dict()["plan"]
    lopsided = _moved(plan, [-1, 5, 6, 7, 9])  # six layers and the embedding on stage 0 (rank 0)
    peak_now = max(rank_memory_bytes(d.programs, d.costs))
    peak_lop = max(rank_memory_bytes(compile_programs(Plan.from_dict(lopsided)), d.costs))
    assert peak_lop > peak_now
    mem_gb = (peak_now + peak_lop) / 2 / 1e9 / (1 - recipe.planner.memory_margin)  # between the two
    tight = recipe.with_overrides([f"hardware.inline.mem_gb={mem_gb!r}"])
    assert resolve_hardware(tight).mem_gb == pytest.approx(mem_gb)
    d = _driver(tight, tmp_path / "b", plan_dict=plan)
    with pytest.raises(UpgradeRefused, match=r"needs .* GB on pipeline rank 0, over the capacity") as e:
        d.upgrade_plan(json.dumps(lopsided))
    assert e.value.field == "plan.partition" and d.pending_versions() == []


def test_rollback_reapplies_the_previous_version(recipe, tmp_path):
    d = _driver(recipe, tmp_path / "run")
    plan = d.plan_dict()["plan"]
    d.upgrade_plan(json.dumps(_moved(plan, [-1, 1, 3, 5, 9])))
    d.upgrade_dbo(True)
    back = d.rollback()  # back to version 1: its plan, without the DBO
    v = d.history.at(back["version"])
    assert back["version"] == 3 and v.source == "rollback" and v.rollback_of == 1
    assert v.plan == d.history.at(1).plan and v.dbo is False and v.sha256 == d.history.at(1).sha256


def test_recipe_upgrade_replans_on_the_driver_and_keeps_the_layout(recipe, tmp_path):
    d = _driver(recipe, tmp_path / "run")
    got = d.upgrade_recipe(json.dumps(recipe.with_overrides(["planner.template=1f1b", "parallel.vpp=1"]).to_dict()))
    v = d.history.at(got["version"])
    assert v.source == "recipe" and v.plan["template"] == "1f1b" and v.plan["vpp"] == 1
    with pytest.raises(UpgradeRefused) as e:
        d.upgrade_recipe(json.dumps(recipe.with_overrides(["parallel.micro_batch_size=4"]).to_dict()))
    assert e.value.field == "recipe.parallel.micro_batch_size"


def test_train_plan_flag_reads_a_plan_json_or_says_why_not(recipe, tmp_path):
    from tessera.cli.train import read_plan_file
    from tessera.errors import TesseraConfigError

    d = _driver(recipe, tmp_path / "run")
    plan = d.plan_dict()["plan"]
    doc = tmp_path / "plan.json"
    doc.write_text(json.dumps({"plan": plan, "programs": []}))  # as `tessera plan` writes it
    assert read_plan_file(str(doc)).to_dict() == plan
    (tmp_path / "bad.json").write_text("[1, 2]")
    for path, needle in ((tmp_path / "bad.json", "holds no plan"), (tmp_path / "missing.json", "cannot be read")):
        with pytest.raises(TesseraConfigError, match=needle) as e:
            read_plan_file(str(path))
        assert e.value.field == "--plan"
