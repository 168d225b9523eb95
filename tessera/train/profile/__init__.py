"""Profiling on the workers: timing tasks and F&B pairs, fitting what the times say, routing counts.

:mod:`~tessera.train.profile.setup` says what a profile run needs before any worker starts and
what it returns, :mod:`~tessera.train.profile.loop` is the per-worker function of a profile run
(built on the training worker's loop), :mod:`~tessera.train.profile.pairs` the candidate F&B
pairs timed co-executed, :mod:`~tessera.train.profile.fit` the calibration and overlap fits,
:mod:`~tessera.train.profile.progress` the console progress bar, and
:mod:`~tessera.train.profile.routes` the real router's token counts for the bubble optimizer's
recorded tables. The Ray job that runs a profile is :mod:`tessera.train.job.profile`; the drift
check during training is the worker's (:mod:`tessera.train.worker.drift`).
"""
