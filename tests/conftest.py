"""Shared fixtures of the test suite, and how pytest-xdist hands its tests to the workers.

The suite runs on 2 pytest-xdist workers (pyproject ``addopts``: ``-n 2 --dist loadgroup``;
``-n 0`` runs it in one process), with pytest and pytest-xdist pinned to versions where
``--dist loadgroup`` honours ``pytest.mark.xdist_group`` (pytest 9.2 does not: pytest-xdist issue
1386). A module whose tests share a module-scoped fixture (a gloo launch, a Ray job) carries
``pytestmark = pytest.mark.xdist_group(NAME)``, so its tests run on one worker and the fixture is
built once; :func:`pytest_collection_modifyitems` refuses a module that forgets it.

Modules that use Ray share one Ray head for the whole run (:func:`shared_ray_head`, joined per
module through :func:`ray_cluster`): the first worker
that needs it starts it (``ray start --head``, as on a cluster) under a file lock, the other
joins it, and the controller stops it when the run ends. Those modules are groups of their own,
so two of them can run at once, one per worker, on the same cluster; their groups (names starting
with :data:`FIRST_PREFIX`) are handed out first, then the other groups, then single tests.
tests/test_multinode.py runs a cluster of its own (a head and nodes it kills), in a group of that
prefix too.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

FIRST_PREFIX = "ray-"  # the suite's long poles: started first, one per worker
LONGEST_FIRST = ("ray-multinode", "ray-upgrade", "ray-dbo", "ray-train-faults", "ray-train", "ray-train-job",
                 "ray-train-profile", "ray-cli", "ray-counts")
"""The Ray groups by their measured time on this 2-core machine, longest first (so the two workers
end together); a group not listed comes after these."""
HEAD_CPUS = 8  # logical CPUs of the shared head: two jobs at once (workers ask 0.25 each)
HEAD_TIMEOUT_S = 2400  # a hang guard for the whole run's Ray part, not a time budget
RAY_BIN = str(Path(sys.executable).with_name("ray"))
HEAD_PORTS = ("port", "dashboard-port", "node-manager-port", "object-manager-port", "ray-client-server-port",
              "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
              "metrics-export-port")
STATE = "ray-head.json"


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def pytest_collection_modifyitems(config, items):
    """Groups named ``ray-*`` first, then the other groups, then single tests (stable: otherwise
    collection order); a module with a module-scoped fixture of its own needs an ``xdist_group``
    mark (otherwise each worker would build the fixture for its share of the tests)."""
    missing = set()
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures a test uses
        if _group(item) is not None or info is None:
            continue
        for defs in info.name2fixturedefs.values():
            d = defs[-1]
            if d.scope in ("module", "package") and getattr(d.func, "__module__", None) == item.module.__name__:
                missing.add(item.module.__name__)
    if missing:
        raise pytest.UsageError(f"{sorted(missing)}: a module-scoped fixture needs the module's tests on one worker; "
                                "add pytestmark = pytest.mark.xdist_group(<module name>)")

    def rank(item):
        g = _group(item)
        if g and g.startswith(FIRST_PREFIX):
            return (0, LONGEST_FIRST.index(g) if g in LONGEST_FIRST else len(LONGEST_FIRST))
        return (1, 0) if g else (2, 0)

    items.sort(key=rank)


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny GEMMs: avoids OpenMP oversubscription on shared CPUs)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --------------------------------------------------------------------------- the shared Ray head


def _shared_dir(config, tmp_path_factory) -> Path:
    """A folder every worker of this run sees (the run's base temp dir)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


def _free_ports(n: int) -> list[int]:
    from tessera.testing.launch_local import free_ports

    return free_ports(n)


def _start_head(shared: Path) -> dict:
    """``ray start --head --block`` with its own temp dir, ports and :data:`HEAD_CPUS`; returns
    its state (also written to ``shared/STATE``) once the dashboard's job server answers."""
    temp = tempfile.mkdtemp(prefix="tsr-head-", dir="/tmp")
    ports = dict(zip(HEAD_PORTS, _free_ports(len(HEAD_PORTS))))  # Ray needs them named; bound together
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # the jobs' `python`
    # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: on SIGTERM the head stops at once instead of
    # draining the node for up to 30 s
    env = dict(os.environ, RAY_TRAIN_ENABLE_PRINT_PATCH="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", PATH=path)
    env.pop("RAY_ADDRESS", None)
    cmd = [RAY_BIN, "start", "--head", "--block", "--num-cpus", str(HEAD_CPUS), "--temp-dir", temp,
           "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--disable-usage-stats",
           "--object-store-memory", str(256 * 1024 * 1024)]
    cmd += [x for name, port in ports.items() for x in (f"--{name}", str(port))]
    log_path = os.path.join(temp, "head.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
    token_file = Path.home() / ".ray" / "auth_token"
    deadline = time.monotonic() + 180
    while True:  # the job server answers once the dashboard is up (token auth is on in Ray 2.60)
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}: {Path(log_path).read_text()[-3000:]}")
        if time.monotonic() > deadline:
            _stop_head({"pid": proc.pid, "temp": temp})
            raise RuntimeError(f"the Ray head did not come up: {Path(log_path).read_text()[-3000:]}")
        try:
            headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"} if token_file.exists() else {}
            urllib.request.urlopen(urllib.request.Request(f"{dashboard}/api/version", headers=headers),
                                   timeout=5).read()
            if os.path.exists(os.path.join(temp, "ray_current_cluster")):  # written after the dashboard is up
                break
        except OSError:
            pass
        time.sleep(0.5)
    state = {"pid": proc.pid, "temp": temp, "dashboard": dashboard, "gcs_port": ports["port"], "log": log_path,
             "agent_port": ports["dashboard-agent-listen-port"], "started": time.time()}
    (shared / STATE).write_text(json.dumps(state))
    return state


JOB_AGENT_CAP_S = 900  # a hang guard for the wait below, not a time budget


def wait_for_job_agent(state: dict) -> float:
    """Wait until the head's dashboard agent, which runs submitted jobs, answers Ray's health
    check (``/api/healthz`` on its listen port: the raylet and the GCS answer it); until then the
    job server refuses a submission with "No available agent to submit job". The agent starts
    after the dashboard (on a loaded machine minutes after it), so only tests that submit jobs
    wait for it, each asking Ray. A head that exited ends the wait at once with its log; a cap of
    :data:`JOB_AGENT_CAP_S` guards against a hang. Returns the seconds waited."""
    url = f"http://127.0.0.1:{state['agent_port']}/api/healthz"
    token_file = Path.home() / ".ray" / "auth_token"
    t0 = time.monotonic()
    while True:
        try:
            headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"} if token_file.exists() else {}
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        if not _alive(state["pid"]):
            raise RuntimeError(f"the Ray head exited before its job agent answered: "
                               f"{Path(state['log']).read_text()[-3000:]}")
        if time.monotonic() - t0 > JOB_AGENT_CAP_S:
            raise RuntimeError(f"the Ray head's job agent did not answer {url} within {JOB_AGENT_CAP_S} s")
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def _stop_head(state: dict) -> None:
    """SIGTERM to ``ray start --block`` (it stops its Ray processes), then SIGKILL to what is left
    of its process group (its own session: only this head), and remove its temp dir."""
    pid = state["pid"]
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    shutil.rmtree(state["temp"], ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    """The controller (or the only process with ``-n 0``) stops the shared head, if one started."""
    if hasattr(session.config, "workerinput"):
        return
    base = getattr(session.config, "_tmp_path_factory", None)
    if base is None:
        return
    try:
        path = base.getbasetemp() / STATE
    except (OSError, ValueError):
        return
    if path.exists():
        state = json.loads(path.read_text())
        _stop_head(state)
        path.unlink()
        print(f"\nRay head stopped after {time.time() - state['started']:.0f} s", file=sys.stderr)


@pytest.fixture(scope="session")
def shared_ray_head(request, tmp_path_factory) -> dict:
    """The run's one Ray head, started by the first worker that needs it and joined by the other
    (stopped by the controller at the end: :func:`pytest_sessionfinish`); its state (``pid``,
    ``temp``, ``dashboard``, ``gcs_port``). A watchdog dumps every thread's stack and ends this
    process if its Ray tests hang past :data:`HEAD_TIMEOUT_S`."""
    pytest.importorskip("ray")
    from filelock import FileLock

    shared = _shared_dir(request.config, tmp_path_factory)
    with FileLock(str(shared / (STATE + ".lock"))):
        state_file = shared / STATE
        state = json.loads(state_file.read_text()) if state_file.exists() else _start_head(shared)

    def watchdog():  # pytest's capture suspended first, so the reason reaches the console before the exit
        capture = request.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=False)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(f"conftest: the Ray tests ran over {HEAD_TIMEOUT_S} s, stopping", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(HEAD_TIMEOUT_S, watchdog)
    timer.daemon = True
    timer.start()
    yield state
    timer.cancel()


@pytest.fixture(scope="module")
def ray_cluster(shared_ray_head):
    """This process connected to the run's shared Ray head for one module (disconnected after it,
    so no other module runs with a Ray connection in the process).

    ``address`` (GCS), ``dashboard`` (job server URL), ``temp`` (the head's temp dir), ``cli_env``
    (the environment for the ``ray`` CLI: ``RAY_AUTH_MODE=token`` when the head uses token
    authentication), ``wait_for_job_agent()`` (call it before submitting a job:
    :func:`wait_for_job_agent`).
    """
    import ray

    saved = {k: os.environ.get(k) for k in ("RAY_TRAIN_ENABLE_PRINT_PATCH", "RAY_ADDRESS")}
    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    os.environ.pop("RAY_ADDRESS", None)
    token_file = Path.home() / ".ray" / "auth_token"
    cli_env = dict(os.environ)
    if token_file.exists() and "RAY_AUTH_MODE" not in cli_env:
        cli_env["RAY_AUTH_MODE"] = "token"  # Ray 2.60: the job CLI sends the token only then
    try:
        # "auto" + the head's temp dir: Ray finds this head (not another on the machine) and, seeing
        # ~/.ray/auth_token, turns token auth on for this process
        ray.init(address="auto", _temp_dir=shared_ray_head["temp"], logging_level="ERROR", log_to_driver=False)
        address = ray.get_runtime_context().gcs_address
        assert address.endswith(f":{shared_ray_head['gcs_port']}"), (address, shared_ray_head)
        yield SimpleNamespace(address=address, dashboard=shared_ray_head["dashboard"], temp=shared_ray_head["temp"],
                              cli_env=cli_env, wait_for_job_agent=lambda: wait_for_job_agent(shared_ray_head))
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
