"""``tessera status --job JOB``: a running job's state, from its driver actor
(:mod:`tessera.train.job.client`): run, step / total, plan version, template, partition, pending
upgrade, attempts, the last iteration's loss, tokens/s, MFU and bubble ratio, what the autopilot
saw and did (:func:`autopilot_rows`), and the plan version history (version, source, effective
step, applied, sha256[:12], template, vpp, dbo, partition).
``--json`` prints the driver's status dict instead. Also the job arguments that ``tessera
upgrade`` and ``tessera rollback`` share (:func:`add_job_arguments`, :func:`driver_client`)."""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Iterator

from tessera.cli.common import EXIT_OK


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """``--job`` (required), ``--address``, ``--namespace``, ``--timeout``."""
    p.add_argument("--job", required=True, metavar="JOB",
                   help="the run name, or the Ray job submission id (raysubmit_...) or Ray job id of the job")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: RAY_ADDRESS, else auto); an explicit HOST:PORT of a cluster "
                        "with token authentication needs RAY_AUTH_MODE=token, as for ray job submit")
    p.add_argument("--namespace", default="tessera",
                   help="Ray namespace of the driver actor, for a run name (default tessera, the job.namespace default)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds to wait for the driver's answer (default 300)")


@contextlib.contextmanager
def driver_client(args: argparse.Namespace) -> Iterator:
    """Connected to the cluster, the :class:`~tessera.train.job.client.DriverClient` of ``args.job``.

    Raises:
        TesseraConfigError: cannot connect, or no driver for ``--job``.
    """
    from tessera.train.job.client import DriverClient, connected

    with connected(args.address, args.namespace):
        yield DriverClient.open(args.job, args.namespace, args.timeout)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``tessera status``."""
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print the driver's status dict as JSON")
    p.add_argument("--history", type=int, default=50, metavar="N",
                   help="metric records to fetch (the last N; default 50) and version-history rows to show")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _current(status: dict) -> dict:
    """The version-history entry of the running version ({} when the driver lists none)."""
    return next((v for v in status.get("versions") or () if v.get("version") == status.get("plan_version")), {})


def _pending(p) -> str:
    if p is None:
        return "-"
    if isinstance(p, dict):
        return f"version {p.get('version')} at step {p.get('effective_step')}"
    return f"version {p}"


def _onoff(value) -> str:
    return "-" if value is None else ("on" if value else "off")


def _placement(placed) -> str:
    """The workers' placement as the driver checked it (:meth:`Driver.place_ranks`): the order,
    the nodes, the group kinds crossing nodes, and whether ranks were re-mapped."""
    if not placed:
        return "-"
    pl = placed["placement"]
    per_node = ", ".join(str(placed["nodes"].count(n)) for n in sorted(set(placed["nodes"])))
    return (f"{placed['order']}: {pl['num_nodes']} nodes ({per_node} workers); across nodes: "
            f"{', '.join(pl['crossing']) or 'none'}" + ("; ranks re-mapped" if placed.get("remapped") else ""))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _pct(ratio_change) -> str:
    return "-" if ratio_change is None else f"{ratio_change:+.1%}"


def autopilot_rows(ap: dict | None) -> list[tuple[str, str]]:
    """The autopilot's rows (:meth:`tessera.train.job.autopilot.AutopilotRPCs.autopilot_status`):
    on/off with its switch and rollback counts, what it saw last (the medians of its window of
    checks), what it did last (a decision with its predicted change of the iteration time) and
    the verification (in progress, or the last verdict with measured and predicted change)."""
    if not ap:
        return [("autopilot", "-")]
    rows = [("autopilot", f"{'on' if ap.get('enabled') else 'off'}: {_plural(ap.get('switches', 0), 'switch')}, "
                          f"{_plural(ap.get('rollbacks', 0), 'rollback')}")]
    est = ap.get("estimate")
    if est:
        saw = f"step {est['step']}: rank slowdown " + " ".join(f"{x:.2f}" for x in est["rank_slowdown"])
        saw += f"; routing skew {est['routing_skew']:.2f}"
        if est.get("ep_slowdown"):
            saw += "; EP load " + " ".join(f"{x:.2f}" for x in est["ep_slowdown"])
        rows.append(("autopilot saw", saw + f" ({_plural(est['checks'], 'check')})"))
    else:
        rows.append(("autopilot saw", "-"))
    d = ap.get("last_decision")
    if ap.get("replanning"):
        did = "re-planning"
    elif not d:
        did = "-"
    elif d.get("action") == "switch":
        did = (f"step {d['step']}: switch to v{d.get('plan_version')} ({d.get('option')}, predicted "
               f"{_pct(-d['predicted_gain'])})")
    else:
        did = f"step {d['step']}: {d.get('action')} ({d.get('reason')})"
    rows.append(("autopilot did", did))
    p, v = ap.get("verifying"), ap.get("last_verdict")
    if p:
        rows.append(("autopilot verify", f"v{p['plan_version']}: {len(p.get('after_ms') or ())} iterations timed"))
    elif v and "measured_ratio" in v:
        what = f"rolled back (v{v.get('rollback_version')})" if v.get("action") == "rollback" else "kept"
        rows.append(("autopilot verify", f"v{v['plan_version']} {what}: measured {_pct(v['measured_ratio'] - 1)}, "
                                         f"predicted {_pct(v['predicted_ratio'] - 1)}"))
    return rows


def summary_rows(status: dict) -> list[tuple[str, str]]:
    """``(field, text)`` rows of the status table (the running version's template, vpp and
    bubble optimizer from the status, else from its version-history entry)."""
    cur, last = _current(status), status.get("last") or {}
    plan = status.get("plan")
    template, vpp = status.get("template", cur.get("template")), status.get("vpp", cur.get("vpp"))
    return [
        ("run", str(status.get("run"))),
        ("submission id", str(status.get("submission_id") or "-")),
        ("step", f"{status.get('step')} / {status.get('total_steps')}"),
        ("plan version", f"{status.get('plan_version')}" + (f" ({plan})" if isinstance(plan, str) else "")),
        ("template", f"{template or '-'}" + (f" vpp={vpp}" if vpp is not None else "")),
        ("bubble optimizer", _onoff(status.get("dbo", cur.get("dbo")))),
        ("partition", str(status.get("partition"))),
        ("pending upgrade", _pending(status.get("pending_upgrade"))),
        ("worker-group starts", str(status.get("attempts", "-"))),
        ("placement", _placement(status.get("placement"))),
        ("last step", str(last.get("step", "-"))),
        ("loss", _num(last.get("loss"), ".4f")),
        ("tokens/s", _num(last.get("tokens_per_s"), ",.0f")),
        ("MFU", _num(last.get("mfu"), ".2%")),
        ("bubble ratio", _num(last.get("bubble_ratio"), ".2%")),
        *autopilot_rows(status.get("autopilot")),
    ]


HISTORY_COLUMNS = ("version", "source", "effective step", "applied", "sha256", "template", "vpp", "dbo",
                   "partition")
"""Columns of the version-history table."""


def history_rows(status: dict, limit: int = 50) -> list[tuple[str, ...]]:
    """Rows of the version-history table (:data:`HISTORY_COLUMNS`; oldest first, the newest
    ``limit``). A rollback's source reads ``rollback of vN``."""
    out = []
    for v in list(status.get("versions") or ())[-limit:] if limit > 0 else ():
        source = str(v.get("source", "-"))
        if v.get("rollback_of") is not None:
            source += f" of v{v['rollback_of']}"
        applied = v.get("applied")
        out.append((str(v.get("version")), source, str(v.get("effective_step", "-")),
                    "-" if applied is None else ("yes" if applied else "pending"), str(v.get("sha256") or "-")[:12],
                    str(v.get("template", "-")), str(v.get("vpp", "-")), _onoff(v.get("dbo")),
                    str(v.get("partition", "-"))))
    return out


def print_status(status: dict, limit: int = 50) -> None:
    """The status and version-history tables on stdout."""
    from rich.table import Table
    from rich.text import Text

    from tessera.cli.console import print_tables

    t = Table(title=f"tessera status: {status.get('run')}", show_header=False, title_justify="left")
    for k, v in summary_rows(status):
        t.add_row(Text(k), Text(v))  # Text: a partition's "S0[emb,0-1]" is no rich markup
    h = Table(title="plan versions", title_justify="left")
    for col in HISTORY_COLUMNS:
        h.add_column(col)
    for row in history_rows(status, limit):
        h.add_row(*map(Text, row))
    print_tables(t, h)


def run(args: argparse.Namespace) -> int:
    with driver_client(args) as client:
        status = client.status(history=args.history)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        print_status(status, args.history)
    return EXIT_OK
