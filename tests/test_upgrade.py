"""Plan upgrades on the driver, without Ray: validation (a refused plan leaves the job as it was; a
synthesized plan's own rank orders kept as sent, a broken one refused as ``plan.schedule``),
versions in order with their hashes and steps, "no change" for a plan the current version runs,
rollbacks that walk back and ``--to``, the recipe compared field by field, the DBO switch, the history saved in the
run directory (a restarted driver comes back on the plan the workers run), and the switch step the
ranks agree on."""

from __future__ import annotations

import json
import math
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
    with pytest.raises(UpgradeRefused, match="has no earlier version with another plan to go back to"):
        d.rollback()
    with pytest.raises(UpgradeRefused, match="already off"):
        d.upgrade_dbo(False)
    assert d.history == before and d.pending_versions() == []
    assert [r["field"] for r in d.records if r.get("event") == "plan_refused"] == [
        "plan.pp", "plan.partition", "plan.num_microbatches", "plan.template", "plan", "rollback", "dbo"]


def test_a_synthesized_plan_is_kept_as_sent_and_a_broken_order_is_refused(recipe, tmp_path):
    """A synthesized plan (its rank orders under ``schedule``) sent as JSON becomes a version
    that reads back equal and runs the plan's own Programs; a broken order (the compiler's
    shape check, the validator) is refused in one line naming ``plan.schedule``, and the job
    keeps the versions it had."""
    from dataclasses import replace

    from tessera.flow import plan_programs
    from tessera.program.instructions import Op
    from tessera.program.plan import Plan

    d = _driver(recipe.with_overrides(["planner.synthesis=false"]), tmp_path / "run")
    v0 = d.plan_dict()["plan"]
    syn, programs = plan_programs(recipe)  # planner.synthesis: true (the default)
    assert syn.synthesized and "schedule" not in v0 and list(syn.partition.bounds) == v0["partition"]["bounds"]
    text = json.dumps(syn.to_dict())
    assert d.upgrade_plan(text) == {"version": 1, "effective_step": 3}
    kept = d.history.at(1).plan
    assert Plan.from_dict(kept) == syn and kept["schedule"] == json.loads(text)["schedule"]
    assert [d.get_program(r, 1)["program"] for r in range(2)] == [p.to_dict() for p in programs]
    assert d.upgrade_plan(text)["no_change"]
    before = d.history
    s, r0 = syn.to_dict(), syn.schedule[0]
    first_b = next(i for i, ins in enumerate(r0) if ins.op == Op.B)
    broken = {
        "one rank's order": dict(s, schedule=s["schedule"][:1]),
        "a chunk vpp=2 has not": dict(s, schedule=[s["schedule"][0] + [{"op": "F", "mb": 0, "chunk": 2}],
                                                   s["schedule"][1]]),
        "a backward dropped": replace(syn, schedule=(r0[:first_b] + r0[first_b + 1:], syn.schedule[1])).to_dict(),
        "a forward run twice": replace(syn, schedule=(r0 + r0[:1], syn.schedule[1])).to_dict(),
    }
    rules = {"one rank's order": "needs one list per rank (pp=2)", "a chunk vpp=2 has not": "chunks 0..1 only",
             "a backward dropped": "compiles to invalid Programs", "a forward run twice": "compiles to invalid Programs"}
    for what, bad in broken.items():
        with pytest.raises(UpgradeRefused) as e:
            d.upgrade_plan(json.dumps(bad))
        msg = str(e.value)
        assert e.value.field == "plan.schedule" and msg.startswith("plan.schedule=") and rules[what] in msg, msg
        assert "fix:" in msg and "\n" not in msg, msg
    # nothing changed: version 1 still pending at its step, version 0 running
    assert d.history == before and d.pending_versions() == [[1, 3]] and d.get_program(0)["plan_version"] == 0
    assert [r["field"] for r in d.records if r.get("event") == "plan_refused"] == ["plan.schedule"] * 4


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


def test_rollbacks_walk_back_and_to_goes_to_any_version(recipe, tmp_path):
    d = _driver(recipe, tmp_path / "run")
    plan = d.plan_dict()["plan"]
    d.upgrade_plan(json.dumps(_moved(plan, [-1, 1, 3, 5, 9])))
    d.upgrade_dbo(True)
    assert d.history.lineage() == (2, 1, 0)
    back = d.rollback()  # back to version 1: its plan, without the DBO
    v = d.history.at(back["version"])
    assert back == {"version": 3, "effective_step": 5, "rollback_of": 1} and v.source == "rollback"
    assert v.rollback_of == 1 and v.plan == d.history.at(1).plan and v.dbo is False
    assert v.sha256 == d.history.at(1).sha256
    # again: on to version 0 (not back to 2), then nothing is left to go back to
    assert d.rollback() == {"version": 4, "effective_step": 6, "rollback_of": 0}
    assert d.history.at(4).sha256 == d.history.at(0).sha256 and d.history.lineage() == (0,)
    with pytest.raises(UpgradeRefused, match=r"version 4 re-applies v0; the path back: v0") as e:
        d.rollback()
    assert e.value.field == "rollback" and e.value.value == 4 and len(d.history.versions) == 5
    # --to: any version (a rollback of a rollback stands for the version it re-applies)
    assert d.rollback(2)["rollback_of"] == 2 and d.history.latest.dbo and d.history.lineage() == (2, 1, 0)
    assert d.rollback(3)["rollback_of"] == 1 and d.history.lineage() == (1, 0)
    assert d.rollback(6) == {"version": 6, "effective_step": 8, "no_change": True, "running": False, "rollback_of": 1}
    with pytest.raises(UpgradeRefused, match=r"plan version 9 does not exist \(versions 0-6\)") as e:
        d.rollback(9)
    assert e.value.field == "rollback --to"
    # an upgrade after rollbacks continues from there: a rollback then returns to version 1's plan
    d.upgrade_plan(json.dumps(_moved(plan, [-1, 2, 3, 6, 9])))
    assert d.history.latest.version == 7 and d.history.lineage() == (7, 1, 0)
    assert d.rollback()["rollback_of"] == 1
    # the path is derived from the saved versions: a restarted driver walks on from where this one was
    again = _driver(recipe, tmp_path / "run")
    assert again.history == d.history and again.status()["lineage"] == [1, 0]
    assert again.rollback()["rollback_of"] == 0


def test_a_plan_that_runs_what_the_current_version_runs_adds_no_version(recipe, tmp_path):
    from tessera.train.upgrade.versions import load_history

    d = _driver(recipe, tmp_path / "run")
    plan = d.plan_dict()["plan"]
    # the same plan, also under another provenance name and without its derived partition text
    for same in (plan, dict(plan, name="baseline"), dict(plan, partition={"bounds": plan["partition"]["bounds"]})):
        assert d.upgrade_plan(json.dumps(same)) == {"version": 0, "effective_step": 1, "no_change": True,
                                                    "running": True}
    assert len(d.history.versions) == 1 and load_history(str(tmp_path / "run")) == d.history
    moved = _moved(plan, [-1, 1, 3, 5, 9])
    assert d.upgrade_plan(json.dumps(moved)) == {"version": 1, "effective_step": 3}
    # the current version is the newest accepted one, here still pending
    assert d.upgrade_plan(json.dumps(moved)) == {"version": 1, "effective_step": 3, "no_change": True,
                                                 "running": False}
    # the running plan is no "no change" while another version is pending: it switches back
    assert d.upgrade_plan(json.dumps(plan)) == {"version": 2, "effective_step": 4}
    # the same partition with the optimizer on compiles to other Programs: a version
    # (this recipe plans without split W: switched on, the optimizer's version splits W, to have W to move)
    assert not plan["split_w"] and d.upgrade_dbo(True)["version"] == 3 and d.history.latest.plan["split_w"]
    from tessera.program.plan import Plan, with_split_w  # W split off the plan's own order, as the switch does

    assert d.upgrade_plan(json.dumps(with_split_w(Plan.from_dict(plan)).to_dict()))["no_change"]
    unchanged = [r for r in d.records if r.get("event") == "plan_unchanged"]
    assert [(r["source"], r["plan_version"]) for r in unchanged] == [("plan", 0)] * 3 + [("plan", 1), ("plan", 3)]
    assert len(d.history.versions) == 4
    assert d.upgrade_plan(json.dumps(plan))["version"] == 4  # W inside B again (with the optimizer on): a version


def test_recipe_upgrade_replans_on_the_driver_and_keeps_the_layout(recipe, tmp_path):
    job = recipe.with_overrides(["train.steps=400", "train.checkpoint_every=20"])
    d = _driver(job, tmp_path / "run")
    new = recipe.with_overrides(["planner.template=1f1b", "parallel.vpp=1", "logging.wandb_mode=disabled"])
    got = d.upgrade_recipe(json.dumps(new.to_dict()))
    v = d.history.at(got["version"])
    assert v.source == "recipe" and v.plan["template"] == "1f1b" and v.plan["vpp"] == 1
    assert got["ignored"] == ["train.steps: running=400 new=50", "train.checkpoint_every: running=20 new=0",
                              "logging.wandb_mode: running='offline' new='disabled'"]
    # the same again with the job's own steps: the same Programs, nothing ignored but the two left
    again = d.upgrade_recipe(json.dumps(new.with_overrides(["train.steps=400"]).to_dict()))
    assert again["no_change"] and again["version"] == v.version and len(again["ignored"]) == 2
    with pytest.raises(UpgradeRefused) as e:
        d.upgrade_recipe(json.dumps(recipe.with_overrides(["parallel.micro_batch_size=4"]).to_dict()))
    assert e.value.field == "recipe.parallel.micro_batch_size" and e.value.value == 4
    assert "parallel.micro_batch_size: running=2 new=4" in str(e.value) and "train.steps" not in str(e.value)


def test_recipe_fields_that_cannot_change_are_named_with_both_values(recipe):
    from tessera.train.upgrade.check import FIXED, IGNORED, REPLANNED, recipe_upgrade

    job = recipe.with_overrides(["train.steps=400"])
    new = recipe.with_overrides(["model.num_layers=4", "parallel.seq_length=32", "train.precision=bf16",
                                 "planner.template=1f1b", "parallel.vpp=1"])
    with pytest.raises(UpgradeRefused) as e:
        recipe_upgrade(job, new)
    msg = str(e.value)
    assert e.value.field == "recipe.model.num_layers" and e.value.value == 4 and "\n" not in msg
    assert "model.num_layers: running=0 new=4; parallel.seq_length: running=64 new=32; " \
           "train.precision: running='auto' new='bf16'" in msg
    assert "planner.template" not in msg and "train.steps" not in msg and "fix: keep the job's values" in msg
    # the recipe planned: the job's, with the new plan inputs; the ignored fields stay the job's
    ok = recipe.with_overrides(["planner.template=1f1b", "parallel.vpp=1", "hardware.inline.mem_gb=64",
                                "dbo.enabled=true", "dbo.margin=0.3", "job.max_failures=0"])
    up = recipe_upgrade(job, ok)
    assert [c.field for c in up.replanned] == ["parallel.vpp", "hardware.inline.mem_gb", "planner.template",
                                               "dbo.enabled"]
    assert [c.describe() for c in up.ignored] == ["dbo.margin: running=0.1 new=0.3", "train.steps: running=400 new=50",
                                                  "job.max_failures: running=3 new=0"]
    r = up.recipe
    assert (r.planner.template, r.parallel.vpp, r.hardware.inline["mem_gb"], r.dbo.enabled) == ("1f1b", 1, 64, True)
    assert (r.train.steps, r.dbo.margin, r.job.max_failures) == (400, 0.1, 3)
    assert {c.field for c in recipe_upgrade(job, job).replanned + recipe_upgrade(job, job).ignored} == set()
    assert (FIXED, REPLANNED, IGNORED) == ("fixed", "replanned", "ignored")


def test_every_recipe_field_has_an_upgrade_role():
    from tessera.config.load import recipe_from_dict
    from tessera.train.upgrade.check import FIELD_ROLES

    fields = {"name"} | {f"{sec}.{k}" for sec, body in recipe_from_dict({}).to_dict().items() if sec != "name"
                         for k in body}
    sections = {f.split(".")[0] for f in fields}
    for f in fields:  # an explicit role, the field's own or its section's (no fall-through to the default)
        assert f in FIELD_ROLES or f.split(".")[0] in FIELD_ROLES, f
    assert set(FIELD_ROLES) <= fields | sections  # no entry names a field the schema does not have
    assert not any(f.startswith("train.") and f not in FIELD_ROLES for f in fields)  # train: field by field


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


def test_a_restarted_driver_hands_out_the_records_its_old_incarnation_had(recipe, tmp_path, monkeypatch):
    """Every record reaches ``driver_records.jsonl`` as it arrives; an incarnation Ray restarted
    starts its list with them (a step the launcher had not read before the kill is not lost),
    then its ``driver_restart`` event; a driver of a new job starts the file afresh."""
    import tessera.train.job.driver as driver_mod

    run = tmp_path / "run"
    old = _driver(recipe, run)
    old.report(0, 1, {"loss": 5.5})
    old.report(1, 1, {"loss": 9.0})  # another rank's report: not a record
    old.report(0, 2, {"loss": float("nan")})
    kept = [json.loads(line) for line in (run / driver_mod.RECORDS_FILE).read_text().splitlines()]
    assert [r.get("step") for r in kept if "event" not in r] == [1, 2] and kept[0]["loss"] == 5.5
    monkeypatch.setattr(driver_mod, "_actor_restarted", lambda: True)
    new = _driver(recipe, run)
    assert json.dumps(new.records[:-1]) == json.dumps(kept) and math.isnan(new.records[1]["loss"])
    assert new.records[-1]["event"] == "driver_restart" and new.records[-1]["step"] == new.step
    got = new.records_since(0, old.incarnation)  # the launcher's pump reads the new list whole
    assert got["incarnation"] != old.incarnation and got["records"] is not new.records
    assert json.dumps(got["records"]) == json.dumps(new.records)
    monkeypatch.setattr(driver_mod, "_actor_restarted", lambda: False)
    fresh = _driver(recipe, run)
    assert fresh.records == [] and (run / driver_mod.RECORDS_FILE).read_text() == ""
