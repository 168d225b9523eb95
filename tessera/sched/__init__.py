"""Task DAGs of chunks and overlapped F&B pairs, and their execution in a given order.

Modules: :mod:`~tessera.sched.dag` (``Task``, ``TaskDAG``, ``TaskSchedule``, ``run_in_order``),
:mod:`~tessera.sched.structure` (the one DAG builder and the cost-free structure of chunks and
pairs over the spec's task split :func:`tessera.spec.tasks.layer_shapes`; task names of pair
orders), :mod:`~tessera.sched.chunkdag` (cost-carrying chunk and pair DAGs, the fixed order,
replaying a pair order).
"""
