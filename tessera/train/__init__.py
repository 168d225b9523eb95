"""Training on Ray Train: the job around the engine.

Modules (Ray is imported only where it is needed):

* :mod:`tessera.train.data`: byte-level corpus, fixed-length sequences, replica shards, position;
* :mod:`tessera.train.step`: ``make_step_runner(recipe, program, rank_info, groups)``: one
  iteration of a rank's Program on the engine;
* :mod:`tessera.train.metrics`: job metrics (loss, tokens/s, MFU, bubble), JSONL / W&B / console;
* :mod:`tessera.train.checkpoint`: per-rank parts with markers, complete-only restore;
* :mod:`tessera.train.driver`: the named driver actor (plan, Programs, status, upgrades);
* :mod:`tessera.train.worker`: the per-worker train loop;
* :mod:`tessera.train.trainer`: the ``TorchTrainer`` (scaling, failures, storage);
* :mod:`tessera.launch`: ``python -m tessera.launch`` / ``tessera train``.
"""
