"""Expert parallelism over 2 gloo processes against the same layer with all experts local.

Scenarios (one launch, run in order on both ranks):
  * ``dropless``: EP=2 forward + backward vs EP=1 on the two ranks' tokens concatenated.
    Bitwise (torch.equal): layer outputs, input grads, routed-expert weight grads (each expert sees
    the same rows in the same order: source rank 0's, then rank 1's). Allclose: grads of replicated
    weights (router, norm, shared expert), which EP=2 sums over ranks and EP=1 forms in one GEMM.
  * ``one_rank``: every token routed to rank 0's experts; rank 1's experts get empty inputs,
    take part in every all-to-all, and their grads are exactly zero.
  * ``drop``: drop_tokens with capacity factor 1.0 (per-rank capacity, as in DeepSpeed): each
    expert keeps min(requested, capacity) routes; outputs equal EP=1 run per rank bitwise.
"""

from __future__ import annotations

import pytest
import torch

from tessera.spec.model import LayerSpec, ModelSpec, MoESpec
from tessera.testing.launch_local import run_local

pytestmark = pytest.mark.xdist_group("ep")  # module fixtures built once (tests/conftest.py)

HIDDEN, BATCH, SEQ, SEED = 32, 2, 16, 21
TIMEOUT_S = 240


def spec_and_options(mode: str):
    from tessera.model import MoEOptions

    moe = MoESpec(num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32, aux_loss_coef=0.0)
    model = ModelSpec("ep-test", HIDDEN, 64, (LayerSpec(0, None, moe),))
    if mode == "drop":
        return model, MoEOptions(drop_tokens=True, capacity_factor=1.0, min_capacity=1)
    return model, MoEOptions()


def make_data(mode: str):
    """x, target: ``[2 ranks, B, S, H]``."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, BATCH, SEQ, HIDDEN, generator=g)
    target = torch.randn(2, BATCH, SEQ, HIDDEN, generator=g)
    if mode == "one_rank":
        x[..., 0] = x[..., 0].abs() + 4.0
    return x, target


def build(mode: str, ep_group):
    from tessera.model import DecoderLayer

    model, options = spec_and_options(mode)
    layer = DecoderLayer(model, model.layers[0], moe=options, ep_group=ep_group, seed=SEED)
    if mode == "one_rank":  # experts 0-3 (rank 0 under EP=2) win every token
        with torch.no_grad():
            w = layer.moe.gate.wg.weight
            w.mul_(0.01)
            w[:4, 0] = 2.0
            w[4:, 0] = -2.0
    return layer


def run(layer, x, target) -> dict:
    """Forward + backward through the task functions; returns tensors to compare."""
    x = x.clone().requires_grad_(True)
    h = layer.mixer(x)
    route = layer.router(h)
    d = layer.dispatch(route)
    out = layer.combine(layer.experts(d), d, route, layer.shared(route))
    (out * target).sum().backward()
    res = {"out": out.detach(), "dx": x.grad, "requested": route.requested, "counts": route.counts,
           "capacity": torch.tensor(route.capacity), "agreed": torch.tensor(d.capacity),
           "local_counts": torch.tensor(d.counts)}
    res.update({"g." + n: p.grad for n, p in layer.named_parameters()})
    return res


def world(rank: int, world_size: int) -> dict:
    """Every scenario on this rank (module docstring), in order; plain arrays per scenario."""
    import torch.distributed as dist

    results = {}
    for mode in ("dropless", "one_rank", "drop"):
        x, target = make_data(mode)
        layer = build(mode, dist.group.WORLD)
        results[mode] = {k: v.detach().numpy().copy() for k, v in run(layer, x[rank], target[rank]).items()}
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def ep2_results():
    ranks = run_local(world, 2, TIMEOUT_S)
    return {r: {m: {k: torch.from_numpy(v) for k, v in d.items()} for m, d in res.items()} for r, res in enumerate(ranks)}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (:func:`conftest.one_thread`)."""


def local_experts(mode_res: dict) -> dict:
    return {k: v for k, v in mode_res.items() if k.startswith("g.moe.experts.")}


def expert_name(global_e: int, rank_local: int, key: str) -> str:
    return key.replace(f"g.moe.experts.{rank_local}.", f"g.moe.experts.{global_e}.")


@pytest.mark.parametrize("mode", ["dropless", "one_rank"])
def test_ep2_equals_ep1(ep2_results, mode):
    x, target = make_data(mode)
    ref = run(build(mode, None), x.reshape(2 * BATCH, SEQ, HIDDEN), target.reshape(2 * BATCH, SEQ, HIDDEN))
    for rank in (0, 1):
        got = ep2_results[rank][mode]
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        assert torch.equal(got["out"], ref["out"][rows])
        assert torch.equal(got["dx"], ref["dx"][rows])
        for key, g in local_experts(got).items():  # rank r holds experts 4r .. 4r+3
            local = int(key.split(".")[3])
            assert torch.equal(g, ref[expert_name(4 * rank + local, local, key)]), key
        # capacity agreed over the group before dispatch: the max of the ranks' local capacities
        assert int(got["agreed"]) == max(int(ep2_results[r][mode]["capacity"]) for r in (0, 1))
    if mode == "dropless":  # the agreement matters: the local capacities differ here
        assert int(ep2_results[0][mode]["capacity"]) != int(ep2_results[1][mode]["capacity"])
    for key in ref:  # replicated weights: EP=2 sums per-rank grads, EP=1 forms one GEMM
        if key.startswith("g.") and not key.startswith("g.moe.experts."):
            torch.testing.assert_close(ep2_results[0][mode][key] + ep2_results[1][mode][key], ref[key],
                                       rtol=1e-5, atol=1e-5, msg=key)
    counts = ep2_results[0][mode]["counts"] + ep2_results[1][mode]["counts"]
    assert torch.equal(counts, ref["counts"])


def test_all_tokens_on_one_rank(ep2_results):
    r0, r1 = ep2_results[0]["one_rank"], ep2_results[1]["one_rank"]
    for res in (r0, r1):
        assert int(res["counts"][4:].sum()) == 0  # nobody routes to rank 1's experts
    assert int(r1["local_counts"].sum()) == 0 and int(r0["local_counts"].sum()) == 2 * 2 * BATCH * SEQ
    for key, g in local_experts(r1).items():
        assert torch.equal(g, torch.zeros_like(g)), key
    assert all(bool(g.abs().sum() > 0) for g in local_experts(r0).values())


def test_drop_tokens_capacity(ep2_results):
    x, target = make_data("drop")
    for rank in (0, 1):
        got = ep2_results[rank]["drop"]
        cap = int(got["capacity"])
        assert cap == -(-BATCH * SEQ * 2 // 8)  # ceil(T / E * cf * k) with cf = 1, k = 2
        assert torch.equal(got["counts"], torch.minimum(got["requested"], torch.tensor(cap)))
        assert int(got["requested"].max()) > cap  # some expert is oversubscribed ...
        assert int(got["counts"].max()) == cap  # ... and keeps exactly capacity routes
        ref = run(build("drop", None), x[rank], target[rank])  # capacity is per local batch
        assert torch.equal(got["out"], ref["out"]) and torch.equal(got["dx"], ref["dx"])
        assert torch.equal(got["counts"], ref["counts"])
