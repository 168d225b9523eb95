"""Rules of the executable model (issue 9, items B and C).

B: the RoPE base and the position limit come from the ModelSpec (Qwen3-Next uses rope_theta 1e7),
not from constants in the layer code.
C: a top-1 MoE with fewer tokens per microbatch than DeepSpeed's ``min_capacity`` (8) routes
(dropless or not) instead of failing DeepSpeed's bare ``assert T >= min_capacity``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from tessera.errors import TesseraConfigError
from tessera.model import DecoderLayer
from tessera.model.moe import MoEBlock, MoEOptions
from tessera.spec.hf import model_from_hf_config
from tessera.spec.model import ModelSpec, MoESpec
from tessera.spec.presets import get_model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (:func:`conftest.one_thread`)."""


# --- B: rope_theta / max_positions from the spec --------------------------------------------


def test_presets_carry_their_config_rope_theta_and_positions():
    got = {n: (get_model(n).rope_theta, get_model(n).max_positions)
           for n in ("qwen3-next-80b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2-1t", "tiny-qwen3-next")}
    assert got == {"qwen3-next-80b-a3b": (1e7, 262144), "qwen3-235b-a22b": (1e6, 40960),
                   "deepseek-v3": (1e4, 163840), "kimi-k2-1t": (5e4, 131072), "tiny-qwen3-next": (1e4, 32768)}


def test_model_dict_round_trips_rope_and_old_dicts_get_defaults():
    m = dataclasses.replace(get_model("tiny-qwen3-next"), rope_theta=1e7, max_positions=1024)
    assert ModelSpec.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    old = m.to_dict()
    del old["rope_theta"], old["max_positions"]
    back = ModelSpec.from_dict(old)
    assert (back.rope_theta, back.max_positions) == (10000.0, 32768)


def test_hf_config_rope_theta_both_spellings():
    tr = pytest.importorskip("transformers")
    cfg = tr.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=1, vocab_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, rope_theta=5e5, max_position_embeddings=2048)
    d = json.loads(cfg.to_json_string())
    assert d["rope_parameters"]["rope_theta"] == 5e5  # transformers 5 spelling
    m = model_from_hf_config(d)
    assert (m.rope_theta, m.max_positions) == (5e5, 2048)
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 250000  # released (transformers 4) spelling, an int in many config.json files
    assert model_from_hf_config(legacy).rope_theta == 250000.0
    with pytest.raises(TesseraConfigError, match="hf_config.rope_theta"):
        model_from_hf_config(dict(legacy, rope_theta=-1.0))


@pytest.mark.parametrize("preset,layer", [("tiny-qwen3-next", 3), ("tiny-qwen3-moe", 0)])
def test_attention_uses_the_spec_rope_theta(preset, layer):
    outs = {}
    for theta in (1e4, 1e7):
        m = dataclasses.replace(get_model(preset), rope_theta=theta)
        lay = DecoderLayer(m, m.layers[layer], seed=3)
        att = m.layers[layer].mixer
        rot = int(att.head_dim * att.rotary_fraction)
        want = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
        torch.testing.assert_close(lay.rotary.inv_freq, want, rtol=1e-6, atol=0)
        x = torch.randn(1, 12, m.hidden, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            outs[theta] = lay.mixer(x)
    assert not torch.allclose(outs[1e4], outs[1e7])  # same weights, other base: other output


def test_attention_refuses_sequences_beyond_max_positions():
    m = dataclasses.replace(get_model("tiny-qwen3-next"), max_positions=8)
    lay = DecoderLayer(m, m.layers[3], seed=3)
    with torch.no_grad():
        assert lay.mixer(torch.zeros(1, 8, m.hidden)).shape == (1, 8, m.hidden)
        with pytest.raises(ValueError, match="layer 3: sequence of 9 tokens exceeds the model's max_positions=8"):
            lay.mixer(torch.zeros(1, 9, m.hidden))


# --- C: top-1 routing of few tokens ---------------------------------------------------------


@pytest.mark.parametrize("drop", [False, True])
def test_top1_moe_routes_four_tokens(drop):
    spec = MoESpec(num_experts=4, top_k=1, expert_ffn=16, shared_expert_ffn=16)
    block = MoEBlock(32, spec, MoEOptions(drop_tokens=drop), seed=5)  # default min_capacity 8 > 4 tokens
    assert block.options.min_capacity == 8
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(6), requires_grad=True)
    route = block.route(x, x.view(1, 4, 32))
    probs = F.softmax(F.linear(x.detach().float(), block.gate.wg.weight.detach().float()), dim=1)
    assert torch.equal(route.expert_index[0], probs.argmax(1))  # every token kept, at its top expert
    torch.testing.assert_close(route.gates[0].detach(), probs.max(1).values, rtol=1e-6, atol=0)
    assert int(route.counts.sum()) == 4 and route.capacity <= 4
    out = block.forward_tasks(route)
    assert torch.equal(out, block.forward_plain(route))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in block.experts[int(route.expert_index[0, 0])].parameters())


def test_hf_top1_layer_runs_a_four_token_microbatch():
    tr = pytest.importorskip("transformers")
    cfg = tr.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=1, vocab_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=1,
                            moe_intermediate_size=32)
    m = model_from_hf_config(json.loads(cfg.to_json_string()))
    assert m.layers[0].mlp.top_k == 1
    lay = DecoderLayer(m, m.layers[0], seed=7)
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(8), requires_grad=True)
    out = lay(x)
    assert torch.equal(out, lay.forward_reference(x))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_moe_options_that_cannot_work_raise_one_line_errors():
    with pytest.raises(TesseraConfigError, match=r"model.moe.top_k=5: must be in 1..num_experts=4"):
        MoEBlock(32, MoESpec(num_experts=4, top_k=5, expert_ffn=16))
    with pytest.raises(TesseraConfigError, match="min_capacity must be >= 0"):
        MoEBlock(32, MoESpec(num_experts=4, top_k=1, expert_ffn=16), MoEOptions(min_capacity=-1))
