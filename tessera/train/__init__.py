"""Training on Ray Train: the job around the engine.

Modules (Ray is imported only where it is needed):

* :mod:`tessera.train.data`: byte-level corpus, fixed-length sequences, replica shards, position;
* :mod:`tessera.train.step`: ``make_step_runner(recipe, program, rank_info, groups)``: one
  iteration of a rank's Program on the engine;
* :mod:`tessera.train.metrics`: job metrics (loss, tokens/s, MFU, bubble), JSONL / W&B / console;
* :mod:`tessera.train.checkpoint`: per-rank parts with markers, complete-only restore;
* :mod:`tessera.train.driver`: the named driver actor (plan, Programs, status, upgrades);
* :mod:`tessera.train.worker`: the per-worker train loop (``WorkerLoop``);
* :mod:`tessera.train.hooks`: worker hooks (``WorkerHooks``, ``HookSpec``, resolved by import path);
* :mod:`tessera.train.trainer`: the ``TorchTrainer`` (scaling, failures, storage) from the recipe's ``job`` section;
* :mod:`tessera.train.job`: the job (pre-flight on the cluster, run directory, driver, metrics pump, ``fit()``); the command line is :mod:`tessera.cli.train`, ``python -m tessera.launch`` its entrypoint for ``ray job submit``;
* :mod:`tessera.train.preflight`, :mod:`tessera.train.ray_setup`: checks before Ray starts, connecting to Ray.
"""
