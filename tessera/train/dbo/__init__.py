"""The dynamic bubble optimizer's live side in the training job.

:mod:`~tessera.train.dbo.table` builds each rank's unit table and the engine's policy from a
Program, :mod:`~tessera.train.dbo.live` collects the router's live token counts of the running
iteration, and the count transports share them over the EP group: the all-gather
(:mod:`~tessera.train.dbo.transport`) or a Ray compiled graph (:mod:`~tessera.train.dbo.graph`,
:mod:`~tessera.train.dbo.graph_transport`), picked by :mod:`~tessera.train.dbo.factory`. The
optimizer's logic itself is :mod:`tessera.dbo` (shared with the simulator) and
:mod:`tessera.engine.dbo`; this package is independent of :mod:`tessera.train.upgrade` and below
the worker.
"""
