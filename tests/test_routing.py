"""Routing imbalance in the cost model (``model.moe_routing`` / ``moe_max_over_mean``,
:mod:`tessera.cost.routing`): what it scales, the memory it adds, the recipe rules, and how it
composes with ``planner.ep_slowdown``. In-process, on the tiny recipe (ep 2)."""

from __future__ import annotations

import pytest

from tessera.config.load import load_recipe
from tessera.cost.memory import BF16
from tessera.cost.routing import DROPLESS_MAX_OVER_MEAN, ROUTED_KINDS, expert_gate, load_factor, relative_loads
from tessera.cost.types import TaskKind
from tessera.dbo.counts import skew_ratio
from tessera.errors import TesseraConfigError
from tessera.flow import build_costs, resolve
from tessera.spec.model import MoESpec

pytestmark = pytest.mark.xdist_group("routing")  # the module fixture built once (tests/conftest.py)


def _costs(*overrides: str):
    return build_costs(resolve(load_recipe(None, list(overrides))))


@pytest.fixture(scope="module")
def balanced():
    return _costs()


def _pairs(a, b):
    for la, lb in zip(a.layers, b.layers, strict=True):
        yield from zip(la.tasks, lb.tasks, strict=True)


def test_factor_one_leaves_every_cost_identical(balanced):
    """dropless at max/mean 1.0 and forced at its default capacity factor 1.0 run the routing code
    path with a factor of 1: every task, memory and p2p number is the balanced one, exactly."""
    for over in (["model.moe_routing=dropless", "model.moe_max_over_mean=1.0"], ["model.moe_routing=forced"]):
        assert _costs(*over) == balanced


def test_dropless_scales_exactly_the_routed_tasks(balanced):
    f = DROPLESS_MAX_OVER_MEAN
    costs = _costs("model.moe_routing=dropless")
    seen = set()
    for ta, tb in _pairs(balanced, costs):
        routed = ta.kind in ROUTED_KINDS
        assert tb.ms == pytest.approx(ta.ms * (f if routed else 1.0), rel=1e-12), ta
        assert (tb.flops, tb.bytes, tb.deferred_ms) == (ta.flops, ta.bytes, ta.deferred_ms)
        seen.add(ta.kind) if routed and ta.ms > 0 else None
    assert seen == set(ROUTED_KINDS)
    assert (costs.embed, costs.head, costs.p2p_ms) == (balanced.embed, balanced.head, balanced.p2p_ms)
    x = _costs("model.moe_routing=dropless", "model.moe_max_over_mean=2.5")
    for ta, tb in _pairs(balanced, x):
        assert tb.ms == pytest.approx(ta.ms * (2.5 if ta.kind in ROUTED_KINDS else 1.0), rel=1e-12)


def test_dropless_memory_grows_by_the_receive_buffers(balanced):
    """The busiest EP rank's expert_in / fc1_out / act_out are f times the balanced size: stored
    activation and W's inputs grow by (f - 1) times their bytes; static memory is unchanged."""
    f = 1.5
    costs = _costs("model.moe_routing=dropless", f"model.moe_max_over_mean={f}")
    res = resolve(load_recipe(None, []))
    p = res.recipe.parallel
    tokens = p.micro_batch_size * p.seq_length / p.tp
    moe_layers = 0
    for spec, la, lb in zip(res.model.layers, balanced.layers, costs.layers, strict=True):
        if not isinstance(spec.mlp, MoESpec):
            assert lb.memory == la.memory
            continue
        moe_layers += 1
        m = spec.mlp
        width = m.latent_dim or res.model.hidden
        up = 2 * m.expert_ffn if m.gated else m.expert_ffn
        receive = BF16 * tokens * m.top_k * (width + up + m.expert_ffn)  # expert_in, fc1_out, act_out
        assert lb.memory.activation - la.memory.activation == pytest.approx((f - 1) * receive, rel=1e-12)
        assert lb.memory.static == la.memory.static
    assert moe_layers > 0


def test_one_ep_rank_has_no_imbalance():
    assert _costs("parallel.ep=1", "model.moe_routing=dropless") == _costs("parallel.ep=1")


@pytest.mark.parametrize("eps, expert", [("[1.1,1.4]", 1.4), ("[1.0,1.2]", DROPLESS_MAX_OVER_MEAN), ("[]", 1.3)])
def test_ep_slowdown_composes_as_the_larger_gate(balanced, eps, expert):
    """Both describe the slowest EP member: the expert tasks take max(ep_slowdown, max/mean), the
    all-to-alls (which ep_slowdown does not touch) max/mean."""
    costs = _costs("model.moe_routing=dropless", "model.moe_max_over_mean=1.3", f"planner.ep_slowdown={eps}")
    for ta, tb in _pairs(balanced, costs):
        want = expert if ta.kind == TaskKind.EXPERT else 1.3 if ta.kind in ROUTED_KINDS else 1.0
        assert tb.ms == pytest.approx(ta.ms * want, rel=1e-12), ta
    assert expert_gate(1.0, 0.9) == 0.9  # balanced routing: ep_slowdown alone, as before


def test_one_definition_of_max_over_mean():
    assert relative_loads([30, 10, 20, 20]) == ((1.5, 0.5, 1.0, 1.0), 1.5)
    assert skew_ratio([30, 10, 20, 20]) == 1.5 and skew_ratio([0, 0]) == 1.0
    assert load_factor("balanced") == 1.0 and load_factor("dropless") == DROPLESS_MAX_OVER_MEAN
    assert load_factor("forced") == 1.0 and load_factor("forced", 1.25) == 1.25


@pytest.mark.parametrize("overrides, needles", [
    (["model.moe_routing=uneven"], ["model.moe_routing='uneven'", "balanced", "dropless", "forced"]),
    (["model.moe_routing=dropless", "model.moe_max_over_mean=0.8"], ["model.moe_max_over_mean=0.8", ">= 1"]),
    (["model.moe_max_over_mean=1.3"], ["model.moe_max_over_mean=1.3", "moe_routing=balanced",
                                       "fix: set model.moe_routing=dropless"]),
])
def test_bad_routing_is_a_one_line_error(overrides, needles):
    with pytest.raises(TesseraConfigError) as e:
        resolve(load_recipe(None, overrides))
    msg = str(e.value)
    assert "\n" not in msg and "; fix: " in msg
    for n in needles:
        assert n in msg, (n, msg)
