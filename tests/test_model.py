"""Executable MoE layers: deferred weight gradients, task split, routing, stages, training."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from tessera.model import DecoderLayer, DeferredWGrad, MoEOptions, SplitLinear, StageModule, run_w
from tessera.model.moe import MoEBlock, gate_routes
from tessera.spec.model import LayerSpec, ModelSpec, MoESpec

try:
    from tessera.spec.presets import get_model
except ImportError:  # presets are written by another helper
    get_model = None


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (:func:`conftest.one_thread`)."""


def tiny_model() -> ModelSpec:
    if get_model is not None:
        return get_model("tiny-qwen3-next")
    from tessera.spec.model import AttentionSpec, DeltaNetSpec

    att = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, gated=True, rotary_fraction=0.25)
    dn = DeltaNetSpec(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16)
    moe = MoESpec(num_experts=8, top_k=2, expert_ffn=64, shared_expert_ffn=64)
    layers = tuple(LayerSpec(i, att if (i + 1) % 4 == 0 else dn, moe) for i in range(8))
    return ModelSpec("tiny-qwen3-next", 64, 256, layers)


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()}


def assert_grads_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert (a[n] is None) == (b[n] is None), n
        if a[n] is not None:
            assert torch.equal(a[n], b[n]), n


def fused_and_deferred(module: nn.Module, fn, inputs: list[torch.Tensor]):
    """Run ``fn`` on each microbatch with a fused backward, then with B (all microbatches) and
    then W (in microbatch order); return both sets of parameter and input grads."""
    xs = [x.clone().requires_grad_(True) for x in inputs]
    for x in xs:
        fn(x).backward()
    fused, fused_dx = grads(module), [x.grad for x in xs]
    module.zero_grad(set_to_none=True)
    store = DeferredWGrad()
    xs = [x.clone().requires_grad_(True) for x in inputs]
    for mb, x in enumerate(xs):
        with store.capture(mb, module):
            fn(x).backward()
    after_b = grads(module)
    for mb in range(len(xs)):
        assert run_w(store, mb) > 0
    assert len(store) == 0
    return fused, fused_dx, after_b, grads(module), [x.grad for x in xs]


def test_split_linear_matches_nn_linear():
    for bias, shape in [(False, (5, 7, 12)), (True, (9, 12))]:
        torch.manual_seed(0)
        lin = nn.Linear(12, 6, bias=bias)
        split = SplitLinear.from_linear(lin, "mixer")
        assert split.weight is lin.weight and split.bias is lin.bias
        x = torch.randn(*shape)
        gy = torch.randn(*shape[:-1], 6)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        lin(xa).backward(gy)
        ref = grads(lin)
        lin.zero_grad(set_to_none=True)
        out = split(xb)
        assert torch.equal(out, lin(x))
        out.backward(gy)
        assert_grads_equal(ref, grads(split))
        assert torch.equal(xa.grad, xb.grad)


def test_split_layer_matches_plain_linear_layer():
    model = tiny_model()
    plain = DecoderLayer(model, model.layers[0], seed=12, split_w=False)
    split = DecoderLayer(model, model.layers[0], seed=12)
    assert not any(isinstance(m, SplitLinear) for m in plain.modules())
    x = torch.randn(2, 16, 64)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_a, out_b = plain(xa), split(xb)
    assert torch.equal(out_a, out_b)
    out_a.square().sum().backward()
    out_b.square().sum().backward()
    assert_grads_equal(grads(plain), grads(split))
    assert torch.equal(xa.grad, xb.grad)


@pytest.mark.parametrize("uses", [2, 3])
def test_weight_used_several_times(uses):
    torch.manual_seed(1)
    lin = SplitLinear(16, 16, bias=True, tag="mixer")
    module = nn.ModuleDict({"lin": lin})

    def fn(x):
        for _ in range(uses):  # x @ w @ w (@ w): the same weight and bias in one graph
            x = lin(x)
        return x.square().sum()

    inputs = [torch.randn(4, 16) for _ in range(2)]
    fused, fdx, after_b, deferred, ddx = fused_and_deferred(module, fn, inputs)
    assert after_b["lin.weight"] is None and after_b["lin.bias"] is None
    assert_grads_equal(fused, deferred)
    assert all(torch.equal(a, b) for a, b in zip(fdx, ddx))


def test_multi_output_consumers():
    torch.manual_seed(2)
    a, b = SplitLinear(8, 12, bias=False, tag="mixer"), SplitLinear(6, 5, bias=True, tag="mixer")
    module = nn.ModuleDict({"a": a, "b": b})

    def fn(x):
        p, q = a(x).chunk(2, dim=-1)  # one output, two consumers
        top, _ = torch.topk(b(p) * torch.sigmoid(b(q)), 2, dim=-1)  # b used twice, multi-output topk
        r, s, _unused = torch.split(a(x), [4, 4, 4], dim=-1)  # a used again; one piece unused
        return top.sum() + (r * s).mean()

    fused, fdx, after_b, deferred, ddx = fused_and_deferred(module, fn, [torch.randn(3, 8) for _ in range(2)])
    assert all(v is None for v in after_b.values())
    assert_grads_equal(fused, deferred)
    assert all(torch.equal(x, y) for x, y in zip(fdx, ddx))


@pytest.mark.parametrize("index", [0, 3])  # 0: DeltaNet + MoE, 3: gated attention + MoE
def test_layer_deferred_w_bitwise(index):
    model = tiny_model()
    layer = DecoderLayer(model, model.layers[index], seed=3)
    assert layer.spec.code in ("DE", "AE")
    torch.manual_seed(4)
    inputs = [torch.randn(2, 16, 64) for _ in range(2)]
    target = torch.randn(2, 16, 64)
    fused, fdx, after_b, deferred, ddx = fused_and_deferred(layer, lambda x: (layer(x) * target).sum(), inputs)
    split = {n for n, m in layer.named_modules() if isinstance(m, SplitLinear)}
    for name, g in after_b.items():
        owner = name.rsplit(".", 1)[0]
        assert (g is None) == (owner in split), name  # W deferred, everything else got its grad in B
    assert any(n.endswith("A_log") or n.endswith("q_norm.weight") for n in after_b)
    assert_grads_equal(fused, deferred)
    assert all(torch.equal(a, b) for a, b in zip(fdx, ddx))
    tags = {m.tag for m in layer.modules() if isinstance(m, SplitLinear)}
    assert tags == {"mixer", "router", "expert", "shared"}


def test_in_place_change_before_w_raises():
    lin = SplitLinear(4, 3, bias=False, tag="mixer")
    x = torch.randn(5, 4)
    store = DeferredWGrad()
    with store.capture(0, lin):
        lin(x).sum().backward()
    x.add_(1.0)  # e.g. a reused input buffer overwritten before W ran
    with pytest.raises(RuntimeError, match="modified in place"):
        run_w(store, 0)


def test_run_w_by_tag():
    model = tiny_model()
    layer = DecoderLayer(model, model.layers[0], seed=5)
    x = torch.randn(1, 8, 64)
    store = DeferredWGrad()
    with store.capture("mb0", layer):
        layer(x).sum().backward()
    n_expert = store.num_pending("mb0", "expert")
    assert n_expert == 3 * 8  # gate/up/down of each of 8 experts
    assert run_w(store, "mb0", "expert") == n_expert
    assert layer.moe.experts[0].up_proj.weight.grad is not None
    assert layer.attn.out_proj.weight.grad is None
    run_w(store, "mb0")
    assert layer.attn.out_proj.weight.grad is not None and len(store) == 0


@pytest.mark.parametrize("index", [0, 3])
def test_task_forward_equals_plain_forward(index):
    model = tiny_model()
    layer = DecoderLayer(model, model.layers[index], seed=6)
    x = torch.randn(2, 16, 64)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = layer(xa)
    ref = layer.forward_reference(xb)
    assert torch.equal(out, ref)
    out.sum().backward()
    g_tasks = grads(layer)
    layer.zero_grad(set_to_none=True)
    ref.sum().backward()
    g_plain = grads(layer)
    for n in g_tasks:  # MoE weights see the same products; token grads are summed in another order
        if n.startswith("moe."):
            assert torch.equal(g_tasks[n], g_plain[n]), n
        else:
            torch.testing.assert_close(g_tasks[n], g_plain[n], rtol=1e-4, atol=1e-5, msg=n)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k,drop", [(1, True), (1, False), (2, True), (2, False), (3, True), (3, False)])
def test_router_matches_deepspeed_topkgate(k, drop):
    spec = MoESpec(num_experts=8, top_k=k, expert_ffn=16)
    block = MoEBlock(32, spec, MoEOptions(drop_tokens=drop, min_capacity=2), seed=7)
    x = torch.randn(24, 32)
    ours = gate_routes(block.gate, x)
    ref = block.gate(x, None, True)  # DeepSpeed TopKGate.forward, sparse routes
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_capacity_drop_keeps_exactly_capacity():
    spec = MoESpec(num_experts=8, top_k=2, expert_ffn=16)
    block = MoEBlock(32, spec, MoEOptions(drop_tokens=True, capacity_factor=1.0, min_capacity=1), seed=8)
    with torch.no_grad():
        block.gate.wg.weight.zero_()
        block.gate.wg.weight[0, 0] = 5.0  # most tokens prefer expert 0 (skewed)
        block.gate.wg.weight[1, 0] = 4.0
    x = torch.randn(64, 32)
    x[:, 0] = x[:, 0].abs() + 1.0
    route = block.route(x, x.view(1, 64, 32))
    assert route.capacity == 16  # ceil(64 / 8 * 1.0 * 2)
    assert torch.equal(route.counts, torch.minimum(route.requested, torch.as_tensor(route.capacity)))
    assert int(route.counts[0]) == route.capacity < int(route.requested[0])
    dropped = (route.expert_index < 0)
    assert dropped.any() and torch.equal(route.gates[dropped], torch.zeros(int(dropped.sum())))
    d = block.dispatch(route)
    assert d.counts == tuple(route.counts.tolist()) and d.x.shape == (int(route.counts.sum()), 32)
    out = block.combine(block.run_experts(d), d, route, block.shared(route))
    assert out.shape == (1, 64, 32)


def test_stages_build_the_same_model():
    model = tiny_model()
    full = StageModule(model, (-1, model.num_layers + 1), seed=9)
    first, last = StageModule(model, (-1, 4), seed=9), StageModule(model, range(4, model.num_layers + 1), seed=9)
    assert first.has_embed and not first.has_head and last.has_head and not last.has_embed
    assert [l.index for l in last.layers] == [4, 5, 6, 7] and last.layer(5).index == 5
    ids = torch.randint(0, model.vocab, (2, 17))
    assert torch.equal(full(ids[:, :-1], ids[:, 1:]), last(first(ids[:, :-1]), ids[:, 1:]))


def test_tiny_model_trains_with_deferred_w():
    model = tiny_model()
    stages = [StageModule(model, (-1, 4), seed=10), StageModule(model, (4, model.num_layers + 1), seed=10)]
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    gen = torch.Generator().manual_seed(11)
    data = torch.randint(0, 256, (2, 4, 33), generator=gen)  # 2 microbatches of random bytes
    store, losses = DeferredWGrad(), []
    for step in range(20):
        total = 0.0
        for mb in range(data.shape[0]):
            ids = data[mb]
            h = stages[0](ids[:, :-1])
            h_in = h.detach().requires_grad_(True)
            loss = stages[1](h_in, ids[:, 1:]) / data.shape[0]
            with store.capture((1, mb), stages[1]):
                loss.backward()  # B of the last stage
            with store.capture((0, mb), stages[0]):
                h.backward(h_in.grad)  # B of the first stage
            total += float(loss.detach())
        for mb in range(data.shape[0]):  # W, in microbatch order
            run_w(store, (1, mb))
            run_w(store, (0, mb))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    assert len(store) == 0
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0, losses
