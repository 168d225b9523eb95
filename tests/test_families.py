"""DeepSeek-V3 and Nemotron-H layers on the execution engine, bitwise (torch.equal) against the
single-process reference.

One 2-rank gloo launch (deterministic algorithms) trains two models for 2 AdamW steps
(4 microbatches of 16 tokens, mbs 1) under every scenario of :data:`RUNS`:

* ``deepseek``: tiny-deepseek-v3 (``LF LE LE LE``: MLA with a dense MLP, then MLA with an MoE
  of sigmoid routing, group limit 4/2, routed scaling 2.5, an ungated shared expert; four layers,
  one per virtual stage at pp=2 x vpp=2);
* ``nemotron``: tiny-nemotron-h cut to its layers 3-6 (``A- -E M- -F``: attention without RoPE,
  MoE alone, Mamba-2 alone, squared-ReLU MLP alone), renumbered 0-3;
* ``latent``: the same cut with latent-space experts (Nemotron 3 Super's MoE: tokens projected to
  ``latent_dim`` 32 before dispatch, the weighted sum projected back after combine), under
  :data:`LATENT_SCENARIOS` only.

Scenarios: pp=2 1f1b; interleaved-1f1b vpp=2 (FB overlap, split W) with the template's and with
the pair scheduler's pair orders; zb-v; split W off; pp=1 x dp=2 with ep=2; full and selective
recompute (``core_attn``, ``layernorm``, ``moe_act``; ``moe`` under ep=2; for MLA also
``mla_up_proj``, alone and with the others); the bubble optimizer moving W into slots (ep=2).
The parent computes the references in-process (they depend only on the data and the EP shape)
and compares every rank's final parameters under global names; every run also records the peak
of saved-tensor bytes of its first iteration (:class:`~tessera.model.saved.SavedTensorMeter`).

In-process: the task structure the cost model prices (:func:`tessera.spec.tasks.layer_shapes`)
against the engine's (:func:`tessera.model.tasks.forward_kinds` and its kin) for every layer of
the presets; the MLA, Mamba-2 and Nemotron-H attention mixers' recompute regions alone (FP32 and,
for ``mla_up_proj``, BF16 autocast); Mamba-2's deferred weight gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.dbo import counts_for_skew, moe_layers, rank_tables
from tessera.engine import Batch, Engine, Layout, make_groups
from tessera.engine.dbo import DBOPolicy
from tessera.model import Recompute, StageModule
from tessera.model import tasks as lt
from tessera.model.saved import SavedTensorMeter
from tessera.model.wgrad import SplitLinear
from tessera.plan.baseline import baseline_plan
from tessera.plan.pair_scheduler import schedule_pair
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Op, PairOrder
from tessera.program.slots import annotate_slots
from tessera.program.templates import co_executed_pairs
from tessera.sched.chunkdag import pair_dag
from tessera.sched.structure import named_order
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.model import ModelSpec
from tessera.spec.presets import get_model
from tessera.spec.tasks import Phase, layer_shapes
from tessera.testing import global_state_dict, reference_train, run_local

pytestmark = pytest.mark.xdist_group("families")  # module fixture built once (tests/conftest.py)

SEED, LR, WORLD, M, SEQ, STEPS, TIMEOUT_S = 7, 3e-3, 2, 4, 16, 2, 300
PP2, EP2 = Layout(2, 1, 1), Layout(1, 2, 2)
SELECTIVE = ("core_attn", "layernorm", "moe_act")
# the nominal cpu device without its measured host cost of deferring W (see tests/test_dbo_engine.py)
NOMINAL_CPU = dataclasses.replace(get_hardware("cpu"), deferred_w_us=0.0)


def cut(model: ModelSpec, layers: slice) -> ModelSpec:
    """``model`` with the decoder layers ``layers``, renumbered from 0."""
    kept = model.layers[layers]
    return dataclasses.replace(model, layers=tuple(dataclasses.replace(l, index=i) for i, l in enumerate(kept)))


@functools.lru_cache(maxsize=None)
def model_spec(family: str) -> ModelSpec:
    if family == "deepseek":
        return get_model("tiny-deepseek-v3")
    model = cut(get_model("tiny-nemotron-h"), slice(3, 7))
    if family == "latent":
        return dataclasses.replace(model, layers=tuple(
            dataclasses.replace(l, mlp=dataclasses.replace(l.mlp, latent_dim=32)) if l.is_moe else l
            for l in model.layers))
    return model


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One engine run: a Program family on a layout, the model's recompute mode, and whether the
    bubble optimizer (:class:`~tessera.engine.dbo.DBOPolicy`) fills the annotated slots."""

    name: str
    template: str = "1f1b"
    vpp: int = 1
    layout: Layout = PP2
    split_w: bool = True
    recompute: Recompute = Recompute()
    dbo: bool = False
    pair_orders: bool = False  # FB pairs in the pair scheduler's order (else the template's)


SCENARIOS = (
    Scenario("1f1b"),
    Scenario("interleaved", template="interleaved-1f1b", vpp=2),
    Scenario("zb_v", template="zb-v", vpp=2),
    Scenario("pair_orders", template="interleaved-1f1b", vpp=2, pair_orders=True),
    Scenario("no_split", split_w=False),
    Scenario("ep2", layout=EP2),
    Scenario("full", template="interleaved-1f1b", vpp=2, recompute=Recompute("full")),
    Scenario("selective", template="interleaved-1f1b", vpp=2, recompute=Recompute("selective", SELECTIVE)),
    Scenario("ep2_moe", layout=EP2, recompute=Recompute("selective", ("moe",))),
    Scenario("dbo", layout=EP2, dbo=True),
)
MLA_SCENARIOS = (  # MLA only: the up-projection region alone, and with all the selective regions
    Scenario("up_proj", template="interleaved-1f1b", vpp=2, recompute=Recompute("selective", ("mla_up_proj",))),
    Scenario("selective_up_proj", template="interleaved-1f1b", vpp=2,
             recompute=Recompute("selective", (*SELECTIVE, "mla_up_proj"))),
)
LATENT_SCENARIOS = ("1f1b", "interleaved", "ep2")
FAMILIES = ("deepseek", "nemotron")
RUNS = tuple((f, sc) for f in FAMILIES for sc in SCENARIOS + (MLA_SCENARIOS if f == "deepseek" else ())) + tuple(
    ("latent", sc) for sc in SCENARIOS if sc.name in LATENT_SCENARIOS)
BASE = {"full": "interleaved", "selective": "interleaved", "ep2_moe": "ep2",  # recompute run -> its run without
        "up_proj": "interleaved", "selective_up_proj": "selective"}


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False)


def batches(dp: int) -> list[list[Batch]]:
    """``[step][replica]`` next-token batches of random bytes."""
    g = torch.Generator().manual_seed(SEED)
    return [[Batch.from_tokens(torch.randint(0, 256, (M, 1, SEQ + 1), generator=g)) for _ in range(dp)]
            for _ in range(STEPS)]


def costs_for(family: str, sc: Scenario, hardware=None):
    lay = sc.layout
    return analytic_costs(model_spec(family), hardware or get_hardware("cpu"), ParallelConfig(
        pp=lay.pp, vpp=sc.vpp, ep=lay.ep, dp=lay.dp, num_microbatches=M, micro_batch_size=1, seq_length=SEQ))


def programs(family: str, sc: Scenario):
    costs = costs_for(family, sc, NOMINAL_CPU if sc.dbo else None)
    plan = baseline_plan(costs, sc.template, sc.layout.pp, sc.vpp, M, overlap=True, split_w=sc.split_w)
    if sc.pair_orders:
        plan = dataclasses.replace(plan, name="tessera", pair_orders=scheduled_orders(plan, costs))
    progs = compile_plan(plan)
    if not sc.dbo:
        return progs, None
    progs = annotate_slots(progs, moe_layers(costs), defer_w=True)
    ep = sc.layout.ep
    counts = counts_for_skew(1.3, ep, M, moe_layers(costs), 8, ep * SEQ * 2, seed=1)
    return progs, rank_tables(progs, costs, counts, ep, 0.1)


def scheduled_orders(plan, costs) -> tuple[PairOrder, ...]:
    """The pair scheduler's task order for every co-executed (F, B) pair of ``plan``, named by the
    spec's task structure (the names the engine maps onto its own tasks)."""
    out = []
    for _, fs, bs in co_executed_pairs(plan.template, plan.pp, plan.vpp, plan.num_microbatches):
        dag = pair_dag(costs, plan.partition.stage_range(fs), plan.partition.stage_range(bs), not plan.split_w)
        out.append(PairOrder(fs, bs, not plan.split_w, named_order(dag, schedule_pair(dag).order_dict())))
    assert out
    return tuple(out)


def run_scenario(family: str, sc: Scenario, groups) -> dict:
    progs, tables = programs(family, sc)
    prog = progs[groups.pipeline_rank]
    mods = [StageModule(model_spec(family), (s.start, s.stop), ep_group=groups.ep, seed=SEED, split_w=sc.split_w,
                        recompute=sc.recompute) for s in prog.stages]
    policy = DBOPolicy(tables[groups.pipeline_rank], groups.ep_rank) if sc.dbo else None
    engine = Engine(prog, mods, groups, make_optimizer([p for m in mods for p in m.parameters()]),
                    slot_policy=policy)
    peak = None
    for step, data in enumerate(batches(sc.layout.dp)):
        if step == 0:
            with SavedTensorMeter([p for m in mods for p in m.parameters()]) as meter:
                engine.run_iteration(data[groups.replica])
            peak = meter.peak
        else:
            engine.run_iteration(data[groups.replica])
    out = {"state": {k: v for m in mods for k, v in global_state_dict(m).items()}, "peak": peak,
           "fb_orders": [i.order for i in prog.instructions if i.op == Op.FB]}
    if policy is not None:
        out["moved"] = policy.stats().moved
    return out


def world(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    groups = {lay: make_groups(lay) for lay in (PP2, EP2)}
    return {(family, sc.name): run_scenario(family, sc, groups[sc.layout]) for family, sc in RUNS}


@pytest.fixture(scope="module")
def ranks():
    return run_local(world, WORLD, TIMEOUT_S)


@pytest.fixture(autouse=True)
def _deterministic():
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.set_num_threads(old_threads)
    torch.use_deterministic_algorithms(old_det)


@functools.lru_cache(maxsize=None)
def reference(family: str, dp: int, ep: int):
    return reference_train(model_spec(family), batches(dp), ep=ep, seed=SEED, make_optimizer=make_optimizer)


def merged_state(ranks: list, key) -> dict:
    """Union of the ranks' parameters; replicas must agree exactly."""
    out: dict = {}
    for res in ranks:
        for k, v in res[key]["state"].items():
            if k in out:
                assert torch.equal(out[k], v), f"replicas disagree on {k}"
            out[k] = v
    return out


def assert_state_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    bad = {k: float((got[k] - want[k]).abs().max()) for k in want if not torch.equal(got[k], want[k])}
    assert not bad, f"{len(bad)} of {len(want)} parameters differ, e.g. {list(bad.items())[:4]}"


@pytest.mark.parametrize("family, sc", RUNS, ids=[f"{f}-{sc.name}" for f, sc in RUNS])
def test_bitwise_equal_to_reference(ranks, family, sc):
    name = sc.name
    got = merged_state(ranks, (family, name))
    assert_state_equal(got, reference(family, sc.layout.dp, sc.layout.ep).state)
    initial = global_state_dict(StageModule(model_spec(family), (-1, model_spec(family).num_layers + 1), seed=SEED))
    params = [k for k in initial if not k.endswith("e_score_correction_bias")]  # buffers: moved by their own rule
    assert [k for k in params if torch.equal(got[k], initial[k])] == []  # every parameter trained


@pytest.mark.parametrize("family", FAMILIES)
def test_pair_orders_ran(ranks, family):
    """The FB instructions of "pair_orders" point at the scheduler's orders (>= 0) on every rank;
    the template's own FB pairs (-1) in "interleaved"."""
    for res in ranks:
        assert res[(family, "pair_orders")]["fb_orders"] and min(res[(family, "pair_orders")]["fb_orders"]) >= 0
        assert set(res[(family, "interleaved")]["fb_orders"]) == {-1}


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_lowers_saved_bytes_in_the_engine(ranks, family):
    """Each recompute run keeps fewer saved-tensor bytes at the peak of its first iteration than
    the same Program without recompute, on every rank and stage: MLA (core_attn, mla_up_proj)
    and Mamba-2 layers included; full recompute, which keeps only the task inputs, the fewest."""
    for rank, res in enumerate(ranks):
        peaks = {name: run["peak"] for (f, name), run in res.items() if f == family}
        assert peaks["interleaved"] > 50_000, peaks  # the meter sees the activations
        for name, base in BASE.items():
            if name in peaks:
                assert peaks[name] < peaks[base], (family, rank, name, peaks)
        assert peaks["full"] < peaks["selective"], (family, rank, peaks)  # full keeps only the task inputs


@pytest.mark.parametrize("family", FAMILIES)
def test_bubble_optimizer_moved_w(ranks, family):
    """The "dbo" run (bitwise the reference above) did move W into predicted slots."""
    assert sum(res[(family, "dbo")]["moved"] for res in ranks) > 0


# --- in-process --------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-nemotron-h", "tiny-qwen3-next"])
def test_engine_tasks_are_the_priced_tasks(preset):
    """Per layer, the engine's F / B / W task kinds (:mod:`tessera.model.tasks`) are the tasks the
    cost model prices (:func:`tessera.spec.tasks.layer_shapes`): the same kinds per phase, the
    engine's order a topological order of the spec's dependencies, W exactly for the kinds with
    weights. Every layer code of the presets: ``LF``, ``LE`` (MLA), ``M-``, ``-E``, ``A-``, ``-F``."""
    model = get_model(preset)
    module = StageModule(model, (0, model.num_layers), seed=SEED)
    codes = set()
    for spec, layer in zip(model.layers, module.layers, strict=True):
        codes.add(spec.code)
        shapes = layer_shapes(spec)
        engine = {Phase.F: lt.forward_kinds(layer), Phase.B: lt.backward_kinds(layer), Phase.W: lt.weight_kinds(layer)}
        for phase, kinds in engine.items():
            priced = [i for i, s in enumerate(shapes) if s.phase == phase]
            by_kind = {shapes[i].kind.value: i for i in priced}
            assert sorted(kinds) == sorted(by_kind) and len(kinds) == len(priced), (preset, spec.index, phase, kinds)
            pos = {by_kind[k]: n for n, k in enumerate(kinds)}
            for i in priced:  # every dependency inside the phase runs first in the engine's order
                assert all(pos[d] < pos[i] for d in shapes[i].deps if d in pos), (preset, spec.index, phase, kinds)
            if phase == Phase.W:
                assert list(kinds) == [shapes[i].kind.value for i in priced]  # the WEIGHTED order
                for kind in kinds:  # a W task only where the kind has deferrable weights
                    mods = _kind_module(layer, kind).modules()
                    assert any(isinstance(m, SplitLinear) for m in mods), (preset, spec.index, kind)
    want = {"tiny-deepseek-v3": {"LF", "LE"}, "tiny-nemotron-h": {"M-", "-E", "A-", "-F"},
            "tiny-qwen3-next": {"DE", "AE"}}[preset]
    assert codes == want


def _kind_module(layer, kind: str) -> torch.nn.Module:
    return {"mixer": layer.attn, "mlp": layer.mlp_module, "router": layer.moe and layer.moe.gate,
            "expert": layer.moe and layer.moe.experts, "shared": layer.moe and layer.moe.shared_expert}[kind]


def _mla_without_q_lora() -> ModelSpec:
    """MLA + dense MLP without query compression (``q_lora_rank=0``: HF ``q_proj``)."""
    model = cut(get_model("tiny-deepseek-v3"), slice(0, 1))
    layer = model.layers[0]
    return dataclasses.replace(model, layers=(dataclasses.replace(
        layer, mixer=dataclasses.replace(layer.mixer, q_lora_rank=0)),))


MIXER_MODELS = {  # one-layer cuts of the presets: MLA + dense MLP, Mamba-2 alone, attention without RoPE alone
    "mla": lambda: cut(get_model("tiny-deepseek-v3"), slice(0, 1)),
    "mla_q_proj": _mla_without_q_lora,
    "mamba2": lambda: cut(get_model("tiny-nemotron-h"), slice(0, 1)),
    "attention": lambda: cut(get_model("tiny-nemotron-h"), slice(3, 4)),
}


def plain_run(model: ModelSpec, recompute: Recompute, dtype: torch.dtype = torch.float32):
    """Forward and backward of the whole model on 2 sequences of 32 tokens, computing in
    ``dtype``; gradients by name and the peak of saved-tensor bytes."""
    mod = StageModule(model, (-1, model.num_layers + 1), seed=SEED, recompute=recompute, compute_dtype=dtype)
    ids = torch.randint(0, model.vocab, (2, 33), generator=torch.Generator().manual_seed(SEED))
    with SavedTensorMeter(mod.parameters()) as meter:
        mod(ids[:, :-1], ids[:, 1:]).backward()
    return {n: p.grad for n, p in mod.named_parameters()}, meter.peak


@pytest.mark.parametrize("mixer, modules", [
    ("mla", ("core_attn",)), ("mla", ("mla_up_proj",)), ("mla", ("core_attn", "mla_up_proj")),
    ("mla", ("layernorm", "mla_up_proj")), ("mla", "full"), ("mla_q_proj", ("mla_up_proj",)),
    ("mla_q_proj", ("core_attn", "mla_up_proj")), ("mamba2", ("layernorm",)), ("mamba2", "full"),
    ("attention", ("core_attn",)), ("attention", "full")])
def test_mixer_recompute_bitwise_and_smaller(mixer, modules):
    """Recompute regions in MLA (DeepseekV3Attention), Mamba-2 (NemotronHMamba2Mixer) and
    Nemotron-H attention layers: gradients bitwise those without, fewer saved bytes at the peak."""
    model = MIXER_MODELS[mixer]()
    base, peak0 = plain_run(model, Recompute())
    mode = Recompute("full") if modules == "full" else Recompute("selective", modules)
    got, peak = plain_run(model, mode)
    assert [n for n in base if not torch.equal(base[n], got[n])] == []
    assert peak < peak0, (mixer, modules, peak, peak0)


@pytest.mark.parametrize("modules", [("mla_up_proj",), ("core_attn", "mla_up_proj"), ("layernorm", "mla_up_proj")])
def test_mla_up_proj_bitwise_under_bf16(modules):
    """Under BF16 autocast the rebuilt Q, K, V are the forward's (the rebuild re-enters its
    autocast state: BF16 up-projections), so gradients stay bitwise."""
    model = MIXER_MODELS["mla"]()
    base, _ = plain_run(model, Recompute(), torch.bfloat16)
    got, _ = plain_run(model, Recompute("selective", modules), torch.bfloat16)
    assert [n for n in base if not torch.equal(base[n], got[n])] == []


def test_mla_up_proj_drops_q_k_v():
    """``mla_up_proj`` keeps none of the up-projections' outputs: the peak falls by at least the
    bytes of Q and K (``[B, heads, S, qk_nope + qk_rope]`` each, FP32); with ``core_attn`` too it
    is lower than either alone; the MLA layer's ``mla_up_proj`` region is on, other layers' off."""
    model = MIXER_MODELS["mla"]()
    mla = model.layers[0].mixer
    qk_bytes = 2 * (2 * mla.num_heads * 32 * (mla.qk_nope_head_dim + mla.qk_rope_head_dim) * 4)
    peaks = {mods: plain_run(model, Recompute("selective", mods) if mods else Recompute())[1]
             for mods in ((), ("mla_up_proj",), ("core_attn",), ("core_attn", "mla_up_proj"))}
    assert peaks[()] - peaks[("mla_up_proj",)] >= qk_bytes, (peaks, qk_bytes)
    assert peaks[("core_attn", "mla_up_proj")] < min(peaks[("mla_up_proj",)], peaks[("core_attn",)]), peaks
    sel = Recompute("selective", ("mla_up_proj",))
    assert sel.plan(model.layers[0]).mla_up_proj
    assert not sel.plan(get_model("tiny-nemotron-h").layers[3]).mla_up_proj  # attention, not MLA


def test_mamba2_weight_gradients_deferred():
    """Mamba-2 on CPU runs transformers' torch path: ``in_proj`` / ``out_proj`` are SplitLinears
    whose weight gradients wait for W; ``conv1d``, ``A_log``, ``D``, ``dt_bias`` and the gated
    norm get theirs in B. W then equals the fused backward bitwise."""
    from tessera.model.wgrad import DeferredWGrad, run_w

    model = MIXER_MODELS["mamba2"]()
    ids = torch.randint(0, model.vocab, (2, 33), generator=torch.Generator().manual_seed(SEED))
    fused = StageModule(model, (-1, 2), seed=SEED)
    fused(ids[:, :-1], ids[:, 1:]).backward()
    split = StageModule(model, (-1, 2), seed=SEED)
    store = DeferredWGrad()
    with store.capture("mb0", split):
        split(ids[:, :-1], ids[:, 1:]).backward()
    mixer = dict(split.layers[0].attn.named_parameters())
    assert {n for n, p in mixer.items() if p.grad is None} == {"in_proj.weight", "out_proj.weight"}
    assert store.num_pending("mb0", tag="mixer") == 2
    run_w(store, "mb0")
    want = dict(fused.named_parameters())
    assert [n for n, p in split.named_parameters() if not torch.equal(p.grad, want[n].grad)] == []

