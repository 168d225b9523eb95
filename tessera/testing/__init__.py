"""Test tools, not used in training: the single-process bitwise reference
(:mod:`~tessera.testing.reference`) the engine is checked against, the local multi-process
launcher (:mod:`~tessera.testing.launch_local`) that runs a function on N gloo ranks, the recorder of
the real ``torch.distributed`` calls and the NCCL communication rules checked over every rank's
records (:mod:`~tessera.testing.recorder`), and the
fault-injection worker hooks of the Ray Train job (:mod:`~tessera.testing.faults`, and the
straggler injection :mod:`~tessera.testing.slow`, named by import path in
:data:`tessera.train.worker.hooks.ENV_HOOKS`, never imported by ``tessera.train``).
"""

from tessera.testing.launch_local import WorkerError, run_local
from tessera.testing.recorder import (CommRecord, CommRecorder, Violation, check_all, check_collective_order,
                                      check_link_batches, check_p2p_batched, format_violations)
from tessera.testing.reference import ReferenceResult, global_state_dict, reference_train

__all__ = ["CommRecord", "CommRecorder", "ReferenceResult", "Violation", "WorkerError", "check_all",
           "check_collective_order", "check_link_batches", "check_p2p_batched", "format_violations",
           "global_state_dict", "reference_train", "run_local"]
