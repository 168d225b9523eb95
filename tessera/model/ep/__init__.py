"""Expert-parallel (EP) exchange over a ``torch.distributed`` group: one plan, two fronts.

Group rank ``r`` owns global experts ``[r * E_l, (r + 1) * E_l)`` (``E_l = num_experts // ep``);
a rank sends its rows sorted by (global expert, token) and each owner's experts see their rows in
(source rank, token) order.

Modules:

* :mod:`~tessera.model.ep.plan` (shared): group size and rank, the counts exchange (on a counts
  group of its own, one host read per MoE layer and microbatch) and the plan (:class:`A2APlan`:
  send/recv splits, regroup permutation and its inverse built on the device; :class:`ExpertRoute`
  with the no-EP case), the row orders (:func:`expert_major`, :func:`source_major`,
  single-process :func:`stack_rows` / :func:`unstack_rows`) and the one raw row all-to-all.
* :mod:`~tessera.model.ep.sync`: the synchronous front, autograd all-to-alls
  (:func:`dispatch_tokens`, :func:`combine_tokens`), used by the MoE layer
  (:mod:`tessera.model.moe`) and so by the torch.distributed.pipelining path.
* :mod:`~tessera.model.ep.asynchronous`: the asynchronous front, start / wait handles without
  autograd (:class:`InFlight`, :func:`start_dispatch`, :func:`start_combine`,
  :func:`start_combine_grad`), used by the engine's task handlers (:mod:`tessera.engine.tasks`).

Both fronts run the same ops on the same tensors, so their results are bitwise equal.
"""

from tessera.model.ep.asynchronous import InFlight, start_all_to_all, start_combine, start_combine_grad, start_dispatch
from tessera.model.ep.plan import (
    A2APlan,
    ExpertRoute,
    RouteCounts,
    ep_rank,
    ep_size,
    exchange_counts,
    exchange_route_counts,
    expert_major,
    issue_all_to_all,
    plan_a2a,
    plan_route,
    read_route,
    regroup_permutation,
    source_major,
    stack_rows,
    unstack_rows,
)
from tessera.model.ep.sync import all_to_all, combine_tokens, dispatch_tokens

__all__ = [
    "A2APlan", "ExpertRoute", "InFlight", "RouteCounts", "all_to_all", "combine_tokens", "dispatch_tokens", "ep_rank",
    "ep_size", "exchange_counts", "exchange_route_counts", "expert_major", "issue_all_to_all", "plan_a2a",
    "plan_route", "read_route", "regroup_permutation", "source_major", "stack_rows", "start_all_to_all",
    "start_combine", "start_combine_grad", "start_dispatch", "unstack_rows",
]
