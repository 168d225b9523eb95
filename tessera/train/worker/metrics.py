"""Training metrics: per-iteration job metrics, MFU, and where they go (JSONL, W&B, console).

Per iteration every rank's :class:`~tessera.train.worker.step.StepMetrics` is gathered over the default
process group (:func:`aggregate`) into one :class:`IterationMetrics`:

* ``loss``: mean over replicas of the head rank's mean microbatch loss;
* ``iteration_ms``: the slowest rank's iteration wall time; ``tokens_per_s`` from it;
* ``mfu``: model FLOPs of the iteration (:func:`tessera.cost.flops.model_flops`, Megatron-LM
  formula with MoE active parameters) / (iteration time x the job's peak FLOP/s). The peak is
  that of the dtype the model computes in (resolved ``train.precision``: the cost model's choice)
  per device on GPUs, :func:`device_peak_tflops` (``fp32``: the FP32/TF32 peak, ``bf16``:
  ``peak_tflops``, ``fp8``: the FP8 peak); on CPU it is measured at start-up by a short matmul
  benchmark in the engine's compute dtype run on every rank at once and summed
  (:func:`measure_matmul_flops`), so a CPU run's MFU is nominal: it moves with the cores the job
  was given and what else ran during the benchmark, and compares steps of one run, not runs
  (``tessera report`` titles it so); ``peak_tflops``: that peak of the whole job, TFLOP/s;
  ``device``: ``"cpu"`` or ``"cuda"``, where the ranks ran;
* ``lr``: the learning rate of the iteration's optimizer step (rank 0's first parameter group);
* ``bubble_ratio``: time ranks spent waiting for pipeline receives / their wall time (summed
  over ranks); ``bubble_fill_rate``: time spent running movable tasks in ``slot`` annotations /
  (that + the waiting time), 0 when nothing fills slots; ``exposed_a2a_ms``: the largest
  exposed all-to-all time over ranks, None while the engine does not measure it.

With the dynamic bubble optimizer (docs/dbo.md) each rank's
:func:`tessera.engine.dbo.iteration_summary` is combined by :func:`with_dbo` into the ``dbo_*``
fields (None without it): ``dbo_slots``, ``dbo_tasks_moved``, ``dbo_forced_deadline_runs`` (sums
over ranks), ``dbo_pool_mem_peak_gb`` (largest, GB), ``dbo_pred_fill_rate`` (predicted filled /
annotated slot time, summed over ranks), ``dbo_slot_pred_err`` (predicted vs measured slot
length, ``(sum annotated - sum measured) / sum measured``), ``dbo_overhead_ms`` (the largest
rank's own decision time, ms). With live counts (``dbo.routing: router``,
:mod:`tessera.train.dbo.live`) also ``dbo_count_exchange_ms`` (the largest rank's time in count
exchanges, ms), ``dbo_count_exchanges``, ``dbo_count_rows`` and ``dbo_count_tokens``
(exchanges, (mb, layer) rows and token counts received, summed over ranks), ``dbo_count_digests`` (each world rank's hash of what it received:
equal within an EP group; a list, not sent to W&B) and ``dbo_live_loads`` (loads the policies
re-predicted from, summed). ``tessera report RUN_DIR`` renders them (:mod:`tessera.train.report.panels`).

The launcher process writes them: :class:`MetricsSink` appends JSON lines to ``metrics.jsonl``,
logs to W&B (``wandb.init(config=recipe.to_dict(), mode=logging.wandb_mode)`` in a background
thread, so the job starts meanwhile; ``online`` falls back to ``offline`` when no credentials are
configured; per-rank lists as ``NAME/INDEX`` and the autopilot's events as ``EVENT/FIELD``,
:func:`wandb_fields`) and shows a console progress bar (rich
on a terminal, a plain line every tenth of the run otherwise). A run directory on object storage
(``s3://``, ``gs://``) cannot be appended to: both files are kept in its local stand-in
(:func:`tessera.config.storage_rules.local_dir`) and uploaded, ``metrics.jsonl`` every
:data:`UPLOAD_EVERY_S` seconds and at the end, W&B's ``wandb/`` at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch

from tessera.train import storage

UPLOAD_EVERY_S = 30.0
"""Seconds between uploads of ``metrics.jsonl`` to a run directory on object storage (and at
:meth:`MetricsSink.close`)."""


@dataclass(frozen=True)
class IterationMetrics:
    """One iteration of the whole job (see the module docstring for each field).

    ``data_position``: global sequence position of the iteration's first sequence; ``attempt``:
    which start of the worker group ran it (0 = first; replays after a restart repeat steps);
    ``time``: Unix time when it was measured. At the iteration a plan upgrade took effect:
    ``plan_switch_from`` (the version before), ``plan_switch_moved_bytes`` (parameter and
    optimizer bytes this job's ranks sent each other) and ``plan_switch_s`` (the slowest rank's
    switch time before the iteration, s); None at other iterations. At the autopilot's check
    steps (:mod:`tessera.train.worker.straggler`, :meth:`CheckEstimate.metrics
    <tessera.train.worker.straggler.CheckEstimate.metrics>`): ``rank_slowdown`` (per pipeline rank,
    its task times over the other ranks' on the same tasks; null where it shares none),
    ``rank_slowdown_max``, ``routing_skew`` (busiest EP rank's tokens over the mean rank's, mean
    over (microbatch, MoE layer)) and ``ep_load`` (per EP rank, tokens over the mean rank's);
    None at other iterations."""

    step: int
    loss: float
    tokens: int
    tokens_per_s: float
    iteration_ms: float
    mfu: float
    bubble_ratio: float
    bubble_fill_rate: float
    exposed_a2a_ms: float | None
    plan_version: int
    data_position: int
    attempt: int = 0
    time: float = 0.0
    profile_drift: float | None = None
    dbo_slots: int | None = None
    dbo_tasks_moved: int | None = None
    dbo_forced_deadline_runs: int | None = None
    dbo_pool_mem_peak_gb: float | None = None
    dbo_pred_fill_rate: float | None = None
    dbo_slot_pred_err: float | None = None
    dbo_overhead_ms: float | None = None
    dbo_count_exchange_ms: float | None = None
    dbo_count_exchanges: int | None = None
    dbo_count_rows: int | None = None
    dbo_count_tokens: int | None = None
    dbo_count_digests: list | None = None
    dbo_live_loads: int | None = None
    plan_switch_from: int | None = None
    plan_switch_moved_bytes: int | None = None
    plan_switch_s: float | None = None
    lr: float | None = None
    peak_tflops: float | None = None
    device: str | None = None
    rank_slowdown: list | None = None
    rank_slowdown_max: float | None = None
    routing_skew: float | None = None
    ep_load: list | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def measure_matmul_flops(n: int = 256, min_time_s: float = 0.25, device: str = "cpu",
                         dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of repeated ``dtype`` ``n x n`` matmuls on ``device`` for at least ``min_time_s``."""
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    torch.mm(a, b)  # warm-up
    reps, t0 = 0, time.perf_counter()
    while True:
        for _ in range(8):
            torch.mm(a, b)
        reps += 8
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time_s:
            return 2.0 * n ** 3 * reps / elapsed


def device_peak_tflops(hardware, precision: str) -> float:
    """Dense peak of one GPU for MFU under the resolved ``train.precision``, TFLOP/s:
    :meth:`~tessera.spec.hardware.HardwareSpec.peak_for` (``fp32``: ``peak_tflops_fp32``, TF32;
    ``bf16``: ``peak_tflops``; ``fp8``: ``peak_tflops_fp8``, what the cost model assumes the
    GEMMs run at, though the engine computes BF16 under it).

    Raises:
        ValueError: an unknown precision (``auto`` unresolved).
    """
    return hardware.peak_for(precision)


def job_peak_flops(hardware, device: str, group=None, precision: str | None = None) -> float:
    """Peak FLOP/s of the whole job: :func:`device_peak_tflops` x world size on GPUs; on CPU the
    sum over ranks of a matmul benchmark in the compute dtype of ``precision``
    (:func:`tessera.model.precision.compute_dtype`) run by all ranks at once (collective over
    ``group``). ``precision`` None: ``bf16`` on GPUs, ``fp32`` on CPU (what ``auto`` resolves to)."""
    import torch.distributed as dist

    from tessera.model.precision import compute_dtype

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if precision is None:
        precision = "fp32" if device.startswith("cpu") else "bf16"
    if not device.startswith("cpu"):
        return device_peak_tflops(hardware, precision) * 1e12 * world
    if dist.is_initialized():
        dist.barrier(group=group)
    mine = torch.tensor([measure_matmul_flops(dtype=compute_dtype(precision))], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(mine, group=group)
    return float(mine.item())


def iteration_flops(model, parallel) -> float:
    """Model FLOPs of one iteration: every replica's microbatches through the whole model,
    ``model_flops(seq_length) * micro_batch_size * num_microbatches * dp`` (``parallel``: a
    :class:`tessera.config.schema.ParallelConfig`)."""
    from tessera.cost.flops import model_flops

    per_sequence = model_flops(model, parallel.seq_length, seq_length=parallel.seq_length)
    return per_sequence * parallel.micro_batch_size * parallel.num_microbatches * parallel.dp


def summarize(ranks, *, step: int, flops: float, peak_flops: float, tokens: int, plan_version: int,
              data_position: int, attempt: int = 0) -> IterationMetrics:
    """The job's metrics from every rank's :class:`~tessera.train.worker.step.StepMetrics` (no
    communication; :func:`aggregate` gathers them first).

    ``loss``: mean over the ranks that have one (NaN if none); ``iteration_ms``: the largest
    ``wall_ms``; ``tokens_per_s = tokens / iteration s``; ``mfu = flops / (iteration s x
    peak_flops)`` (``flops``: the whole job's, :func:`iteration_flops`; ``peak_flops``: the whole
    job's FLOP/s, :func:`job_peak_flops`); ``bubble_ratio = sum(idle_ms) / sum(wall_ms)`` (at
    most 1); ``bubble_fill_rate = sum(slot_fill_ms) / (sum(slot_fill_ms) + sum(idle_ms))``;
    ``exposed_a2a_ms``: the largest over ranks, None unless every rank measured it;
    ``profile_drift``: the largest over the ranks that checked it (:mod:`tessera.train.worker.drift`), else None;
    ``peak_tflops = peak_flops / 1e12`` (``lr`` and ``device`` are the worker loop's).

    Raises:
        ValueError: ``ranks`` is empty.
    """
    ranks = list(ranks)
    if not ranks:
        raise ValueError("summarize needs the metrics of at least one rank")
    losses = [r.loss for r in ranks if r.loss is not None]
    loss = sum(losses) / len(losses) if losses else float("nan")
    wall = max(r.wall_ms for r in ranks)
    busy = sum(r.wall_ms for r in ranks)
    idle, fill = sum(r.idle_ms for r in ranks), sum(r.slot_fill_ms for r in ranks)
    a2a = [r.exposed_a2a_ms for r in ranks]
    exposed = max(a2a) if all(v is not None for v in a2a) else None
    seconds = max(wall, 1e-9) / 1e3
    drifts = [r.profile_drift for r in ranks if r.profile_drift is not None]
    return IterationMetrics(
        step=step, loss=loss, tokens=tokens, tokens_per_s=tokens / seconds, iteration_ms=wall,
        mfu=flops / (seconds * peak_flops) if peak_flops > 0 else 0.0,
        bubble_ratio=min(1.0, idle / busy) if busy > 0 else 0.0,
        bubble_fill_rate=fill / (fill + idle) if fill + idle > 0 else 0.0,
        exposed_a2a_ms=exposed, plan_version=plan_version, data_position=data_position, attempt=attempt,
        time=time.time(), profile_drift=max(drifts) if drifts else None, peak_tflops=peak_flops / 1e12)


def aggregate(local, *, step: int, flops: float, peak_flops: float, tokens: int, plan_version: int,
              data_position: int, attempt: int = 0, group=None) -> IterationMetrics:
    """Gather every rank's :class:`~tessera.train.worker.step.StepMetrics` into the job's metrics
    (collective over ``group``; every rank gets the same value); see :func:`summarize`."""
    return gather_step(local, step=step, flops=flops, peak_flops=peak_flops, tokens=tokens, plan_version=plan_version,
                       data_position=data_position, attempt=attempt, group=group)[0]


def gather_step(local, *, step: int, flops: float, peak_flops: float, tokens: int, plan_version: int,
                data_position: int, attempt: int = 0, group=None,
                announce: tuple[int, int] | None = None,
                stop: bool = False) -> tuple[IterationMetrics, tuple[int, int] | None, bool]:
    """:func:`aggregate`, and in the same all-gather rank 0's ``announce`` (a plan version and
    the step the driver announced for it, :mod:`tessera.train.upgrade.schedule`, or None) and
    rank 0's ``stop`` (the launcher asked the job to stop, :class:`tessera.train.worker.loop.StopPoll`).
    Returns ``(metrics, rank 0's announcement, rank 0's stop)``, the same on every rank."""
    import torch.distributed as dist

    from tessera.train.worker.step import StepMetrics

    a2a = -1.0 if local.exposed_a2a_ms is None else local.exposed_a2a_ms
    drift = -1.0 if local.profile_drift is None else local.profile_drift
    version, at = announce if announce is not None else (-1, -1)
    mine = torch.tensor([0.0 if local.loss is None else 1.0, local.loss or 0.0, local.wall_ms, local.idle_ms,
                         local.slot_fill_ms, a2a, drift, float(version), float(at), float(stop)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, mine, group=group)
        rows = torch.stack(parts).tolist()
    else:
        rows = [mine.tolist()]
    ranks = [StepMetrics(loss=r[1] if r[0] > 0 else None, wall_ms=r[2], idle_ms=r[3], slot_fill_ms=r[4],
                         exposed_a2a_ms=r[5] if r[5] >= 0 else None, profile_drift=r[6] if r[6] >= 0 else None)
             for r in rows]
    announced = (int(rows[0][7]), int(rows[0][8])) if rows[0][7] >= 0 else None  # float64: exact for ints < 2**53
    return summarize(ranks, step=step, flops=flops, peak_flops=peak_flops, tokens=tokens, plan_version=plan_version,
                     data_position=data_position, attempt=attempt), announced, rows[0][9] > 0


def with_dbo(metrics: IterationMetrics, ranks) -> IterationMetrics:
    """``metrics`` with the ``dbo_*`` fields from every rank's
    :func:`tessera.engine.dbo.iteration_summary` dict (module docstring for each rule).

    Raises:
        ValueError: ``ranks`` is empty or a dict lacks a ``dbo_*`` key (name it).
    """
    ranks = list(ranks)
    keys = ("dbo_slots", "dbo_tasks_moved", "dbo_forced_deadline_runs", "dbo_pool_mem_peak_gb", "dbo_overhead_ms",
            "dbo_annotated_ms", "dbo_filled_ms", "dbo_measured_slot_ms")
    if not ranks:
        raise ValueError("with_dbo needs the DBO summary of at least one rank")
    missing = sorted({k for r in ranks for k in keys if k not in r})
    if missing:
        raise ValueError(f"DBO summary lacks {missing}; make it with tessera.engine.dbo.iteration_summary")
    total = {k: sum(r[k] for r in ranks) for k in keys}
    annotated, measured = total["dbo_annotated_ms"], total["dbo_measured_slot_ms"]
    return replace(metrics, dbo_slots=int(total["dbo_slots"]), dbo_tasks_moved=int(total["dbo_tasks_moved"]),
                   dbo_forced_deadline_runs=int(total["dbo_forced_deadline_runs"]),
                   dbo_pool_mem_peak_gb=max(r["dbo_pool_mem_peak_gb"] for r in ranks),
                   dbo_pred_fill_rate=total["dbo_filled_ms"] / annotated if annotated > 0 else 0.0,
                   dbo_slot_pred_err=(annotated - measured) / measured if measured > 0 else None,
                   dbo_overhead_ms=max(r["dbo_overhead_ms"] for r in ranks), **_live_fields(ranks))


def _live_fields(ranks: list[dict]) -> dict:
    """The live-count fields of :func:`with_dbo` (empty unless some rank has ``dbo_live``)."""
    if not any(r.get("dbo_live") for r in ranks):
        return {}
    return {"dbo_count_exchange_ms": max(float(r.get("dbo_count_exchange_ms", 0.0)) for r in ranks),
            "dbo_count_exchanges": int(sum(r.get("dbo_count_exchanges", 0) for r in ranks)),
            "dbo_count_rows": int(sum(r.get("dbo_count_rows", 0) for r in ranks)),
            "dbo_count_tokens": int(sum(r.get("dbo_count_tokens", 0) for r in ranks)),
            "dbo_count_digests": [int(r.get("dbo_count_digest", 0)) for r in ranks],
            "dbo_live_loads": int(sum(r.get("dbo_live_loads", 0) for r in ranks))}


WANDB_EVENT_PREFIX = "autopilot_"
"""Events whose numbers :class:`MetricsSink` also logs to W&B (the autopilot's: estimates,
decisions, verifications, toggles; docs/operations.md, "Autopilot")."""

LIST_FIELDS = ("rank_slowdown", "ep_load", "ep_slowdown")
"""Per-rank list fields W&B gets one number each of, as ``NAME/INDEX``."""


def wandb_fields(record: dict) -> dict:
    """What W&B gets of a ``metrics.jsonl`` record: its numbers (not ``step``, not NaN), each
    :data:`LIST_FIELDS` list as ``NAME/0``, ``NAME/1``, ...; an event's keys prefixed with the
    event's name (``autopilot_estimate/rank_slowdown_max``; an event's ``time`` is left out)."""
    prefix = f"{record['event']}/" if "event" in record else ""
    out = {}
    for k, v in record.items():
        if k in LIST_FIELDS and isinstance(v, list):
            out.update({f"{prefix}{k}/{i}": x for i, x in enumerate(v) if isinstance(x, (int, float))})
        elif isinstance(v, (int, float)) and k != "step" and not (prefix and k == "time") \
                and not (isinstance(v, float) and math.isnan(v)):
            out[prefix + k] = v
    return out


def _wandb_mode(requested: str) -> str:
    """``online`` only with configured credentials (no prompt, no network check)."""
    if requested != "online":
        return requested
    import wandb

    try:
        if wandb.login(prompt=False, verify=False):
            return "online"
    except Exception:  # noqa: BLE001 - any credential problem means: stay offline
        pass
    print("tessera: W&B has no credentials (run `wandb login`); logging offline", file=sys.stderr)
    return "offline"


class MetricsSink:
    """Where one run's records go: JSONL file, W&B run, console progress.

    Args:
        recipe: the job's Recipe (W&B config, project, mode; ``train.steps`` for the bar).
        run_dir: the run's directory (``metrics.jsonl`` and the W&B files go there): a local path,
            or an object-store URI, whose files are written in :attr:`local_dir` and uploaded
            (module docstring; a ``metrics.jsonl`` already there, a resumed run's, is downloaded
            first and appended to).
        run_name: W&B run name.
        progress: show the console progress.

    Attributes:
        path: the location of ``metrics.jsonl`` (in ``run_dir``); local_dir: where it and W&B's
            files are written on this machine (``run_dir`` itself when it is local).
    """

    def __init__(self, recipe, run_dir: str, run_name: str, *, progress: bool = True) -> None:
        from tessera.config.storage_rules import local_dir

        self.run_dir, self.local_dir = run_dir, local_dir(run_dir)
        os.makedirs(self.local_dir, exist_ok=True)
        self.path = storage.join(run_dir, "metrics.jsonl")
        self._local_path = os.path.join(self.local_dir, "metrics.jsonl")
        self._remote = storage.is_remote(run_dir)
        self._uploaded = time.monotonic()
        if self._remote:  # the run's own file is the truth (a resumed run, on any machine)
            try:
                storage.download(self.path, self._local_path)
            except FileNotFoundError:
                open(self._local_path, "w").close()
        self._file = open(self._local_path, "a", buffering=1)
        self.total = recipe.train.steps
        self.drift_threshold = recipe.profile.drift_threshold
        self.drifted: float | None = None  # the largest drift above the threshold, if any
        self.wandb_run, self._wandb_step, self._wandb_queue = None, 0, []
        self._wandb_error: BaseException | None = None
        self._wandb_thread = None
        mode = _wandb_mode(recipe.logging.wandb_mode)
        if mode != "disabled":  # started in the background: it takes seconds, the job starts meanwhile
            args = dict(project=recipe.logging.wandb_project, name=run_name, id=run_name, config=recipe.to_dict(),
                        mode=mode, dir=self.local_dir, resume="allow")
            self._wandb_thread = threading.Thread(target=self._init_wandb, args=(args,), name="tessera-wandb",
                                                  daemon=True)
            self._wandb_thread.start()
        self._bar = self._task = None
        self._plain = progress
        if progress and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn())
            self._task = self._bar.add_task("train", total=self.total, info="starting")
            self._bar.start()
            self._plain = False

    def _init_wandb(self, args: dict) -> None:
        try:
            import wandb

            self.wandb_run = wandb.init(settings=wandb.Settings(silent=True, console="off"), **args)
        except Exception as e:  # noqa: BLE001 - W&B trouble must not stop training; reported at close
            self._wandb_error = e

    def _log_wandb(self, record: dict | None) -> None:
        if record is not None:
            self._wandb_queue.append(record)
        if self.wandb_run is None:
            return
        for rec in self._wandb_queue:
            # replays after a restart are logged once; an event joins its iteration's step
            if rec["step"] > self._wandb_step or ("event" in rec and rec["step"] >= self._wandb_step):
                self._wandb_step = rec["step"]
                self.wandb_run.log(wandb_fields(rec), step=rec["step"])
        self._wandb_queue = []

    def write(self, record: dict) -> None:
        """Append one record (an :class:`IterationMetrics` dict or an ``{"event": ...}`` dict; the
        autopilot's events, :data:`WANDB_EVENT_PREFIX`, also go to W&B, :func:`wandb_fields`)."""
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        if self._remote and time.monotonic() - self._uploaded >= UPLOAD_EVERY_S:
            self._upload_metrics()
        if "event" in record and str(record["event"]).startswith(WANDB_EVENT_PREFIX) \
                and isinstance(record.get("step"), int) and self._wandb_thread is not None:
            self._log_wandb(record)
        if "step" not in record or "event" in record:
            return
        drift = record.get("profile_drift")
        if drift is not None and drift > self.drift_threshold:
            self.drifted = max(self.drifted or 0.0, drift)
            event = {"event": "profile_drift", "step": record["step"], "drift": drift,
                     "threshold": self.drift_threshold, "time": record.get("time", 0.0)}
            self._file.write(json.dumps(event, sort_keys=True) + "\n")
            print(f"tessera: warning: step {record['step']}: task times drifted {drift:.0%} from the profile "
                  f"(profile.drift_threshold {self.drift_threshold:.0%}); the profile will be marked stale",
                  file=sys.stderr, flush=True)
        if self._wandb_thread is not None:
            self._log_wandb(record)
        info = (f"loss {record['loss']:.3f}  {record['tokens_per_s']:.0f} tok/s  MFU {100 * record['mfu']:.2f}%  "
                f"bubble {100 * record['bubble_ratio']:.0f}%")
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], info=info)
        elif self._plain and (record["step"] % max(1, self.total // 10) == 0 or record["step"] == self.total):
            print(f"step {record['step']}/{self.total}  {info}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self._wandb_thread is not None:
            self._wandb_thread.join(timeout=120)
            self._log_wandb(None)
            if self.wandb_run is not None:
                self.wandb_run.finish()
            elif self._wandb_error is not None:
                print(f"tessera: W&B logging failed: {self._wandb_error}", file=sys.stderr)
            self.wandb_run, self._wandb_thread = None, None
        self._file.close()
        if self._remote:
            self._upload_metrics()
            wandb_dir = os.path.join(self.local_dir, "wandb")
            if os.path.isdir(wandb_dir):
                try:
                    storage.upload(wandb_dir, storage.join(self.run_dir, "wandb"))
                except OSError as e:
                    print(f"tessera: could not upload {wandb_dir} to {self.run_dir} ({e}); the W&B files stay there",
                          file=sys.stderr)

    def _upload_metrics(self) -> None:
        """Copy the local ``metrics.jsonl`` to the run directory on object storage; a failure is
        printed (the local file keeps every record; the next upload, or the one at the end,
        tries again)."""
        if not self._file.closed:
            self._file.flush()
        self._uploaded = time.monotonic()
        try:
            storage.upload(self._local_path, self.path)
        except OSError as e:
            print(f"tessera: could not upload {self._local_path} to {self.path} ({e})", file=sys.stderr)
