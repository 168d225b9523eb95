"""The per-worker function of a profile run (:func:`profile_loop`; see :mod:`tessera.train.job.profile`).

Each rank builds its stages from the driver's Program (planned on the analytic costs) and runs
the whole Program, with no optimizer step (the weights never change):

1. **Tasks** (``eager_comm``: every all-to-all is waited inside its own task, so a dispatch or
   combine task's time is the real all-to-all over the EP group at the real message size):
   ``profile.warmup`` untimed iterations, then up to ``profile.reps`` timed ones; every task of
   every microbatch is one sample of its item (:func:`tessera.cost.profile_costs.task_signature`:
   layers of one kind share an item).
2. **Program pairs** (all-to-alls asynchronous, as in training): each ``FB`` instruction's wall
   time is one sample of its pair item, co-executed in the order the plan stores.
3. **Candidate pairs** the Program does not run (:mod:`tessera.train.profile.pairs`), each timed
   co-executed alone, ``warmup`` + ``reps`` runs.
4. **p2p**: a ping-pong of one activation between pipeline ranks 0 and 1 of every replica
   (:func:`tessera.engine.p2p.ping_pong_ms`).

Rank 0 decides before each timed iteration (and each candidate-pair round) whether the budget
(``profile.budget_s``) allows it and tells every rank (a broadcast, so ranks stop together);
progress goes to the driver (``profile_progress``: timed iterations and pair rounds done of all).
"""

from __future__ import annotations

import time

import torch

__all__ = ["profile_loop", "device_name", "PAIRS_KEY"]

PAIRS_KEY = "profile_pairs"
"""Key of the worker config dict holding the candidate pairs to time (``PairSpec.to_dict`` list)."""


def device_name(device: str) -> str:
    """The device's name: the CUDA device name, or ``"cpu (<processor>)"``."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def profile_loop(config: dict) -> None:
    """Ray Train's per-worker function of a profile run (module docstring); ``config`` is a
    :meth:`~tessera.train.worker.loop.WorkerConfig.to_dict` plus :data:`PAIRS_KEY`."""
    from tessera.config.resolve import resolve_hardware
    from tessera.cost.analytic import analytic_costs
    from tessera.cost.profile_costs import task_signature
    from tessera.cost.types import ParallelShape
    from tessera.engine import Batch, Engine
    from tessera.engine.p2p import ping_pong_ms
    from tessera.train.profile.fit import pair_items
    from tessera.train.profile.pairs import PairSpec, time_candidate_pairs
    from tessera.train.worker.loop import WorkerConfig, WorkerLoop

    loop = WorkerLoop.setup(WorkerConfig.from_dict(config))
    recipe, runner, rank = loop.recipe, loop.runner, loop.rank
    prof = recipe.profile
    specs = [PairSpec.from_dict(d) for d in config.get(PAIRS_KEY, ())]
    rounds = -(-len(specs) // recipe.parallel.pp)
    total = 2 * prof.reps + rounds
    costs = analytic_costs(loop.model, resolve_hardware(recipe), ParallelShape.of(recipe.parallel))
    pair_item = pair_items(costs, runner.program)
    samples: dict[str, list[float]] = {}
    modules, groups, program = runner.modules, runner.groups, runner.program
    t_start = time.perf_counter()
    iterations = 0

    def in_budget() -> bool:
        return prof.budget_s <= 0 or time.perf_counter() - t_start < prof.budget_s

    def go_on(done: int) -> bool:
        """Rank 0's decision, broadcast: another timed iteration within reps and budget."""
        ok = done < prof.reps and in_budget()
        return bool(loop.session.broadcast(ok if rank == 0 else None, rank))

    def progress(done: int, phase: str) -> None:
        if rank == 0:
            loop.driver.send("profile_progress", done, total, phase)

    for eager in (True, False):  # tasks alone, then pairs as in training
        engine = Engine(program, modules, groups, None, profile=True, eager_comm=eager)
        done = 0
        for it in range(prof.warmup + prof.reps):
            timed = it >= prof.warmup
            if timed and not go_on(done):
                break
            result = engine.run_iteration(Batch.from_tokens(loop.data.next_batch().to(runner.device)))
            for m in modules:
                m.zero_grad(set_to_none=True)
            for chunk in engine.chunks:
                timings = getattr(chunk, "timings", [])
                if timed and eager:
                    for key, ms in timings:
                        samples.setdefault(task_signature(costs, key), []).append(float(ms))
                timings.clear()
            if timed and not eager:
                per_instr: dict[int, float] = {}
                for rec in result.profile:
                    if rec.index in pair_item:
                        per_instr[rec.index] = per_instr.get(rec.index, 0.0) + rec.ms
                for i, ms in per_instr.items():
                    samples.setdefault(pair_item[i], []).append(ms)
            if timed:
                done += 1
                progress((0 if eager else prof.reps) + done, "tasks" if eager else "program pairs")
        iterations = done if eager else min(iterations, done)
        loop.session.barrier()
    if specs:
        samples.update(time_candidate_pairs(
            loop, specs, warmup=prof.warmup, reps=prof.reps,
            budget_left=lambda: bool(loop.session.broadcast(in_budget() if rank == 0 else None, rank)),
            on_round=lambda d, n: progress(2 * prof.reps + d, "candidate pairs")))
        loop.session.barrier()
    p = recipe.parallel
    p2p = ping_pong_ms(groups, torch.zeros(p.micro_batch_size, p.seq_length, loop.model.hidden, device=runner.device))
    if p2p is not None:
        samples["p2p"] = [p2p]
    loop.driver.call("report_profile", rank, {"samples": samples, "iterations": iterations,
                                              "device": device_name(loop.device)})
    loop.session.barrier()
