"""The discrete-event simulator of Programs over ``ModelCosts``, and its outputs.

Modules: :mod:`~tessera.sim.simulator` (``simulate(programs, costs) -> SimResult``),
:mod:`~tessera.sim.result` (``SimResult`` and its records), :mod:`~tessera.sim.trace` (Chrome
trace), :mod:`~tessera.sim.critical` (the critical path of an iteration),
:mod:`~tessera.sim.timeline` (PNG timeline). It reads Programs and costs only: no
template rules, plan or recipe (a Program's template name is copied as provenance).
"""
