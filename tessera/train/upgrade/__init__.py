"""Live plan changes: what the driver validates and records, and what the workers apply.

:mod:`~tessera.train.upgrade.rpc` holds the driver's upgrade RPCs (upgrade by plan, recipe or
DBO switch; rollback), :mod:`~tessera.train.upgrade.check` the validation of a new plan against
the running job, :mod:`~tessera.train.upgrade.versions` the plan versions and their history,
:mod:`~tessera.train.upgrade.schedule` the iteration every rank switches at, and
:mod:`~tessera.train.upgrade.reshard` (with :mod:`~tessera.train.upgrade.dcp` and
:mod:`~tessera.train.upgrade.entries`) the move of parameters and optimizer state between
pipeline ranks. It is independent of :mod:`tessera.train.dbo` and below the worker, which applies
a switch.
"""
