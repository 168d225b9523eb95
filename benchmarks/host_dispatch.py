"""Host time of PyTorch eager dispatch on this machine's CPU: the Python and ATen-dispatcher share
of issuing one kernel, which the GPU presets' ``host_kernel_us`` adds to a cited ``cudaLaunchKernel``
cost (``docs/cost-model.md``, "Host time and CUDA graphs").

Usage::

    python benchmarks/host_dispatch.py [--json FILE] [--reps 7]

Every figure is the median over ``--reps`` timed loops (after a warm-up) of one thread, on tiny
CPU tensors (8 or 4 x 16 elements), so the arithmetic is negligible and what is timed is the
host path: Python, the dispatcher, autograd recording, the allocator.

* ``aten_op_us``: ``torch.add`` of two tensors without autograd;
* ``aten_op_autograd_us``: one op of a chain of 50 ``x * c`` on a tensor that requires grad (what
  a module's forward issues per kernel);
* ``backward_node_us``: the same chain's ``backward()`` per autograd node (the C++ engine runs
  the backward kernels' dispatch without Python);
* ``linear_forward_us``: ``torch.nn.Linear(16, 16)`` forward (module call + ``F.linear``), to set
  beside the 13.48 us Transformer Engine issue 2053 measured for the same call with CUDA tensors
  on a DGX H100's Xeon Platinum 8480C (where the cuBLAS host path and the launch come on top).

Writes ``{"host": {...}, "results": {...}}`` (``host``: CPU model, cores, torch version).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

CHAIN = 50


def per_call_us(fn, calls: int, reps: int) -> float:
    """Median over ``reps`` loops of ``calls`` calls of ``fn`` (after a warm-up), microseconds per call."""
    for _ in range(max(10, calls // 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def measure(reps: int = 7) -> dict:
    """The four figures of the module docstring, microseconds."""
    import torch

    torch.set_num_threads(1)
    x, y = torch.randn(8), torch.randn(8)
    xg = torch.randn(8, requires_grad=True)

    def chain():
        z = xg
        for _ in range(CHAIN):
            z = z * 1.0001
        return z

    def chain_backward():
        chain().sum().backward()

    lin = torch.nn.Linear(16, 16)
    a = torch.randn(4, 16, requires_grad=True)
    fwd = per_call_us(chain, 200, reps) / CHAIN
    fwd_bwd = per_call_us(chain_backward, 100, reps) / CHAIN
    return {"aten_op_us": per_call_us(lambda: torch.add(x, y), 5000, reps),
            "aten_op_autograd_us": fwd,
            "backward_node_us": fwd_bwd - fwd,
            "linear_forward_us": per_call_us(lambda: lin(a), 2000, reps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write host and results to FILE")
    ap.add_argument("--reps", type=int, default=7, help="timed loops per figure (median)")
    args = ap.parse_args(argv)
    import os

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"host": {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": 1},
           "results": measure(args.reps)}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
