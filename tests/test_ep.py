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

Then, in the same launch, the count exchange: the dropless layer again with a counts group of its
own (every ``all_to_all_single`` recorded with its group: the counts on the counts group, the
rows on the EP group; one host sync per layer per microbatch), and an engine run (pp=1, dp=2,
ep=2, two MoE layers, two microbatches) whose ``IterationResult.host_syncs`` counts one host sync
per MoE layer per microbatch. Single-process: the regroup permutation built on the device equals
a straightforward loop on random counts.
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


def build(mode: str, ep_group, counts_group=None):
    from tessera.model import DecoderLayer

    model, options = spec_and_options(mode)
    layer = DecoderLayer(model, model.layers[0], moe=options, ep_group=ep_group, seed=SEED, counts_group=counts_group)
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
           "capacity": torch.as_tensor(route.capacity), "agreed": torch.tensor(d.capacity),
           "local_counts": torch.tensor(d.counts)}
    res.update({"g." + n: p.grad for n, p in layer.named_parameters()})
    return res


def world(rank: int, world_size: int) -> dict:
    """Every scenario on this rank (module docstring), in order: plain arrays per scenario
    (``modes``), the count exchange's calls and host syncs (``counts``), the engine's (``engine``)."""
    import torch.distributed as dist

    results = {}
    for mode in ("dropless", "one_rank", "drop"):
        x, target = make_data(mode)
        layer = build(mode, dist.group.WORLD)
        results[mode] = {k: v.detach().numpy().copy() for k, v in run(layer, x[rank], target[rank]).items()}
    out = {"modes": results, "counts": counts_world(rank), "engine": engine_world()}
    dist.barrier()
    return out


def counts_world(rank: int) -> dict:
    """The dropless layer with a counts group of its own: every ``all_to_all_single`` as (group,
    dtype, shape), the layer's host syncs, and its output (to compare with the EP-group-only run)."""
    import torch.distributed as dist

    counts_group = dist.new_group([0, 1])
    calls, real = [], dist.all_to_all_single

    def recording(output, input, *args, group=None, **kwargs):
        name = "counts" if group is counts_group else "ep" if group is dist.group.WORLD else "other"
        calls.append((name, str(input.dtype), tuple(input.shape)))
        return real(output, input, *args, group=group, **kwargs)

    x, target = make_data("dropless")
    layer = build("dropless", dist.group.WORLD, counts_group)
    dist.all_to_all_single = recording
    try:
        res = run(layer, x[rank], target[rank])
    finally:
        dist.all_to_all_single = real
    return {"calls": calls, "host_syncs": layer.moe.host_syncs.count, "out": res["out"].numpy().copy()}


def engine_world() -> dict:
    """Two iterations of an engine (pp=1, dp=2, ep=2; 2 MoE layers, 2 microbatches): each one's
    ``host_syncs``, and the counts group the layout made."""
    import dataclasses

    from tessera.config.schema import ParallelConfig
    from tessera.cost.analytic import analytic_costs
    from tessera.engine import Batch, Engine, Layout, make_groups
    from tessera.model import StageModule
    from tessera.plan.baseline import baseline_plan
    from tessera.program.compiler import compile_plan
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model

    m = get_model("tiny-qwen3-next")
    model = dataclasses.replace(m, layers=m.layers[:2])
    par = ParallelConfig(pp=1, vpp=1, ep=2, dp=2, num_microbatches=2, micro_batch_size=1, seq_length=8)
    groups = make_groups(Layout(1, 2, 2))
    prog = compile_plan(baseline_plan(analytic_costs(model, get_hardware("cpu"), par), "1f1b", 1, 1, 2,
                                      overlap=True, split_w=True))[0]
    mods = [StageModule(model, (s.start, s.stop), ep_group=groups.ep, seed=SEED) for s in prog.stages]
    engine = Engine(prog, mods, groups)
    g = torch.Generator().manual_seed(SEED)
    syncs = []
    for _ in range(2):
        ids = [torch.randint(0, 256, (2, 1, 9), generator=g) for _ in range(2)][groups.replica]
        syncs.append(engine.run_iteration(Batch.from_tokens(ids)).host_syncs)
    own = groups.ep_counts is not None and groups.ep_counts is not groups.ep
    return {"host_syncs": syncs, "moe_layers": sum(layer.moe is not None for mod in mods for layer in mod.layers),
            "own_counts_group": own,
            "chunk_counts_group": all(c.counts_group is groups.ep_counts for c in engine.chunks)}


@pytest.fixture(scope="module")
def ep2_launch():
    return run_local(world, 2, TIMEOUT_S)


@pytest.fixture(scope="module")
def ep2_results(ep2_launch):
    return {r: {m: {k: torch.from_numpy(v) for k, v in d.items()} for m, d in res["modes"].items()}
            for r, res in enumerate(ep2_launch)}


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


def test_counts_travel_on_their_own_group_with_one_host_sync(ep2_launch, ep2_results):
    e_local = 4  # 8 experts over 2 ranks
    for rank, res in enumerate(ep2_launch):
        calls = res["counts"]["calls"]
        # forward: the counts (int64 [ep, E_l + 1]: counts and capacity) on the counts group, then the
        # rows (dispatch, combine) on the EP group; backward: the rows' gradients on the EP group
        assert calls[0] == ("counts", "torch.int64", (2, e_local + 1))
        assert [c[0] for c in calls[1:]] == ["ep"] * 4 and all(c[1] == "torch.float32" for c in calls[1:])
        assert res["counts"]["host_syncs"] == 1  # one MoE layer, one microbatch
        # the group the counts travel on changes nothing in the arithmetic
        assert torch.equal(torch.from_numpy(res["counts"]["out"]), ep2_results[rank]["dropless"]["out"])


def test_engine_counts_one_host_sync_per_moe_layer_and_microbatch(ep2_launch):
    for res in ep2_launch:
        eng = res["engine"]
        assert eng["own_counts_group"] and eng["chunk_counts_group"]
        assert eng["moe_layers"] == 2
        assert eng["host_syncs"] == [2 * 2, 2 * 2]  # MoE layers x microbatches, every iteration


def reference_permutation(recv_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The regroup permutation as a loop over (expert, source) blocks, and its inverse by scatter."""
    ep, e_local = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    blocks = [torch.arange(int(starts[s * e_local + e]), int(starts[s * e_local + e] + flat[s * e_local + e]))
              for e in range(e_local) for s in range(ep)]
    regroup = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)
    inverse = torch.empty_like(regroup)
    inverse[regroup] = torch.arange(regroup.numel())
    return regroup, inverse


def test_regroup_permutation_on_device_equals_the_loop():
    from tessera.model.ep import regroup_permutation

    g = torch.Generator().manual_seed(SEED)
    for trial in range(200):
        ep, e_local = (int(v) for v in torch.randint(1, 6, (2,), generator=g))
        counts = torch.randint(0, int(torch.randint(1, 30, (1,), generator=g)), (ep, e_local), generator=g)
        if trial % 5 == 0:
            counts[int(torch.randint(0, ep, (1,), generator=g))] = 0  # a source that sends nothing
        if trial % 17 == 0:
            counts.zero_()  # nothing received at all
        regroup, inverse = regroup_permutation(counts, int(counts.sum()))
        ref_regroup, ref_inverse = reference_permutation(counts)
        assert regroup.dtype == inverse.dtype == torch.int64
        assert torch.equal(regroup, ref_regroup) and torch.equal(inverse, ref_inverse), counts


def test_plan_without_ep_reads_the_host_once():
    from tessera.model.ep import plan_route
    from tessera.model.hostsync import HostSyncs

    syncs = HostSyncs()
    r = plan_route(torch.tensor([3, 0, 5, 1]), torch.tensor(5), None, syncs=syncs)
    assert (r.plan, r.counts, r.capacity, r.num_send, syncs.count) == (None, (3, 0, 5, 1), 5, 9, 1)
    assert isinstance(r.capacity, int) and all(isinstance(c, int) for c in r.counts)


def test_receive_buffers_skip_the_deterministic_fill_only():
    from tessera.model.determinism import empty_overwritten

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        buf = empty_overwritten((4, 3), dtype=torch.float32, device="cpu")
        assert buf.shape == (4, 3) and buf.dtype == torch.float32
        assert torch.utils.deterministic.fill_uninitialized_memory  # switched back on at once
        assert torch.empty(8).isnan().all()  # every other allocation is still filled
    finally:
        torch.use_deterministic_algorithms(was)
