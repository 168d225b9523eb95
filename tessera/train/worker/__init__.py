"""The training worker: what every Ray Train worker runs, one iteration after another.

:mod:`~tessera.train.worker.loop` is the per-worker loop (``WorkerLoop``: set-up, restore, steps,
upgrades at an iteration boundary, checkpoints, metrics), :mod:`~tessera.train.worker.step` one
iteration of the rank's Program on the engine, :mod:`~tessera.train.worker.metrics` the job's
metrics (MFU, bubble, fill rate) and where they go, :mod:`~tessera.train.worker.checkpoint`
per-rank checkpoint parts, :mod:`~tessera.train.worker.data` the training data,
:mod:`~tessera.train.worker.hooks` worker hooks, :mod:`~tessera.train.worker.links` what the loop
asks of the driver and of Ray, :mod:`~tessera.train.worker.drift` the profile-drift check and
:mod:`~tessera.train.worker.hf_io` Hugging Face checkpoints. Nothing here imports the job, the
profiler or the report; a change to what a worker does each step belongs here.
"""
