"""Cost sources: per-task durations and per-layer memory as one frozen ``ModelCosts``.

Modules: :mod:`~tessera.cost.types` (``ModelCosts``, ``LayerCost``, ``TaskCost``, ``LayerMemory``,
``TaskKey``, ``ParallelShape``; re-exports ``Phase``, ``Resource``, ``TaskKind`` of
:mod:`tessera.spec.tasks`), :mod:`~tessera.cost.analytic` (roofline costs: the tasks of
:func:`tessera.spec.tasks.layer_shapes` with durations and memory attached, from
:mod:`~tessera.cost.flops`, :mod:`~tessera.cost.memory`, :mod:`~tessera.cost.comm`),
:mod:`~tessera.cost.measured` (engine-measured task times), :mod:`~tessera.cost.uniform`
(synthetic costs for closed-form checks). See ``docs/cost-model.md``.
"""
