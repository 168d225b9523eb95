"""``tessera plan`` through its CLI entry point, in this process: the same recipe on the same costs
gives the same ``plan.json`` content (its content hash) however slow the machine is, a wall-clock
cap that stops the search is reported in ``plan.json`` and the table, and a plan never replaces
another plan's outputs silently."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import tessera.flow as flow
from tessera.cli.main import main
from tessera.cli.plan import TIMING_FIELDS, check_out_before_writing, plan_content_hash
from tessera.errors import TesseraConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
QUIET = ["logging.trace=false", "logging.png=false", "--no-progress"]  # plan.json and the tables only
SLEEP_S = 0.02  # per simulated plan in the slowed run, really slept ...
VIRTUAL_S = 5.0  # ... and seen on the planner's clock (time.perf_counter): a machine 100x slower
ROOM = ["planner.search_time_s=86400"]  # the safety cap far above what the slowed run takes


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    """``tessera plan TINY ARGS`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main(["plan", TINY, *QUIET, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _row(text: str, label: str) -> str:
    """The value cell of the planner table's row ``label``."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"│ {label} ")]
    return line.split("│")[2].strip()


def _without_timing(doc: dict) -> dict:
    d = json.loads(json.dumps(doc))
    for section, key in TIMING_FIELDS:
        if isinstance(d.get(section), dict):
            d[section].pop(key)
    return d


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")  # the plan hash on one line


def test_a_slowed_evaluator_gives_the_same_plan(tmp_path, capsys, monkeypatch, wide):
    """The tiny recipe (overlap and split W ``auto``: four layouts searched, the fastest refined
    further) planned twice, the second time with every simulated plan 20 ms slower and 5 s later
    on the planner's clock (a planner that budgeted wall time, like the 30 s search of before,
    would stop after a few plans and record fewer evaluations): the search spends its budget in
    evaluations, so both give the same plan.json content and hash, with no wall-clock cap hit."""
    rc, fast_text, err = _plan(capsys, *ROOM, "--out", str(tmp_path / "fast"))
    assert rc == 0, err

    real, calls, late = flow.iteration_evaluator, [], [0.0]
    clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + late[0])

    def slowed(costs, capacity_bytes=None, validate=True):
        evaluate = real(costs, capacity_bytes, validate)

        def slow(plan):
            calls.append(plan)
            time.sleep(SLEEP_S)
            late[0] += VIRTUAL_S
            return evaluate(plan)

        return slow

    monkeypatch.setattr(flow, "iteration_evaluator", slowed)
    rc, slow_text, err = _plan(capsys, *ROOM, "--out", str(tmp_path / "slow"))
    assert rc == 0, err
    fast, slow = (json.loads((tmp_path / d / "plan.json").read_text()) for d in ("fast", "slow"))
    assert len(calls) >= 30  # every layout's search ran on the slowed evaluator
    assert slow["search"]["search_s"] >= VIRTUAL_S * slow["search"]["evaluations"] > 100  # it was slower ...
    assert _without_timing(slow) == _without_timing(fast)  # ... and planned the same
    assert slow["content_hash"] == fast["content_hash"] == plan_content_hash(slow)
    assert len(fast["content_hash"]) == 64
    assert slow["caps_hit"] == fast["caps_hit"] == [] and not slow["search"]["cap_hit"]
    assert not slow["milp"]["cap_hit"] and not slow["partition_bound"]["cap_hit"]
    assert slow["search"]["evaluations"] <= slow["search"]["max_evals"] <= 400
    for text in (fast_text, slow_text):
        assert _row(text, "plan hash") == fast["content_hash"]
        assert "wall cap hit" not in text


def test_a_wall_cap_that_stops_the_search_is_reported(tmp_path, capsys, wide):
    """``planner.search_time_s=0``: every layout's search stops after its starts, before its
    evaluation budget, and so does its schedule synthesis (the same cap); plan.json
    (``caps_hit``, ``search.cap_hit``) and the table say so."""
    rc, text, err = _plan(capsys, "planner.search_time_s=0", "--out", str(tmp_path / "capped"))
    assert rc == 0, err
    doc = json.loads((tmp_path / "capped" / "plan.json").read_text())
    assert doc["search"]["cap_hit"] and doc["search"]["evaluations"] < doc["search"]["max_evals"]
    caps = doc["caps_hit"]
    assert len(caps) == 8 and sorted(c.split(" (")[0] for c in caps) == ["search"] * 4 + ["synthesis"] * 4, caps
    assert all(c.split(" (")[1].startswith("interleaved-1f1b vpp 2") for c in caps), caps
    row = _row(text, "wall cap hit")
    assert row.startswith("search (interleaved-1f1b vpp 2")
    assert "depends on the machine's load" in text and "planner.search_time_s=0" in text
    assert _row(text, "plan hash") == doc["content_hash"]


def _fake_profile(over: list[str]) -> None:
    """A profile of the tiny recipe in the cache ``over`` points to: every task at its analytic
    time (what ``tessera profile`` would store on a machine that matched the model exactly)."""
    from tessera.config.load import load_recipe
    from tessera.config.profile_rules import profile_cache_path, profile_fingerprint
    from tessera.cost.profile_cache import ProfileCache, ProfileItem
    from tessera.cost.profile_costs import PAIR_WITH_W_ITEM
    from tessera.flow import build_costs, resolve
    from tessera.train.profile.fit import analytic_medians

    recipe = load_recipe(TINY, over + ["planner.cost_source=profile"])
    res = resolve(recipe.with_overrides(["planner.cost_source=analytic"]))
    costs = build_costs(res)
    vals = analytic_medians(costs) | {"p2p": costs.p2p_ms, PAIR_WITH_W_ITEM: 0.0}
    ProfileCache(profile_cache_path(recipe)).put(profile_fingerprint(recipe, res.model, res.hardware),
                                                 [ProfileItem(k, v, v, v, 1, 0) for k, v in vals.items()])


def test_plans_on_other_costs_do_not_overwrite_each_other(tmp_path, capsys):
    """The analytic plan lands in ``logging.out_dir/<recipe name>``, the same recipe on its
    profile in ``<recipe name>-profile``; pointed at the first one's directory with ``--out``,
    the profile plan is refused in one line (exit 2, nothing written) unless ``--force``."""
    over = [f"logging.out_dir={tmp_path}", "planner.overlap=true", "planner.split_w=true", "--bound-time", "0"]
    rc, _, err = _plan(capsys, *over)
    assert rc == 0, err
    first = tmp_path / "tiny-qwen3-next" / "plan.json"
    first_bytes = first.read_bytes()
    doc = json.loads(first_bytes)
    assert doc["recipe"]["planner"]["cost_source"] == "analytic"

    _fake_profile([f"logging.out_dir={tmp_path}"])
    rc, _, err = _plan(capsys, *over, "planner.cost_source=profile")
    assert rc == 0, err
    second = tmp_path / "tiny-qwen3-next-profile" / "plan.json"
    assert json.loads(second.read_text())["recipe"]["planner"]["cost_source"] == "profile"
    assert first.read_bytes() == first_bytes  # the analytic plan is untouched

    rc, out, err = _plan(capsys, *over, "planner.cost_source=profile", "--out", str(first.parent))
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("tessera plan: error: --out=") and "holds another plan" in line
    for needle in ("cost source analytic", doc["content_hash"][:12], "--force"):
        assert needle in line, (needle, line)
    assert first.read_bytes() == first_bytes

    # the same recipe but another plan (other costs, or an edited file): refused before writing
    other = dict(doc, plan=dict(doc["plan"], name="edited"))
    other["content_hash"] = plan_content_hash(other)
    with pytest.raises(TesseraConfigError, match="holds another plan"):
        check_out_before_writing(str(first.parent), other, force=False)
    check_out_before_writing(str(first.parent), doc, force=False)  # the same plan again: written over

    rc, _, err = _plan(capsys, *over, "planner.cost_source=profile", "--out", str(first.parent), "--force")
    assert rc == 0, err
    assert json.loads(first.read_text())["recipe"]["planner"]["cost_source"] == "profile"
