"""``tessera status | upgrade | rollback`` against a real driver actor on a real local Ray.

The run's shared Ray head (tests/conftest.py: a dashboard, so the State API answers; other
modules' jobs may run on it at the same time), one driver actor for the tiny recipe started with
:func:`tessera.train.job.driver.start_driver` and no training workers (the step stays 0, so every
accepted version stays pending). The verbs run in-process through
:func:`tessera.cli.main.main` (they use the test's Ray connection), and once as a separate
``python -m tessera status`` process that connects by address with token authentication
(``--job`` given a submission id or a Ray job id is checked on the ``ray job submit`` job of
tests/test_train_ray.py). An unreachable ``--address`` is one line and exit code 2 (a separate
process, no Ray needed). The driver's job
runs ``train.steps=400`` while the CLI's ``--recipe`` is the shipped file (50 steps): a field that
cannot change a plan, ignored by the upgrade and reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessera.cli.main import main
from tessera.config.load import load_recipe
from tessera.errors import UpgradeRefused
from tessera.testing.launch_local import free_port

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.xdist_group("ray-cli")  # on the run's shared Ray head (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
RUN, NAMESPACE = "cli-upgrade", "tessera"


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The run's shared Ray head (tests/conftest.py): a dashboard, so the State API answers."""
    return SimpleNamespace(gcs=ray_cluster.address, temp=ray_cluster.temp)


@pytest.fixture(scope="module")
def driver(cluster, tmp_path_factory):
    """The tiny recipe's driver actor (run :data:`RUN`), no workers; killed at the end."""
    from tessera.train.job.driver import start_driver

    recipe = load_recipe(TINY, ["train.steps=400"])
    handle, ready = start_driver(recipe, str(tmp_path_factory.mktemp("run")), RUN, namespace=NAMESPACE)
    yield SimpleNamespace(handle=handle, ready=ready, recipe=recipe)
    ray.kill(handle)


def _cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out.strip().splitlines(), err.strip().splitlines()


def _status(capsys, job: str = RUN) -> dict:
    rc, out, err = _cli(capsys, "status", "--job", job, "--json")
    assert rc == 0, err
    return json.loads("\n".join(out))


def _write(path: Path, doc) -> str:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_status_of_a_fresh_driver(driver, capsys):
    rc, out, err = _cli(capsys, "status", "--job", RUN)
    assert rc == 0 and not err, err
    text = "\n".join(out)
    assert f"tessera status: {RUN}" in text and "0 / 400" in text
    assert driver.ready["partition"] in text and "interleaved-1f1b" in text
    assert "plan versions" in text and "initial" in text
    s = _status(capsys)
    assert (s["run"], s["step"], s["total_steps"], s["plan_version"], s["pending_upgrade"]) == (RUN, 0, 400, 0, None)
    assert [(v["version"], v["source"]) for v in s["versions"]] == [(0, "initial")]
    assert len(s["versions"][0]["sha256"]) == 64 and s["last"] is None


def test_upgrade_refusals_and_rollback_through_the_cli(driver, capsys, tmp_path):
    from tessera.train.job.client import DriverClient

    lead = 1 + max(1, driver.recipe.job.upgrade_lead_steps)  # no step reported yet: step 1 is the running one
    plan = ray.get(driver.handle.plan_dict.remote())["plan"]
    bounds = plan["partition"]["bounds"]  # tiny: [-1, 2, 4, 6, 9]
    moved = dict(plan, partition={"bounds": [bounds[0], bounds[1] + 1, *bounds[2:]]}, pair_orders=[])
    new_file = _write(tmp_path / "plan.json", {"plan": moved})  # shaped as tessera plan writes it

    # the running plan again (as a `tessera plan --compare` baseline would name it): no change, no version
    same = _write(tmp_path / "same.json", {"plan": dict(plan, name="baseline")})
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--plan", same)
    assert rc == 0 and not err, err
    assert out == [f"tessera upgrade: {RUN}: no change: plan equals running version 0 (plan {same})"]
    assert len(_status(capsys)["versions"]) == 1

    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--plan", new_file)
    assert rc == 0 and not err, err
    assert out == [f"tessera upgrade: {RUN}: plan version 1 takes effect at step {lead} (plan {new_file})"]
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--plan", new_file)  # the pending version's plan
    assert rc == 0 and not err, err
    assert out == [f"tessera upgrade: {RUN}: no change: plan equals version 1 (pending, takes effect at step {lead}) "
                   f"(plan {new_file})"]
    s = _status(capsys)
    assert s["pending_upgrade"] == {"version": 1, "effective_step": lead} and s["plan_version"] == 0
    v1 = s["versions"][1]
    assert (v1["source"], v1["effective_step"], v1["applied"]) == ("plan", lead, False)
    assert v1["partition"] == "S0[emb,0-2] S1[3] S2[4-5] S3[6-7,head]" != s["versions"][0]["partition"]

    # refused: another pp (driver side), JSON garbage and no plan (client side); one line, exit 2
    for doc, words in ((dict(moved, pp=4), ("plan.pp=4", "parallel.pp=2")), ("{not json", ("--plan=", "is not JSON")),
                       ({"recipe": {}}, ("--plan=", "holds no plan"))):
        rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--plan", _write(tmp_path / "bad.json", doc))
        assert rc == 2 and not out and len(err) == 1, (out, err)
        assert err[0].startswith("tessera upgrade: error: ") and all(w in err[0] for w in words), err
    # the autopilot of a job started without it: nothing to act on, one line (the RPC over Ray); no version
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--autopilot", "on")
    assert rc == 2 and not out and len(err) == 1 and err[0].startswith(
        "tessera upgrade: error: autopilot='on': has no estimates to act on"), (out, err)
    st = _status(capsys)
    assert st["autopilot"]["enabled"] is False and len(st["versions"]) == 2
    # the driver's own refusal of text that is no plan comes back as UpgradeRefused, not Ray's wrapper
    client = DriverClient.open(RUN, NAMESPACE)
    with pytest.raises(UpgradeRefused, match="cannot be parsed") as e:
        client._call("upgrade_plan", "{not json")
    assert type(e.value) is UpgradeRefused and e.value.field == "plan"

    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--dbo", "on")
    assert rc == 0 and not err, err
    assert out == [f"tessera upgrade: {RUN}: plan version 2 takes effect at step {lead + 1} (bubble optimizer on)"]
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--dbo", "on")
    assert rc == 2 and len(err) == 1 and "dbo='on': is already on in version 2" in err[0], err

    # rollbacks walk back: v2 -> v1 -> v0 (not back to v2), then nothing is left; --to goes anywhere
    for version, target in ((3, 1), (4, 0)):
        rc, out, err = _cli(capsys, "rollback", "--job", RUN)
        assert rc == 0 and not err, err
        assert out == [f"tessera rollback: {RUN}: plan version {version} takes effect at step {lead + version - 1} "
                       f"(rollback to v{target})"]
    rc, out, err = _cli(capsys, "rollback", "--job", RUN)
    assert rc == 2 and not out and len(err) == 1, (out, err)
    assert "rollback=4: has no earlier version with another plan to go back to (version 4 re-applies v0; the path " \
           "back: v0)" in err[0], err
    rc, out, err = _cli(capsys, "rollback", "--job", RUN, "--to", "2")
    assert rc == 0 and not err, err
    assert out == [f"tessera rollback: {RUN}: plan version 5 takes effect at step {lead + 4} (rollback to v2)"]
    rc, out, err = _cli(capsys, "rollback", "--job", RUN, "--to", "9")
    assert rc == 2 and len(err) == 1 and "rollback --to=9: plan version 9 does not exist (versions 0-5)" in err[0], err
    s = _status(capsys)
    v = s["versions"]
    assert [(x["version"], x["source"], x["dbo"], x["rollback_of"]) for x in v] == [
        (0, "initial", False, None), (1, "plan", False, None), (2, "dbo", True, None), (3, "rollback", False, 1),
        (4, "rollback", False, 0), (5, "rollback", True, 2)]
    assert v[3]["sha256"] == v[1]["sha256"] and v[3]["partition"] == v1["partition"]
    assert v[4]["sha256"] == v[0]["sha256"] and v[5]["sha256"] == v[2]["sha256"]
    assert s["lineage"] == [2, 1, 0]  # from version 5 (= v2), rollbacks would walk to v1, then v0
    rc, out, _ = _cli(capsys, "status", "--job", RUN)
    table = "\n".join(out)
    assert "rollback of v1" in table and "rollback of v0" in table and v[2]["sha256"][:12] in table
    assert "version 1 at step" in table

    # --recipe: a bad value fails on the client; a field the running job cannot change on the driver,
    # named with both values, and train.steps (the job runs 400, the file says 50) is no reason to refuse
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--recipe", TINY, "parallel.ep=3")
    assert rc == 2 and len(err) == 1 and "parallel.ep=3" in err[0] and "8 experts" in err[0], err
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--recipe", TINY, "parallel.micro_batch_size=4")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("tessera upgrade: error: recipe.parallel.micro_batch_size=4: ") and \
        "parallel.micro_batch_size: running=2 new=4" in err[0] and "train.steps" not in err[0], err
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "parallel.vpp=1", "--dbo", "off")
    assert rc == 2 and len(err) == 1 and "overrides apply to --recipe only" in err[0], err
    assert len(_status(capsys)["versions"]) == 6  # nothing refused was recorded

    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--recipe", TINY, "planner.template=1f1b", "parallel.vpp=1")
    assert rc == 0 and not err, err
    assert out == [f"tessera upgrade: {RUN}: plan version 6 takes effect at step {lead + 5} "
                   f"(recipe {TINY} planner.template=1f1b parallel.vpp=1)",
                   f"tessera upgrade: {RUN}: ignored by the upgrade (apply at the next start): "
                   "train.steps: running=400 new=50"]
    v6 = _status(capsys)["versions"][6]
    assert (v6["source"], v6["template"], v6["vpp"], v6["dbo"]) == ("recipe", "1f1b", 1, False)
    # the same recipe with the job's steps: re-planned to the same Programs, nothing ignored, no version
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--recipe", TINY, "planner.template=1f1b", "parallel.vpp=1",
                        "train.steps=400")
    assert rc == 0 and not err, err
    assert out == [f"tessera upgrade: {RUN}: no change: plan equals version 6 (pending, takes effect at step "
                   f"{lead + 5}) (recipe {TINY} planner.template=1f1b parallel.vpp=1 train.steps=400)"]
    s = _status(capsys)
    assert len(s["versions"]) == 7 and s["lineage"] == [6, 2, 1, 0]  # the upgrade continues from v5 (= v2)


def test_upgrade_recipe_replans_on_the_driver(driver, capsys):
    before = len(_status(capsys)["versions"])
    rc, out, err = _cli(capsys, "upgrade", "--job", RUN, "--recipe", TINY, "planner.overlap=false", "train.steps=400")
    assert rc == 0 and not err, err
    assert len(out) == 1 and out[0].startswith(f"tessera upgrade: {RUN}: plan version {before} takes effect at step ")
    assert out[0].endswith(f"(recipe {TINY} planner.overlap=false train.steps=400)")
    assert _status(capsys)["versions"][-1]["source"] == "recipe"


def test_unknown_job_is_one_line_naming_the_running_drivers(driver, capsys):
    for verb in (["status"], ["rollback"], ["upgrade", "--dbo", "off"]):
        rc, out, err = _cli(capsys, *verb, "--job", "no-such-run")
        assert rc == 2 and not out and len(err) == 1, (out, err)
        # other modules' drivers may run on the shared head too: this one is among those named
        assert "--job='no-such-run'" in err[0] and f"{RUN} (namespace {NAMESPACE})" in err[0].split("running drivers: ")[1], err
    # a run name in another namespace is not found there
    rc, _, err = _cli(capsys, "status", "--job", RUN, "--namespace", "elsewhere")
    assert rc == 2 and "namespace elsewhere" in err[0], err


def test_separate_process_connects_by_address_with_the_token(driver, cluster):
    env = dict(os.environ, RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-m", "tessera", "status", "--job", RUN, "--address", cluster.gcs, "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["run"] == RUN and s["plan_version"] == 0 and len(s["versions"]) >= 1


def test_a_client_without_the_token_is_refused_in_one_line(driver, cluster):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    p = subprocess.run([sys.executable, "-m", "tessera", "upgrade", "--job", RUN, "--address", cluster.gcs,
                        "--dbo", "on"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if not (Path.home() / ".ray" / "auth_token").exists():
        pytest.skip("this cluster runs without token authentication")
    assert p.returncode == 2, (p.stdout, p.stderr[-2000:])
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "RAY_AUTH_MODE=token" in lines[0], p.stderr[-2000:]


def test_unreachable_address_is_one_line_exit_2():
    p = subprocess.run([sys.executable, "-m", "tessera", "status", "--job", RUN, "--address", f"127.0.0.1:{free_port()}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and not p.stdout and len(err) == 1, p.stderr[-2000:]
    assert err[0].startswith("tessera status: error: --address=") and "nothing accepts connections there" in err[0]
