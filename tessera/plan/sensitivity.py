"""Plan sensitivity: does the chosen partition survive the spread of the costs it was chosen on?

The paper leaves open how robust a plan is to cost error (its future work 2). Here: draw
``samples`` perturbed copies of the costs, each task's ``ms`` multiplied by ``1 + u`` with ``u``
uniform in ``[-spread, spread]`` (independently per task and layer, and per measured pair
time of a profile; a seeded
``numpy.random.default_rng``, so a run is reproducible), re-plan on every copy, and evaluate both
the chosen plan and the re-planned one on that copy. Reported:

* ``partition_changed_share``: the share of copies whose plan has another partition;
* ``worst_loss`` / ``mean_loss``: over copies, ``evaluate(chosen) / min(evaluate(chosen),
  evaluate(replanned)) - 1``: how much slower the chosen plan is than the best plan known for
  those costs (0 when the chosen plan is as good).

Planning and evaluating are given as callables (:func:`tessera.flow.plan_sensitivity` builds
them from the recipe: the planner with the recipe's settings, the simulated iteration), so this
module needs neither the simulator nor the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from tessera.cost.types import LayerCost, ModelCosts
from tessera.program.plan import Plan

__all__ = ["SensitivityReport", "perturbed", "sensitivity"]


@dataclass(frozen=True)
class SensitivityReport:
    """Result of :func:`sensitivity` (module docstring). ``partitions``: each distinct partition
    planned (stage sizes) with how many copies chose it; ``chosen_ms``/``replanned_ms``: per copy
    the two plans' evaluations, ms."""

    spread: float
    samples: int
    seed: int
    partition_changed_share: float
    worst_loss: float
    mean_loss: float
    partitions: tuple[tuple[tuple[int, ...], int], ...]
    chosen_ms: tuple[float, ...]
    replanned_ms: tuple[float, ...]

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def perturbed(costs: ModelCosts, spread: float, rng: np.random.Generator) -> ModelCosts:
    """``costs`` with every task's ms times ``1 + u``, ``u ~ U[-spread, spread]`` (module docstring).

    Raises:
        ValueError: ``spread`` outside [0, 1).
    """
    if not 0 <= spread < 1:
        raise ValueError(f"spread={spread}: must be in [0, 1) (a relative cost error)")

    def layer(lc: LayerCost) -> LayerCost:
        u = rng.uniform(-spread, spread, size=len(lc.tasks))
        return replace(lc, tasks=tuple(replace(t, ms=t.ms * (1.0 + float(x))) for t, x in zip(lc.tasks, u)))

    pairs = tuple((k, w, ms * (1.0 + float(rng.uniform(-spread, spread)))) for k, w, ms in costs.measured_pairs)
    return replace(costs, layers=tuple(layer(lc) for lc in costs.layers), embed=layer(costs.embed),
                   head=layer(costs.head), measured_pairs=pairs)


def sensitivity(costs: ModelCosts, chosen: Plan, plan_fn: Callable[[ModelCosts], Plan],
                evaluate_fn: Callable[[ModelCosts, Plan], float], *, spread: float = 0.05, samples: int = 10,
                seed: int = 0) -> SensitivityReport:
    """Perturb, re-plan and compare (module docstring).

    Args:
        costs: the costs ``chosen`` was planned on.
        chosen: the plan to test.
        plan_fn: ``costs -> plan`` with the same planner settings.
        evaluate_fn: ``(costs, plan) -> ms`` (e.g. the simulated iteration; ``inf``: infeasible).
        spread: relative half-width of the perturbation; samples: copies; seed: the generator's seed.

    Raises:
        ValueError: ``samples < 1`` or a bad ``spread``.
    """
    if samples < 1:
        raise ValueError(f"samples={samples}: must be >= 1")
    rng = np.random.default_rng(seed)
    counts: dict[tuple[int, ...], int] = {}
    chosen_ms, replanned_ms, losses = [], [], []
    changed = 0
    for _ in range(samples):
        c = perturbed(costs, spread, rng)
        plan = plan_fn(c)
        sizes = tuple(plan.partition.sizes())
        counts[sizes] = counts.get(sizes, 0) + 1
        changed += sizes != tuple(chosen.partition.sizes())
        a, b = evaluate_fn(c, chosen), evaluate_fn(c, plan)
        chosen_ms.append(a)
        replanned_ms.append(b)
        losses.append(a / min(a, b) - 1.0 if np.isfinite(a) and min(a, b) > 0 else float("inf"))
    return SensitivityReport(spread, samples, seed, changed / samples, max(losses), float(np.mean(losses)),
                             tuple(sorted(counts.items(), key=lambda kv: -kv[1])), tuple(chosen_ms),
                             tuple(replanned_ms))
