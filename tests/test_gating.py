"""tessera.model.gating against DeepSpeed's gating: the routing Tessera runs where DeepSpeed is not
installed gives DeepSpeed's numbers (indices, gates, counts, capacity, aux loss and the gradients
of the logits through gates and aux loss) for top-1, top-2 and top-k dropless routing; the
options it does not implement are refused with the field named; a MoE block built on it has
DeepSpeed's weights (same RNG draws, same state-dict names)."""

from __future__ import annotations

import pytest
import torch

from tessera.errors import TesseraConfigError
from tessera.model import gating, moe
from tessera.model.moe import MoEBlock, MoEOptions, gate_routes
from tessera.spec.model import MoESpec

sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")


def deepspeed_routes(logits, k):
    if k == 1:
        return sharded_moe.top1gating(logits, 1.0, 0, None, None, False, False, None, True, False)
    if k == 2:
        return sharded_moe.top2gating(logits, 1.0, 8, False, None, False, True)
    return sharded_moe.topkgating(logits, k, 1.0, 8, False, None, sparse_routes=True)


@pytest.mark.parametrize("k", [1, 2, 3, 10])
@pytest.mark.parametrize("tokens,experts", [(48, 16), (7, 64)])
def test_dropless_routes_are_deepspeeds_bitwise_with_gradients(k, tokens, experts):
    torch.manual_seed(k * 100 + tokens)
    base = torch.randn(tokens, experts) * 3
    base[0, :] = 1.25  # a token whose experts tie
    upstream = torch.randn(k, tokens)
    results = []
    for route in (lambda z: gating.dropless_routes(z, k), lambda z: deepspeed_routes(z, k)):
        z = base.clone().requires_grad_(True)
        aux, capacity, e, idx, _loc, gates, counts = route(z)
        ((gates * upstream).sum() + 0.37 * aux).backward()
        results.append((aux.detach(), torch.as_tensor(capacity), e, idx, gates.detach(), counts, z.grad))
    ours, theirs = results
    names = ("aux", "capacity", "E", "indices", "gates", "counts", "dlogits")
    for name, a, b in zip(names, ours, theirs):
        if name == "E":
            assert a == b == experts
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), name
    assert ours[3].shape == (k, tokens) and int(ours[5].sum()) == k * tokens  # dropless: every route kept
    assert int(ours[1]) == int(ours[5].max())
    assert ours[6].abs().sum() > 0


def test_a_moe_block_on_the_fallback_routes_and_learns_as_on_deepspeed(monkeypatch):
    spec = MoESpec(num_experts=8, top_k=2, expert_ffn=16, shared_expert_ffn=16)
    x = torch.randn(24, 32)
    ref = MoEBlock(32, spec, MoEOptions(min_capacity=2), seed=7)
    monkeypatch.setattr(moe, "TopKGate", gating.Router)  # as when deepspeed does not import
    fallback = MoEBlock(32, spec, MoEOptions(min_capacity=2), seed=7)
    assert isinstance(fallback.gate, gating.Router) and not isinstance(ref.gate, gating.Router)
    ref_state, fb_state = ref.state_dict(), fallback.state_dict()
    assert list(ref_state) == list(fb_state) and "gate.wg.weight" in fb_state
    assert all(torch.equal(ref_state[n], fb_state[n]) for n in ref_state)
    outs = []
    for block in (ref, fallback):
        xb = x.clone().requires_grad_(True)
        route = block.route(xb, xb.view(1, 24, 32))
        d = block.dispatch(route)
        y = block.combine(block.run_experts(d), d, route, block.shared(route))
        y.square().mean().backward()
        outs.append((y.detach(), xb.grad, {n: p.grad for n, p in block.named_parameters()}))
    (y1, gx1, g1), (y2, gx2, g2) = outs
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert list(g1) == list(g2) and all(torch.equal(g1[n], g2[n]) for n in g1), [n for n in g1 if not torch.equal(g1[n], g2[n])]
    assert gate_routes(fallback.gate, x)[4] is None  # no slot locations (Tessera sorts its routes itself)


@pytest.mark.parametrize("field,kwargs", [
    ("moe.drop_tokens", {"drop_tokens": True}),
    ("moe.noisy_gate_policy", {"noisy_gate_policy": "Jitter"}),
    ("moe.use_rts", {"use_rts": True, "k": 1}),
    ("moe.top2_2nd_expert_sampling", {"top2_2nd_expert_sampling": True, "k": 2}),
])
def test_options_it_does_not_implement_are_refused_by_name(field, kwargs):
    with pytest.raises(TesseraConfigError) as err:
        gating.Router(32, 8, **kwargs)
    msg = str(err.value)
    assert field in msg and "\n" not in msg and "deepspeed" in msg.lower()


def test_options_that_change_nothing_when_dropless_are_accepted():
    gate = gating.Router(32, 8, k=3, use_rts=True, top2_2nd_expert_sampling=True, ep_group=None)
    assert gate.k == 3 and gate.wg.weight.shape == (8, 32)


TRAIN = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "deepspeed":
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import json, torch
from tessera.engine import Batch
from tessera.model import moe
from tessera.spec.presets import get_model
from tessera.testing.reference import reference_train
spec = get_model("tiny-qwen3-next")
g = torch.Generator().manual_seed(3)
batches = [[Batch.from_tokens(torch.randint(0, spec.vocab, (2, 1, 17), generator=g))] for _ in range(2)]
res = reference_train(spec, batches, seed=5, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
print(json.dumps({"source": moe.GATING_SOURCE, "losses": [float(x).hex() for x in res.losses],
                  "params": {n: float(p.double().sum()).hex() for n, p in res.state.items()}}))
"""


def test_training_without_deepspeed_gives_the_same_losses_and_weights(tmp_path):
    """The tiny Qwen3-Next trained two steps in a process where ``import deepspeed`` fails
    (routing from tessera.model.gating) and in this one (DeepSpeed's): same losses, same weights."""
    import json
    import subprocess
    import sys

    runs = {}
    for name, text in (("blocked", TRAIN), ("deepspeed", TRAIN.replace("sys.meta_path.insert(0, Block())", ""))):
        script = tmp_path / f"train_{name}.py"
        script.write_text(text)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(proc.stdout.splitlines()[-1])
    blocked, ref = runs["blocked"], runs["deepspeed"]
    assert blocked["source"] == gating.SOURCE and ref["source"] == "deepspeed"
    assert len(blocked["losses"]) == 2 and blocked["losses"] == ref["losses"]
    assert blocked["params"] == ref["params"] and len(ref["params"]) > 10
