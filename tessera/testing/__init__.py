"""Test tools, not used in training: the single-process bitwise reference
(:mod:`~tessera.testing.reference`) the engine is checked against, the local multi-process
launcher (:mod:`~tessera.testing.launch_local`) that runs a function on N gloo ranks, and the
fault-injection worker hooks of the Ray Train job (:mod:`~tessera.testing.faults`, named by import
path in :data:`tessera.train.worker.hooks.ENV_HOOKS`, never imported by ``tessera.train``).
"""

from tessera.testing.launch_local import WorkerError, run_local
from tessera.testing.reference import ReferenceResult, global_state_dict, reference_train

__all__ = ["ReferenceResult", "WorkerError", "global_state_dict", "reference_train", "run_local"]
