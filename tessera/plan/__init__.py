"""The overlap-aware planner and the baseline.

Modules: :mod:`~tessera.plan.baseline` (serial-balanced partition, the template's fixed order),
:mod:`~tessera.plan.candidates`, :mod:`~tessera.plan.overlap_graph`, the pair scheduler
(:mod:`~tessera.plan.pair_scheduler`, :mod:`~tessera.plan.pair_problem`,
:mod:`~tessera.plan.pair_polish`, :mod:`~tessera.plan.pair_cost`,
:mod:`~tessera.plan.schedule_check`), the exact pair ILP
(:mod:`~tessera.plan.pair_ilp`), the partition MILP (:mod:`~tessera.plan.milp`,
:mod:`~tessera.plan.milp_memory`, :mod:`~tessera.plan.incumbent`) and :mod:`~tessera.plan.planner`
(``make_plan``). Template facts (placement, co-executed pairs, whether an ``FB`` keeps W) come from
the registry in :mod:`tessera.program.templates`, never from template names. See ``docs/planner.md``.
"""
