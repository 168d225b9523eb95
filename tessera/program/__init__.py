"""Plans and Programs: ``Plan``/``Partition``, the pipeline templates, the compiler, the validator
and the Program memory rule.

Modules: :mod:`~tessera.program.plan` (``Plan``, ``Partition``), :mod:`~tessera.program.templates`
(the template registry ``TEMPLATES`` / ``get_template``: every template fact, stage placement,
shape rules and compute order; ``stage_of``, ``rank_chunk_of``, ``check_shape``,
``compute_schedule``, ``co_executed_pairs`` look it up), :mod:`~tessera.program.instructions`
(the Program format), :mod:`~tessera.program.compiler` (Plan -> Programs),
:mod:`~tessera.program.validate`, :mod:`~tessera.program.memory`,
:mod:`~tessera.program.torch_schedule` (Programs as a torch.distributed.pipelining schedule CSV).
See ``docs/programs.md``.
"""
