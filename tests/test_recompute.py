"""Activation recompute in the executable model and the engine (``planner.activation_recompute``).

* One 2-rank gloo launch runs the engine on tiny-qwen3-next (8 layers: DeltaNet x6 + gated
  attention x2, all MoE with a shared expert; seq 16, 4 microbatches) for every mode in turn:
  pp=2 interleaved-1f1b vpp=2 with deferred W (the recipe defaults), pp=2 1f1b without split W
  (W computed in B), and pp=1 x dp=2 with ep=2 (dispatch / combine all-to-alls). After one
  iteration each rank's gradients are bitwise (``torch.equal``) those without recompute, and the
  peak of saved-tensor bytes over the iteration (:class:`~tessera.model.saved.SavedTensorMeter`)
  is lower with every recompute mode.
* In-process: the plain forward of a model with dense MLPs, non-gated attention and
  squared-ReLU experts (the regions the tiny preset lacks), and the recipe values.
"""

from __future__ import annotations

import pytest
import torch

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.engine import Batch, Engine, Layout, make_groups
from tessera.errors import TesseraConfigError
from tessera.model import LayerRecompute, Recompute, StageModule
from tessera.model.saved import SavedTensorMeter
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.model import AttentionSpec, DenseMLPSpec, LayerSpec, ModelSpec, MoESpec
from tessera.spec.presets import get_model
from tessera.testing import run_local

pytestmark = pytest.mark.xdist_group("recompute")  # module fixtures built once (tests/conftest.py)

SEED, M, SEQ = 5, 4, 16
MODES = {
    "none": Recompute(),
    "full": Recompute("full"),
    "selective": Recompute("selective", ("core_attn", "layernorm", "moe_act", "shared_experts")),
    "moe": Recompute("selective", ("moe",)),
}
SCENARIOS = {  # name: (layout, template, vpp, split_w, modes)
    "pp2": (Layout(2, 1, 1), "interleaved-1f1b", 2, True, tuple(MODES)),
    "pp2_fused_w": (Layout(2, 1, 1), "1f1b", 1, False, ("none", "full", "selective")),
    "ep2": (Layout(1, 2, 2), "1f1b", 1, True, ("none", "full", "moe")),
}


def batch() -> Batch:
    return Batch.from_tokens(torch.randint(0, 256, (M, 1, SEQ + 1), generator=torch.Generator().manual_seed(SEED)))


def program(layout: Layout, template: str, vpp: int, split_w: bool, rank: int):
    costs = analytic_costs(get_model("tiny-qwen3-next"), get_hardware("cpu"), ParallelConfig(
        pp=layout.pp, vpp=vpp, ep=layout.ep, dp=layout.dp, num_microbatches=M, micro_batch_size=1, seq_length=SEQ))
    plan = baseline_plan(costs, template, layout.pp, vpp, M, overlap=True, split_w=split_w)
    return compile_plan(plan)[rank]


def run_mode(layout, template, vpp, split_w, groups, mode: str) -> dict:
    prog = program(layout, template, vpp, split_w, groups.pipeline_rank)
    model = get_model("tiny-qwen3-next")
    mods = [StageModule(model, (s.start, s.stop), ep_group=groups.ep, seed=SEED, split_w=split_w,
                        recompute=MODES[mode]) for s in prog.stages]
    engine = Engine(prog, mods, groups, None)
    with SavedTensorMeter([p for m in mods for p in m.parameters()]) as meter:
        engine.run_iteration(batch() if layout.dp == 1 else _replica(groups.replica))
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters()}
    return {"grads": grads, "peak": meter.peak, "saves": meter.saves}


def _replica(replica: int) -> Batch:
    """dp replicas see different tokens (so the EP all-to-alls move rows both ways)."""
    g = torch.Generator().manual_seed(SEED + 100 * replica)
    return Batch.from_tokens(torch.randint(0, 256, (M, 1, SEQ + 1), generator=g))


def world(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    out, cache = {}, {}
    for name, (layout, template, vpp, split_w, modes) in SCENARIOS.items():
        if layout not in cache:
            cache[layout] = make_groups(layout)
        out[name] = {mode: run_mode(layout, template, vpp, split_w, cache[layout], mode) for mode in modes}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_local(world, 2, timeout_s=900)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_gradients_bitwise_with_recompute(ranks, scenario):
    for rank, res in enumerate(ranks):
        runs = res[scenario]
        base = runs["none"]["grads"]
        assert len(base) > 50
        for mode, run in runs.items():
            assert run["grads"].keys() == base.keys()
            diff = [n for n, g in base.items() if not torch.equal(g, run["grads"][n])]
            assert not diff, (scenario, rank, mode, diff[:5])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_saved_bytes_lower_with_recompute(ranks, scenario):
    for rank, res in enumerate(ranks):
        peaks = {mode: run["peak"] for mode, run in res[scenario].items()}
        print(scenario, rank, peaks)
        assert peaks["none"] > 100_000, peaks  # the meter sees the activations
        for mode, peak in peaks.items():
            if mode != "none":
                assert peak < peaks["none"], (scenario, rank, mode, peaks)
        # full keeps only the task inputs: an order of magnitude less here (DeltaNet internals dominate)
        assert peaks["full"] < 0.25 * peaks["none"], (scenario, rank, peaks)


# --- in-process --------------------------------------------------------------------------------
def mixed_model() -> ModelSpec:
    """Gated attention + dense SwiGLU; plain attention + squared-ReLU MoE; an MLP-only layer."""
    attn = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, gated=True, rotary_fraction=0.5)
    plain = AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=16)
    layers = (LayerSpec(0, attn, DenseMLPSpec(96)),
              LayerSpec(1, plain, MoESpec(num_experts=4, top_k=2, expert_ffn=48, gated=False)),
              LayerSpec(2, None, DenseMLPSpec(80, gated=False)))
    return ModelSpec("mixed", hidden=64, vocab=128, layers=layers)


def plain_run(model: ModelSpec, recompute: Recompute):
    mod = StageModule(model, (-1, model.num_layers + 1), seed=SEED, recompute=recompute)
    ids = torch.randint(0, model.vocab, (2, 33), generator=torch.Generator().manual_seed(SEED))
    with SavedTensorMeter(mod.parameters()) as meter:
        mod(ids[:, :-1], ids[:, 1:]).backward()
    return {n: p.grad for n, p in mod.named_parameters()}, meter.peak


@pytest.mark.parametrize("modules", [("core_attn",), ("layernorm",), ("mlp",), ("moe_act",), ("moe",),
                                     ("core_attn", "layernorm", "moe_act")])
def test_selective_regions_bitwise_and_smaller(modules):
    model = mixed_model()
    base, peak0 = plain_run(model, Recompute())
    got, peak = plain_run(model, Recompute("selective", modules))
    assert [n for n in base if not torch.equal(base[n], got[n])] == []
    assert peak < peak0, (modules, peak, peak0)


def test_full_recompute_on_mixed_layers():
    model = mixed_model()
    base, peak0 = plain_run(model, Recompute())
    got, peak = plain_run(model, Recompute("full"))
    assert [n for n in base if not torch.equal(base[n], got[n])] == []
    assert peak < 0.5 * peak0, (peak, peak0)


def test_recompute_values_and_plans():
    assert Recompute.of(True) == Recompute("full") and Recompute.of(False) == Recompute()
    assert Recompute.of("selective", ["moe_act"]).modules == ("moe_act",)
    assert Recompute.of("full", ["moe_act"]).modules == ()
    moe_layer, dense = get_model("tiny-qwen3-next").layers[3], mixed_model().layers[0]
    assert Recompute("full").plan(moe_layer) == LayerRecompute(mixer=True, router=True, shared=True, expert=True)
    assert Recompute("full").plan(dense) == LayerRecompute(mixer=True, mlp=True)
    sel = Recompute("selective", ("core_attn", "moe_act", "layernorm"))
    assert sel.plan(moe_layer) == LayerRecompute(core_attn=True, input_norm=True, post_norm=True, moe_act=True)
    assert sel.plan(get_model("tiny-qwen3-next").layers[0]).core_attn is False  # DeltaNet: no attention core
    assert Recompute("selective", ("moe", "moe_act")).plan(moe_layer).moe_act is False  # expert task whole
    assert Recompute("selective", ("mla_up_proj",)).plan(moe_layer) == LayerRecompute()
    with pytest.raises(TesseraConfigError, match="activation_recompute='some'"):
        Recompute("some")
    with pytest.raises(TesseraConfigError, match="recompute_modules.*unknown"):
        Recompute("selective", ("attention",))
    with pytest.raises(TesseraConfigError, match="at least one module"):
        Recompute("selective", ())


def test_meter_counts_storages_once_and_releases():
    x = torch.randn(100, 10, requires_grad=True)
    w = torch.randn(10, 10, requires_grad=True)
    with SavedTensorMeter([w]) as meter:
        y = (x @ w).sum() + (x.view(10, 100) * 2.0).sum()  # x saved by mm (the view shares its storage)
        assert meter.live == x.untyped_storage().nbytes() == 4000
        y.backward()
    assert meter.peak == 4000 and meter.live == 0 and meter.saves >= 1
