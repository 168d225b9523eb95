"""Launch a training job: ``python -m tessera.launch RECIPE [key=value ...]`` (and ``tessera train``).

Flow: load the recipe -> connect to Ray (``--address`` or ``RAY_ADDRESS``, as ``ray job submit``
sets it; otherwise start a local Ray) -> choose the run (a fresh ``<name>-<time>`` directory
under ``logging.out_dir``, or with ``train.resume=true`` the newest run of the recipe that has a
complete checkpoint) -> start the driver actor (plan + Programs) -> start the metrics pump (the
driver's records -> ``metrics.jsonl``, W&B, console) -> ``TorchTrainer.fit()`` -> summary.

Test-only fault injection (in the launcher's environment, once per run each):
``TESSERA_FAULT_AT=RANK:STEP`` makes world rank RANK kill its own process after step STEP;
``TESSERA_FAULT_IN_CHECKPOINT=RANK:STEP`` makes it kill itself while writing the checkpoint of
step STEP, after its part's other files and before its completeness marker.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from tessera.errors import TesseraConfigError
from tessera.train.driver import NAMESPACE

FAULT_ENV = "TESSERA_FAULT_AT"
CKPT_FAULT_ENV = "TESSERA_FAULT_IN_CHECKPOINT"


@dataclass(frozen=True)
class LaunchOptions:
    """Job options that are not part of the recipe.

    Attributes:
        run_name: fixed run name (default: chosen as described in the module docstring).
        namespace: Ray namespace of the driver actor.
        max_failures: worker-group restarts before the job fails.
        cpus_per_worker: CPUs per worker on CPU recipes (None: the cluster's CPUs shared evenly).
        detached_driver: the driver actor outlives the launcher (else the job owns it).
        keep_driver: do not kill the driver at the end (with ``detached_driver``: it stays up).
        progress: console progress; wandb_mode: override ``logging.wandb_mode``.
        fault: ``(rank, step)`` fault injection (default: from ``TESSERA_FAULT_AT``).
        checkpoint_fault: ``(rank, step)`` fault injection while writing a checkpoint (default:
            from ``TESSERA_FAULT_IN_CHECKPOINT``).
        pg_timeout_s: torch process-group timeout (a hung collective fails after this).
    """

    run_name: str | None = None
    namespace: str = NAMESPACE
    max_failures: int = 3
    cpus_per_worker: float | None = None
    detached_driver: bool = False
    keep_driver: bool = False
    progress: bool = True
    wandb_mode: str | None = None
    fault: tuple[int, int] | None = field(default=None)
    checkpoint_fault: tuple[int, int] | None = field(default=None)
    pg_timeout_s: float = 300.0


@dataclass(frozen=True)
class JobResult:
    """What a finished job left: its run, metric file, steps, final loss, worker-group starts,
    newest complete checkpoint, the checkpoint it resumed from, wall and planning seconds."""

    run_name: str
    run_dir: str
    metrics_path: str
    steps: int
    final_loss: float | None
    attempts: int
    checkpoint: str | None
    resumed_from: str | None
    wall_s: float
    plan_s: float = 0.0


def parse_fault(text: str | None, env: str = FAULT_ENV) -> tuple[int, int] | None:
    """``"RANK:STEP"`` (the value of ``env``) -> ``(rank, step)``; None/empty -> None."""
    if not text:
        return None
    try:
        rank, step = (int(x) for x in text.split(":"))
    except ValueError:
        raise TesseraConfigError(env, text, "must be RANK:STEP", f"e.g. {env}=1:7") from None
    return rank, step


def choose_run(recipe, out_root: str, run_name: str | None = None) -> str:
    """The run name (see the module docstring).

    Raises:
        TesseraConfigError: ``run_name`` names an existing run but ``train.resume`` is false.
    """
    from tessera.train.checkpoint import latest_complete

    if run_name:
        if os.path.isdir(os.path.join(out_root, run_name)) and not recipe.train.resume:
            raise TesseraConfigError("--run-name", run_name, f"already exists under {out_root}",
                                     "set train.resume=true to continue it, or choose another name")
        return run_name
    if recipe.train.resume:
        prefix = f"{recipe.name}-"
        runs = [n for n in os.listdir(out_root) if n.startswith(prefix)] if os.path.isdir(out_root) else []
        for name in sorted(runs, key=lambda n: os.path.getmtime(os.path.join(out_root, n)), reverse=True):
            if latest_complete(os.path.join(out_root, name)) is not None:
                return name
        print(f"tessera: train.resume=true but no run of {recipe.name!r} under {out_root} has a complete "
              "checkpoint; starting a fresh run", file=sys.stderr)
    name = f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    k = 1
    while os.path.exists(os.path.join(out_root, name)):
        name = f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}-{k}"
        k += 1
    return name


class MetricsPump:
    """Copies the driver's records into a :class:`~tessera.train.metrics.MetricsSink` from a
    background thread (every ``period_s``) and once more in :meth:`stop`. When Ray restarts the
    driver (a new incarnation with a new record list) it reads the new list from its start;
    records the old driver had not handed out yet are lost."""

    def __init__(self, driver, sink, period_s: float = 0.5) -> None:
        self.driver, self.sink, self.period_s = driver, sink, period_s
        self.count = 0
        self.incarnation: str | None = None
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tessera-metrics", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        import ray

        with self._lock:
            try:
                got = ray.get(self.driver.records_since.remote(self.count, self.incarnation), timeout=30)
            except Exception as e:  # noqa: BLE001 - a restarting driver: try again later
                print(f"tessera: metrics pump: {type(e).__name__}: {e}", file=sys.stderr)
                return
            if got["incarnation"] != self.incarnation:  # first read, or the driver restarted
                self.incarnation, self.count = got["incarnation"], 0
            new = got["records"]
            for rec in new:
                self.sink.write(rec)
            self.records.extend(new)
            self.count += len(new)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._drain()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self._drain()


def run_job(recipe, options: LaunchOptions = LaunchOptions()) -> JobResult:
    """Run the training job of ``recipe`` on the connected Ray cluster (``ray.init`` done).

    Raises:
        TesseraConfigError: bad recipe, not enough cluster resources, run-name clash.
        ray.train.TrainingFailedError: the workers failed more than ``max_failures`` times.
    """
    import ray

    from tessera.pipeline import resolve
    from tessera.train.checkpoint import latest_complete
    from tessera.train.driver import driver_name, start_driver
    from tessera.train.metrics import MetricsSink
    from tessera.train.trainer import TrainerOptions, build_trainer, check_resources, worker_resources
    from tessera.train.worker import WorkerConfig

    t0 = time.perf_counter()
    resolve(recipe)  # value rules first, before anything starts
    if recipe.parallel.tp != 1:
        raise TesseraConfigError("parallel.tp", recipe.parallel.tp, "must be 1 for training (the engine has no "
                                 "tensor parallelism yet)", "set parallel.tp=1")
    out_root = os.path.abspath(recipe.logging.out_dir)
    run_name = choose_run(recipe, out_root, options.run_name)
    run_dir = os.path.join(out_root, run_name)
    resources = worker_resources(recipe, ray.cluster_resources(), options.cpus_per_worker)
    check_resources(recipe, ray.cluster_resources(), resources)
    fault = options.fault or parse_fault(os.environ.get(FAULT_ENV))
    ckpt_fault = options.checkpoint_fault or parse_fault(os.environ.get(CKPT_FAULT_ENV), CKPT_FAULT_ENV)
    driver, ready = start_driver(recipe, run_dir, run_name, namespace=options.namespace,
                                 detached=options.detached_driver)
    try:
        print(f"tessera: run {run_name}: plan {ready['plan']} v{ready['plan_version']} {ready['partition']}"
              + (f", resuming after step {ready['step']}" if ready["recovered_from"] else ""), flush=True)
        sink = MetricsSink(recipe, run_dir, run_name, progress=options.progress, wandb_mode=options.wandb_mode)
        pump = MetricsPump(driver, sink)
        try:
            wcfg = WorkerConfig(recipe.to_dict(), run_name, run_dir, driver_name(run_name), options.namespace,
                                threads=max(1, int(resources.get("CPU", 1.0))),
                                fault_rank=fault[0] if fault else -1, fault_step=fault[1] if fault else -1,
                                ckpt_fault_rank=ckpt_fault[0] if ckpt_fault else -1,
                                ckpt_fault_step=ckpt_fault[1] if ckpt_fault else -1)
            trainer = build_trainer(recipe, wcfg, TrainerOptions(out_root, options.max_failures, options.cpus_per_worker,
                                                                 pg_timeout_s=options.pg_timeout_s), resources)
            trainer.fit()
        finally:
            pump.stop()
            sink.close()
    finally:
        if not options.keep_driver:
            ray.kill(driver)
    steps = [r for r in pump.records if "event" not in r]
    attempts = sum(1 for r in pump.records if r.get("event") == "start")  # survives driver restarts
    last = latest_complete(run_dir)
    return JobResult(run_name, run_dir, sink.path, steps[-1]["step"] if steps else 0,
                     steps[-1]["loss"] if steps else None, attempts, last.path if last else None,
                     ready["recovered_from"], time.perf_counter() - t0, ready["plan_s"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m tessera.launch`` and ``tessera train``."""
    p.add_argument("recipe", metavar="RECIPE", nargs="?", default="default",
                   help="recipe YAML (e.g. recipes/tiny-qwen3-next.yaml); 'default' or omitted: the embedded default")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. train.steps=50")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: RAY_ADDRESS; none: start a local Ray for this job)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of a local Ray (default: all cores)")
    p.add_argument("--ray-temp-dir", default=None, help="temp dir of a local Ray")
    p.add_argument("--run-name", default=None, help="run name (default: <recipe name>-<time>)")
    p.add_argument("--namespace", default=NAMESPACE, help=f"Ray namespace of the driver actor (default {NAMESPACE})")
    p.add_argument("--max-failures", type=int, default=3, help="worker-group restarts before failing (default 3)")
    p.add_argument("--cpus-per-worker", type=float, default=None,
                   help="CPUs per worker on CPU recipes (default: the cluster's CPUs shared evenly, at most 1)")
    p.add_argument("--detached-driver", action="store_true", help="the driver actor outlives the job")
    p.add_argument("--keep-driver", action="store_true", help="do not kill the driver actor at the end")
    p.add_argument("--no-progress", action="store_true", help="no console progress")


def _connect(args) -> bool:
    """``ray.init`` for the job (an existing connection of this process is reused); returns True
    when this call connected or started Ray (the caller then shuts it down)."""
    import ray

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if ray.is_initialized():
        return False
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level="WARNING")
        return True
    kwargs = {"num_cpus": args.num_cpus} if args.num_cpus else {}
    if args.ray_temp_dir:
        kwargs["_temp_dir"] = os.path.abspath(args.ray_temp_dir)
    ray.init(logging_level="WARNING", **kwargs)  # the dashboard serves the State API Ray Train polls
    return True


def run_from_args(args: argparse.Namespace) -> int:
    """Run the job ``args`` describe (``tessera train`` and ``python -m tessera.launch``); 0 on
    success, 1 when the workers failed more often than ``--max-failures``."""
    import ray
    from rich.console import Console
    from rich.table import Table

    from tessera.cli import load_cli_recipe

    recipe = load_cli_recipe(args)
    owns_ray = _connect(args)
    try:
        opts = LaunchOptions(run_name=args.run_name, namespace=args.namespace, max_failures=args.max_failures,
                             cpus_per_worker=args.cpus_per_worker, detached_driver=args.detached_driver,
                             keep_driver=args.keep_driver, progress=not args.no_progress)
        try:
            result = run_job(recipe, opts)
        except ray.train.TrainingFailedError as e:
            print(f"tessera train: error: the job failed: {' '.join(str(e).split())[:2000]}", file=sys.stderr)
            return 1
    finally:
        if owns_ray:
            ray.shutdown()
    t = Table(title=f"tessera train: {result.run_name}", show_header=False, title_justify="left")
    for k, v in (("run directory", result.run_dir), ("metrics", result.metrics_path), ("steps", str(result.steps)),
                 ("final loss", f"{result.final_loss:.4f}" if result.final_loss is not None else "-"),
                 ("worker-group starts", str(result.attempts)), ("resumed from", result.resumed_from or "-"),
                 ("latest checkpoint", result.checkpoint or "-"), ("wall time", f"{result.wall_s:.1f} s")):
        t.add_row(k, v)
    Console().print(t)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tessera.launch``; bad input exits with code 2 and one line."""
    parser = argparse.ArgumentParser(prog="python -m tessera.launch", description="Run a Tessera training job on Ray.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except TesseraConfigError as e:
        print(f"tessera train: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
