"""The job on the head node: what starts, watches and talks to the Ray Train workers.

:mod:`~tessera.train.job.run` is the training job (pre-flight on the cluster, run directory,
driver actor, metrics pump, ``TorchTrainer.fit()``) and :mod:`~tessera.train.job.profile` the
profile job on the same workers; :mod:`~tessera.train.job.driver` is the named driver actor
(plans, serves Programs, collects metrics, takes upgrade RPCs), :mod:`~tessera.train.job.client`
a separate process reaching it (``tessera status | upgrade | rollback``),
:mod:`~tessera.train.job.trainer` the ``TorchTrainer`` built from the recipe's ``job`` section,
:mod:`~tessera.train.job.preflight` the checks before Ray starts,
:mod:`~tessera.train.job.ray_setup` connecting to Ray, and :mod:`~tessera.train.job.outputs`
where a run's outputs live. A change to how a job is launched, supervised or reached belongs here.
"""
