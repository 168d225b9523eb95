"""The dynamic bubble optimizer in the training job (``dbo.enabled``, docs/dbo.md).

The driver compiles the plan's Programs with slot annotations and W slack
(:func:`tessera.flow.compile_programs` with the plan's costs: the same
:func:`tessera.program.slots.annotate_slots` pass, ``defer_w=True``, that ``tessera simulate``
runs) and predicts every pipeline rank's :class:`~tessera.dbo.predict.RankTable` from the
recipe's token counts (:func:`dbo_tables`: ``dbo.routing`` as
:func:`tessera.sim.dbo.recipe_counts` makes them, the same table for every iteration; with
``dbo.routing: router`` a prior updated from the live counts, below). The table goes to
the worker with its Program as plain values (:func:`table_to_dict`, :func:`table_from_dict`),
the worker runs the engine with :class:`~tessera.engine.dbo.DBOPolicy` (``dbo.pool_mem_gb``,
``dbo.log``; :func:`make_policy`), and each iteration every rank's
:func:`~tessera.engine.dbo.iteration_summary` is gathered (:func:`gather_summaries`) and combined
by :func:`tessera.train.metrics.with_dbo` into the ``dbo_*`` fields of ``metrics.jsonl``.

With ``dbo.routing: router`` the driver's table is predicted from uniform counts (the prior)
and carries each prediction's load terms; each iteration the worker's
:class:`~tessera.train.dbo_live.LiveCounts` exchanges the EP group's live router counts and the
policy re-predicts the slots still ahead (:meth:`~tessera.dbo.predict.RankTable.with_loads`).

W of one parameter still run in microbatch order (:mod:`tessera.dbo.choice`), so losses and
weights are bitwise those of the same job with ``dbo.enabled=false``.
"""

from __future__ import annotations

from tessera.dbo.predict import LoadTerm, RankTable, SlotPrediction, WTask
from tessera.program.instructions import Op, Program

SUMMARY_KEYS = ("dbo_slots", "dbo_tasks_moved", "dbo_forced_deadline_runs", "dbo_pool_mem_peak_gb",
                "dbo_overhead_ms", "dbo_annotated_ms", "dbo_filled_ms", "dbo_measured_slot_ms", "dbo_live",
                "dbo_live_loads", "dbo_count_exchange_ms", "dbo_count_exchanges", "dbo_count_rows",
                "dbo_count_tokens", "dbo_count_digest")
"""The numeric keys of :func:`tessera.engine.dbo.iteration_summary` (and, with live counts,
``dbo_live`` = 1 and :meth:`tessera.train.dbo_live.LiveCounts.summary`) that
:func:`tessera.train.metrics.with_dbo` combines (gathered as one float64 vector per rank; a
missing key is 0)."""


def dbo_tables(recipe, programs, costs, model) -> tuple[RankTable, ...]:
    """One :class:`RankTable` per pipeline rank of the annotated ``programs``: slot predictions
    and movable W from ``costs`` (ms, bytes) and the recipe's token counts
    (:func:`tessera.sim.dbo.recipe_counts`), EP group ``parallel.ep``, ``dbo.margin``.

    Raises:
        ValueError: counts that do not cover the Programs' MoE layers or microbatches (e.g. a
            recorded file of another model or fewer microbatches), or ``ep`` not dividing the
            experts (:func:`tessera.dbo.predict.rank_tables`).
    """
    from tessera.dbo.predict import rank_tables
    from tessera.sim.dbo import recipe_counts

    if recipe.dbo.routing == "router":  # live counts: the prior is balanced routing
        recipe = recipe.with_overrides(["dbo.routing=uniform"])
    counts = recipe_counts(recipe, costs, model)
    return rank_tables(programs, costs, counts, recipe.parallel.ep, recipe.dbo.margin)


def table_to_dict(table: RankTable) -> dict:
    """``table`` as plain values (JSON-ready): slots by instruction index, tasks as lists."""
    def terms(ts):
        return [[t.mb, t.layer, t.expert_ms, t.a2a_ms] for t in ts]

    return {"rank": table.rank, "ep": table.ep,
            "slots": [[s.index, list(s.idle_ms), s.margin, s.kind, s.base_ms, terms(s.terms)] for s in table.slots],
            "tasks": [[t.chunk, t.mb, list(t.ms), t.mem_bytes, t.register, t.deadline, t.base_ms, terms(t.terms)]
                      for t in table.tasks],
            "loads": [[mb, l, list(v)] for mb, l, v in table.loads]}


def _terms(rows) -> tuple[LoadTerm, ...]:
    return tuple(LoadTerm(int(mb), int(l), float(ex), float(a2a)) for mb, l, ex, a2a in rows)


def table_from_dict(d: dict, program: Program) -> RankTable:
    """The :class:`RankTable` of :func:`table_to_dict` for ``program`` (its slot instructions
    are taken from ``program`` by index).

    Raises:
        ValueError: the table is for another rank, or an index is not a ``slot`` of ``program``
            (the table was made for another Program).
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
    return RankTable(int(d["rank"]), int(d["ep"]), tuple(slots), tasks, loads)


def make_policy(recipe, table: RankTable, ep_rank: int, live=None):
    """The rank's :class:`~tessera.engine.dbo.DBOPolicy`: ``dbo.pool_mem_gb`` (GB), ``dbo.log``;
    ``live``: the rank's :class:`~tessera.train.dbo_live.LiveCounts` (``dbo.routing: router``).

    Raises:
        ValueError: as :class:`~tessera.engine.dbo.DBOPolicy` (an EP rank outside the table's group).
    """
    from tessera.engine.dbo import DBOPolicy

    return DBOPolicy(table, ep_rank, pool_mem_gb=recipe.dbo.pool_mem_gb, log=recipe.dbo.log, live=live)


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
