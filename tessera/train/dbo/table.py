"""The dynamic bubble optimizer in the training job (``dbo.enabled``, docs/dbo.md).

The driver compiles the plan's Programs with slot annotations and W slack
(:func:`tessera.flow.compile_programs` with the plan's costs: the same
:func:`tessera.program.slots.annotate_slots` pass, ``defer_w=True``, that ``tessera simulate``
runs) and predicts every pipeline rank's :class:`~tessera.dbo.predict.RankTable` from the
recipe's token counts (:func:`dbo_tables`: ``dbo.routing`` as
:func:`tessera.sim.dbo.recipe_counts` makes them, the same table for every iteration; with
``dbo.routing: router`` a prior updated from the live counts, below). The table goes to
the worker with its Program as plain values (:func:`table_to_dict`, :func:`table_from_dict`).
Each table is a :class:`JobTable`: the :class:`~tessera.dbo.predict.RankTable` and the rank's
layer-level W units (:func:`tessera.dbo.units.unit_table` of the table, the rank's Program and
the plan's costs, ``split`` granularity; :func:`unit_to_dict`, :func:`unit_from_dict`), so the
worker runs the engine with the policy the simulator and the emulated benchmark run,
:class:`~tessera.engine.dbo_joint.JointDBOPolicy` (units chosen jointly over the EP group;
``dbo.pool_mem_gb``, ``dbo.log``; :func:`make_policy`), and each iteration every rank's
:func:`~tessera.engine.dbo.iteration_summary` is gathered (:func:`gather_summaries`) and combined
by :func:`tessera.train.worker.metrics.with_dbo` into the ``dbo_*`` fields of ``metrics.jsonl``.

With ``dbo.routing: router`` the driver's table is predicted from uniform counts (the prior)
and carries each prediction's load terms; each iteration the worker's
:class:`~tessera.train.dbo.live.LiveCounts` exchanges the EP group's live router counts and the
policy re-predicts the slots still ahead (:meth:`~tessera.dbo.predict.RankTable.with_loads`).

W of one parameter still run in microbatch order (:mod:`tessera.dbo.choice`), so losses and
weights are bitwise those of the same job with ``dbo.enabled=false``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.dbo.predict import LoadTerm, RankTable, SlotPrediction, WTask
from tessera.dbo.units import UnitTable, WUnit
from tessera.program.instructions import Op, Program

UNIT_GRANULARITY = "split"
"""The job's W unit (:data:`tessera.dbo.units.GRANULARITIES`): a MoE layer's expert W apart from
the rest of its W, the default of the simulator and of ``benchmarks/dbo.py``."""

SUMMARY_KEYS = ("dbo_slots", "dbo_tasks_moved", "dbo_forced_deadline_runs", "dbo_pool_mem_peak_gb",
                "dbo_overhead_ms", "dbo_annotated_ms", "dbo_filled_ms", "dbo_measured_slot_ms", "dbo_live",
                "dbo_live_loads", "dbo_count_exchange_ms", "dbo_count_exchanges", "dbo_count_rows",
                "dbo_count_tokens", "dbo_count_digest")
"""The numeric keys of :func:`tessera.engine.dbo.iteration_summary` (and, with live counts,
``dbo_live`` = 1 and :meth:`tessera.train.dbo.live.LiveCounts.summary`) that
:func:`tessera.train.worker.metrics.with_dbo` combines (gathered as one float64 vector per rank; a
missing key is 0)."""


@dataclass(frozen=True)
class JobTable(RankTable):
    """A pipeline rank's :class:`~tessera.dbo.predict.RankTable` with its layer-level W units
    (:func:`tessera.dbo.units.unit_table`): what the driver sends each worker. ``units`` are
    those of the table as predicted (the prior with ``dbo.routing: router``;
    :class:`~tessera.engine.dbo_joint.JointDBOPolicy` re-predicts them from live loads); None:
    a plain table, run by the chunk-level :class:`~tessera.engine.dbo.DBOPolicy`."""

    units: UnitTable | None = None

    def rank_table(self) -> RankTable:
        """The table without its units."""
        return RankTable(self.rank, self.ep, self.slots, self.tasks, self.loads)


def dbo_tables(recipe, programs, costs, model) -> tuple[JobTable, ...]:
    """One :class:`JobTable` per pipeline rank of the annotated ``programs``: slot predictions
    and movable W from ``costs`` (ms, bytes) and the recipe's token counts
    (:func:`tessera.sim.dbo.recipe_counts`), EP group ``parallel.ep``, ``dbo.margin``, and the
    rank's W units (:data:`UNIT_GRANULARITY`, durations ms, memory bytes).

    Raises:
        ValueError: counts that do not cover the Programs' MoE layers or microbatches (e.g. a
            recorded file of another model or fewer microbatches), or ``ep`` not dividing the
            experts (:func:`tessera.dbo.predict.rank_tables`).
    """
    from tessera.dbo.predict import rank_tables
    from tessera.dbo.units import unit_table
    from tessera.sim.dbo import recipe_counts

    if recipe.dbo.routing == "router":  # live counts: the prior is balanced routing
        recipe = recipe.with_overrides(["dbo.routing=uniform"])
    counts = recipe_counts(recipe, costs, model)
    tables = rank_tables(programs, costs, counts, recipe.parallel.ep, recipe.dbo.margin)
    return tuple(JobTable(t.rank, t.ep, t.slots, t.tasks, t.loads, unit_table(t, p, costs, UNIT_GRANULARITY))
                 for t, p in zip(tables, programs))


def unit_to_dict(units: UnitTable) -> dict:
    """``units`` as plain values (JSON-ready): each :class:`~tessera.dbo.units.WUnit` as a list
    in field order (ms per EP rank, bytes), the chunk layers as ``[chunk, [layers]]`` pairs."""
    return {"rank": units.rank, "ep": units.ep,
            "units": [[u.chunk, u.mb, u.layer, list(u.ms), u.rest_ms, u.expert_ms, u.mem_bytes, u.register,
                       u.deadline, u.sync, list(u.kinds)] for u in units.units],
            "layers": [[c, list(ls)] for c, ls in sorted(units.layers.items())]}


def unit_from_dict(d: dict) -> UnitTable:
    """The :class:`~tessera.dbo.units.UnitTable` of :func:`unit_to_dict`."""
    units = tuple(WUnit(int(c), int(mb), int(l), tuple(float(x) for x in ms), float(rest), float(ex), float(mem),
                        int(reg), int(dl), int(sync), tuple(str(k) for k in kinds))
                  for c, mb, l, ms, rest, ex, mem, reg, dl, sync, kinds in d["units"])
    return UnitTable(int(d["rank"]), int(d["ep"]), units, {int(c): tuple(int(x) for x in ls) for c, ls in d["layers"]})


def table_to_dict(table: RankTable) -> dict:
    """``table`` as plain values (JSON-ready): slots by instruction index, tasks as lists, and a
    :class:`JobTable`'s units under ``units`` (:func:`unit_to_dict`)."""
    def terms(ts):
        return [[t.mb, t.layer, t.expert_ms, t.a2a_ms] for t in ts]

    out = {"rank": table.rank, "ep": table.ep,
           "slots": [[s.index, list(s.idle_ms), s.margin, s.kind, s.base_ms, terms(s.terms)] for s in table.slots],
           "tasks": [[t.chunk, t.mb, list(t.ms), t.mem_bytes, t.register, t.deadline, t.base_ms, terms(t.terms)]
                     for t in table.tasks],
           "loads": [[mb, l, list(v)] for mb, l, v in table.loads]}
    if getattr(table, "units", None) is not None:
        out["units"] = unit_to_dict(table.units)
    return out


def _terms(rows) -> tuple[LoadTerm, ...]:
    return tuple(LoadTerm(int(mb), int(l), float(ex), float(a2a)) for mb, l, ex, a2a in rows)


def table_from_dict(d: dict, program: Program) -> RankTable:
    """The :class:`RankTable` of :func:`table_to_dict` for ``program`` (its slot instructions
    are taken from ``program`` by index); a :class:`JobTable` when ``d`` has ``units``.

    Raises:
        ValueError: the table is for another rank, an index is not a ``slot`` of ``program``
            (the table was made for another Program), or its units are of another rank or EP size.
    """
    if d["rank"] != program.rank:
        raise ValueError(f"the DBO table is for pipeline rank {d['rank']}, the Program for rank {program.rank}")
    slots = []
    for index, idle, margin, *live in d["slots"]:
        if not 0 <= index < len(program.instructions) or program.instructions[index].op != Op.SLOT:
            raise ValueError(f"rank {program.rank}: DBO table slot at instruction {index} is not a slot of the "
                             "Program (the table was made for another Program)")
        kind, base, terms = live if live else ("", 0.0, ())
        slots.append(SlotPrediction(int(index), program.instructions[index], tuple(float(x) for x in idle),
                                    float(margin), str(kind), float(base), _terms(terms)))
    tasks = tuple(WTask(int(c), int(mb), tuple(float(x) for x in ms), float(mem), int(reg), int(dl),
                        *((float(live[0]), _terms(live[1])) if live else ()))
                  for c, mb, ms, mem, reg, dl, *live in d["tasks"])
    loads = tuple((int(mb), int(l), tuple(int(x) for x in v)) for mb, l, v in d.get("loads", ()))
    rank, ep = int(d["rank"]), int(d["ep"])
    if d.get("units") is None:
        return RankTable(rank, ep, tuple(slots), tasks, loads)
    units = unit_from_dict(d["units"])
    if (units.rank, units.ep) != (rank, ep):
        raise ValueError(f"the DBO table of rank {rank} (ep={ep}) carries units of rank {units.rank} "
                         f"(ep={units.ep}); send each rank's own JobTable (dbo_tables)")
    return JobTable(rank, ep, tuple(slots), tasks, loads, units)


def make_policy(recipe, table: RankTable, ep_rank: int, live=None, units: UnitTable | None = None):
    """The rank's policy: :class:`~tessera.engine.dbo_joint.JointDBOPolicy` (layer-level W,
    the EP group's joint choice) on ``units``, or else the units ``table`` carries (a
    :class:`JobTable`, as :func:`dbo_tables` makes it); the chunk-level
    :class:`~tessera.engine.dbo.DBOPolicy` for a plain table. ``dbo.pool_mem_gb`` (GB),
    ``dbo.log``; ``live``: the rank's :class:`~tessera.train.dbo.live.LiveCounts`
    (``dbo.routing: router``).

    Raises:
        ValueError: as :class:`~tessera.engine.dbo_joint.JointDBOPolicy` (an EP rank outside the
            table's group, units of another rank).
    """
    units = units if units is not None else getattr(table, "units", None)
    kw = dict(pool_mem_gb=recipe.dbo.pool_mem_gb, log=recipe.dbo.log, live=live)
    if units is None:
        from tessera.engine.dbo import DBOPolicy

        return DBOPolicy(table, ep_rank, **kw)
    from tessera.engine.dbo_joint import JointDBOPolicy

    return JointDBOPolicy(table, units, ep_rank, **kw)


def gather_summaries(summary: dict, group=None) -> list[dict]:
    """Every rank's ``summary`` (:func:`~tessera.engine.dbo.iteration_summary`, the
    :data:`SUMMARY_KEYS`) over ``group`` (default: the default process group; a collective, so
    every rank calls it); ``[summary]`` without ``torch.distributed``."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([float(summary.get(k) or 0.0) for k in SUMMARY_KEYS], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, mine, group=group)
        rows = [p.tolist() for p in parts]
    else:
        rows = [mine.tolist()]
    return [dict(zip(SUMMARY_KEYS, r)) for r in rows]
