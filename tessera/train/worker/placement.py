"""The layout a worker group runs: the recipe's rank order checked against the nodes Ray gave it.

At start every worker sends its node (Ray's node id) in one ``all_gather_object`` over the
default group (one host sync per worker-group start); each asks the driver
(:meth:`tessera.train.job.driver.Driver.place_ranks`, the same list from every rank, so the same
answer) for the slot -> rank map that gives the placement the plan assumed
(:func:`tessera.spec.placement.place`: which groups share a node), and builds its
:class:`~tessera.engine.groups.Layout` with it. A group of workers no map fits (a node with
another number of workers than ``hardware.gpus_per_node``) is refused in one line naming the
group that would cross nodes and the fix, before any process group is made.
"""

from __future__ import annotations

import socket


def gather_nodes(node_id: str, world: int, device: str) -> list[str]:
    """Every world rank's node id, by rank (a collective over the default group)."""
    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):  # all_gather_object on NCCL stages through the current device
        torch.cuda.set_device(torch.device(device))
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node_id)
    return [str(n) for n in nodes]


def placed_layout(recipe, rank: int, world: int, device: str, driver, node_id: str | None = None):
    """The :class:`~tessera.engine.groups.Layout` of this worker group (module docstring).

    ``node_id``: this worker's node (None: the host name, as local processes have). Raises the
    driver's TesseraConfigError when the workers' nodes cannot give the planned placement."""
    from tessera.engine.groups import Layout
    from tessera.spec.placement import resolve_order
    from tessera.config.resolve import resolve_hardware

    nodes = gather_nodes(node_id or socket.gethostname(), world, device)
    got = driver.call("place_ranks", nodes, rank == 0)
    if "error" in got:
        raise got["error"]
    p = recipe.parallel
    order = resolve_order(p.rank_order, resolve_hardware(recipe).gpus_per_node)
    return Layout(p.pp, p.dp, p.ep, order=order, ranks=tuple(got["ranks"]))
