"""Candidate F&B pairs timed co-executed on the workers (``tessera profile``).

The planner costs every candidate pair of every overlap edge (``PlanReport.pairs_total``); a
Program co-executes only the few of its own partition. :func:`candidate_pair_specs` (job side)
lists one :class:`PairSpec` per distinct pair item (:func:`tessera.cost.profile_costs.pair_item`:
the two chunks' layer kind codes, so pairs of equal layers are timed once) over the candidates
the planner used (its baseline's stage boundaries, ``PlanReport.radius``), each with the order
the planner would store for it (:func:`tessera.plan.pair_cost.best_pair` with the pair scheduler:
overlapped, or back to back where overlapping does not pay).

:func:`time_candidate_pairs` (worker side) runs them after the Program's passes. Pipeline rank
``r`` takes specs ``r, r + pp, r + 2 pp, ...``; the EP peers of a rank (same pipeline rank, other
replicas) iterate the same list in the same order, so their all-to-alls match. Each pair: the
two chunks are built as the worker builds its stages (:func:`tessera.train.worker.step.build_stage`, the
candidate's layer range, the rank's EP group), the B chunk runs the forward of microbatch 0
(untimed), then F of microbatch 1 and B of microbatch 0 run in the spec's order through the
engine's own pair code (:func:`tessera.engine.pairs.pair_steps` over
:class:`tessera.engine.tasks.TorchChunk`, asynchronous all-to-alls over the EP group at the
real message sizes). Inputs: token ids for an embedding chunk, else a normal activation
``[micro_batch_size, seq_length, hidden]``; the output gradient likewise. ``warmup`` untimed then
``reps`` timed runs per pair; rank 0 decides before each round whether ``profile.budget_s``
allows it (broadcast), so pairs never reached stay without a time (planned from task times).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["PairSpec", "candidate_pairs", "candidate_pair_specs", "time_candidate_pairs"]


@dataclass(frozen=True)
class PairSpec:
    """One candidate pair to time: ``item`` (its pair item), the F and B chunks' extended layer
    ranges ``[start, stop)``, ``with_w`` (the B side carries its W tasks), ``order`` (a
    ``PairOrder.order``: per resource the task names) and ``overlapped`` (False: the two chunks
    back to back)."""

    item: str
    f_range: tuple[int, int]
    b_range: tuple[int, int]
    with_w: bool
    order: tuple[tuple[str, tuple[str, ...]], ...]
    overlapped: bool

    def to_dict(self) -> dict:
        return {"item": self.item, "f_range": list(self.f_range), "b_range": list(self.b_range),
                "with_w": self.with_w, "order": [[r, list(names)] for r, names in self.order],
                "overlapped": self.overlapped}

    @staticmethod
    def from_dict(d: dict) -> "PairSpec":
        return PairSpec(d["item"], tuple(d["f_range"]), tuple(d["b_range"]), bool(d["with_w"]),
                        tuple((r, tuple(n)) for r, n in d["order"]), bool(d["overlapped"]))


def candidate_pairs(costs, report) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Pair item -> ``(F range, B range)`` of its first candidate pair, over the candidate pairs
    the planner costed for ``report`` (a :class:`~tessera.plan.planner.PlanReport` made on
    ``costs``: the candidates of radius ``report.radius`` around its layout's baseline, every
    overlap edge), in the planner's order; empty without overlap."""
    from tessera.cost.profile_costs import pair_item
    from tessera.plan.baseline import baseline_plan
    from tessera.plan.overlap_graph import distinct_pairs, overlap_edges
    from tessera.plan.planner import candidate_ranges

    t = report.tessera
    if not t.overlap:
        return {}
    base = baseline_plan(costs, t.template, t.pp, t.vpp, t.num_microbatches, overlap=t.overlap, split_w=t.split_w)
    cands = candidate_ranges(base.partition, report.radius, len(costs.layers), report.alone)
    out: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
    for f_range, b_range in distinct_pairs(costs, cands, overlap_edges(t.template, t.pp, t.vpp, t.num_microbatches)):
        out.setdefault(pair_item(costs, f_range, b_range), (tuple(f_range), tuple(b_range)))
    return out


def candidate_pair_specs(costs, report) -> tuple[PairSpec, ...]:
    """One :class:`PairSpec` per distinct pair item of :func:`candidate_pairs`, with the order
    the planner stores for it (module docstring)."""
    from tessera.plan.pair_cost import best_pair
    from tessera.plan.pair_scheduler import schedule_pair

    out = []
    for item, (f_range, b_range) in candidate_pairs(costs, report).items():
        ch = best_pair(costs, f_range, b_range, report.with_w, schedule_pair)
        out.append(PairSpec(item, f_range, b_range, report.with_w, ch.pair_order(0, 0, report.with_w).order,
                            ch.overlapped))
    return tuple(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _PairRun:
    """The two chunks of one spec and its step sequence (module docstring)."""

    def __init__(self, spec: PairSpec, chunk, structure) -> None:
        from tessera.engine.pairs import pair_steps
        from tessera.engine.tables import pair_b_runs
        from tessera.sched.structure import order_ids, pair_structure

        self.spec = spec
        self.f, self.b = chunk(spec.f_range), chunk(spec.b_range)
        dag = pair_structure(structure, spec.f_range, spec.b_range, spec.with_w)
        self.steps = pair_steps(dag, order_ids(dag, spec.order), self.f.task_keys("F"), self.b.task_keys("B"),
                                self.b.task_keys("W"), spec.with_w)
        self.runs = pair_b_runs(self.b, self.steps)  # the B side's autograd segments, as the engine's FB

    def once(self, inputs) -> float:
        """One co-executed run, ms (module docstring); ``inputs(chunk) -> (input, labels)``."""
        from tessera.engine.tasks import Lazy

        f, b, mod_b = self.f, self.b, self.b.module
        xb, lb = inputs(b)
        b.begin_forward(0, Lazy.of(xb), lb, self.runs)
        for k in b.task_keys("F"):
            b.run(k, 0)
        grad = None if mod_b.has_head else Lazy.of(torch.randn_like(b.output(0).detach()))
        xf, lf = inputs(f)
        device = xf.device
        _sync(device)
        t0 = time.perf_counter()
        f.begin_forward(1, Lazy.of(xf), lf, None)
        b.begin_backward(0, grad, defer_w=True)
        for ps in self.steps:
            if ps.side == "F":
                f.run(ps.key, 1)
            elif ps.key.phase == "W":
                b.run_w(0, ps.key)
            else:
                b.run(ps.key, 0)
        if self.spec.with_w:
            b.run_w(0)
        if not f.module.has_head:
            f.output(1)  # the F side's last combine may still be in flight
        _sync(device)
        ms = (time.perf_counter() - t0) * 1e3
        f.end_iteration()
        if b is not f:
            b.end_iteration()
        return ms


def time_candidate_pairs(loop, specs, *, warmup: int, reps: int, budget_left, on_round=None) -> dict[str, list[float]]:
    """Time this rank's share of ``specs`` (module docstring) on a set-up
    :class:`~tessera.train.worker.loop.WorkerLoop`; returns ``item -> reps`` samples, ms.

    ``budget_left()`` is called on every rank once per round (a collective: rank 0's answer);
    ``on_round(done, total)`` after each round (rank 0 reports progress).
    """
    from tessera.engine.tasks import TorchChunk
    from tessera.sched.structure import ModelStructure
    from tessera.train.worker.step import build_stage, program_splits_w

    recipe, model, runner = loop.recipe, loop.model, loop.runner
    groups, p = runner.groups, recipe.parallel
    pp, me = p.pp, groups.pipeline_rank if groups is not None else 0
    ep = groups.ep if groups is not None else None
    counts = groups.ep_counts if groups is not None else None
    split_w = program_splits_w(runner.program)
    structure = ModelStructure.of_specs(model.layers)
    rounds = -(-len(specs) // pp)
    mine = {r: specs[r * pp + me] for r in range(rounds) if r * pp + me < len(specs)}
    last_use: dict[tuple[int, int], int] = {}
    for r, s in mine.items():
        last_use[s.f_range] = last_use[s.b_range] = r
    built: dict[tuple[int, int], TorchChunk] = {}

    def chunk(rng: tuple[int, int]) -> TorchChunk:
        if rng not in built:
            built[rng] = TorchChunk(build_stage(recipe, model, rng, groups, runner.device, split_w), ep,
                                    counts_group=counts)
        return built[rng]

    def inputs(ch: TorchChunk, gen: torch.Generator):
        mod = ch.module
        param = next(mod.parameters())
        shape = (p.micro_batch_size, p.seq_length)
        labels = torch.randint(0, model.vocab, shape, generator=gen).to(param.device) if mod.has_head else None
        if mod.has_embed:
            return torch.randint(0, model.vocab, shape, generator=gen).to(param.device), labels
        x = torch.randn(*shape, model.hidden, generator=gen).to(device=param.device, dtype=param.dtype)
        return x, labels

    samples: dict[str, list[float]] = {}
    for r in range(rounds):
        if not budget_left():
            break
        spec = mine.get(r)
        if spec is not None:
            gen = torch.Generator().manual_seed(recipe.train.seed + r)
            run = _PairRun(spec, chunk, structure)
            got = [run.once(lambda ch: inputs(ch, gen)) for _ in range(warmup + reps)][warmup:]
            samples[spec.item] = got
            for rng in [k for k, last in last_use.items() if last <= r and k in built]:
                del built[rng]  # no later pair of this rank uses the chunk
        if on_round is not None:
            on_round(r + 1, rounds)
    return samples
