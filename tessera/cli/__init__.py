"""The ``tessera`` command line: one module per verb.

* :mod:`~tessera.cli.main`: the parser and :data:`~tessera.cli.main.SUBCOMMANDS` (entry point
  ``tessera = tessera.cli.main:main``);
* :mod:`~tessera.cli.common`: the shared recipe arguments, recipe loading, output directory,
  exit codes;
* :mod:`~tessera.cli.simulate`, :mod:`~tessera.cli.plan`, :mod:`~tessera.cli.train`: the verbs
  (future verbs such as ``profile``, ``status``, ``upgrade``, ``rollback``, ``report`` go beside
  them);
* :mod:`~tessera.cli.console`: rich consoles that never elide numbers or paths.

The verbs only parse, call the library (:mod:`tessera.flow`, :mod:`tessera.train.job.run`) and
print; the work lives below them.
"""
