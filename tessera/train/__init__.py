"""Training on Ray Train: the job around the engine, in rooms by concern.

The sub-packages read top-down; each imports only those below it (an import-linter ``layers``
contract in ``pyproject.toml``, ``docs/CONTRACTS.md``):

* :mod:`tessera.train.job` and :mod:`tessera.train.report`: what runs on the head node (the
  training and profile jobs, the driver actor, the client, pre-flight, Ray set-up) and the report
  of a finished run;
* :mod:`tessera.train.profile`: profiling on the workers (the profile loop, candidate pairs, fits,
  the router's token counts);
* :mod:`tessera.train.worker`: the training worker (loop, step, metrics, checkpoints, data, hooks,
  drift, Hugging Face I/O);
* :mod:`tessera.train.upgrade` | :mod:`tessera.train.dbo`: what a live plan change needs (versions,
  validation, switch step, parameter moves) | the bubble optimizer's live side (unit tables,
  live router counts and their transports);
* :mod:`tessera.train.storage`: below them all, the run directory on local disk or object
  storage (``logging.out_dir=s3://...`` / ``gs://...``) through ``pyarrow.fs``.

Ray is imported only where it is needed. The command line is :mod:`tessera.cli`;
``python -m tessera.launch`` is ``tessera train``'s entrypoint for ``ray job submit``.
"""
