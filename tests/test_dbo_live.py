"""Live token counts for the dynamic bubble optimizer (``dbo.routing: router``), without Ray.

The annotated Programs of the tiny recipe (cut to 4 layers, as ``tests/test_dbo_train.py``) and
their tables: re-predicting a table from the loads it was made from changes nothing, and
re-predicting a uniform table from skewed loads gives the skewed table's predictions for the
rank's own layers (:meth:`RankTable.with_loads`); the driver's prior for ``router`` is uniform
and survives the plain-value round trip; :class:`LiveCounts` turns recorded router counts into
EP-rank loads; the policy re-predicts at a slot and goes back to the prior at ``reset``; the
config accepts the new fields and refuses bad values with one line. The real Ray Train job with
live counts is in ``tests/test_dbo_train.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tessera.config.load import load_recipe
from tessera.dbo.counts import skewed_counts, uniform_counts
from tessera.dbo.predict import moe_layers, rank_tables
from tessera.errors import TesseraConfigError

pytestmark = pytest.mark.xdist_group("dbo_live")  # module fixtures built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
SMALL = ("model.num_layers=4", "parallel.seq_length=32", "hardware.inline.deferred_w_us=0")
LIVE = ("dbo.enabled=true", "dbo.routing=router")


@pytest.fixture(scope="module")
def planned():
    from tessera.config.resolve import resolve_model
    from tessera.flow import build_costs, resolve
    from tessera.flow import plan_programs

    r = load_recipe(TINY, [*SMALL, *LIVE])
    costs = build_costs(resolve(r))
    _, programs = plan_programs(r, costs)
    return r, programs, costs, resolve_model(r)


def _close(a, b):
    return all(x == pytest.approx(y, rel=1e-9, abs=1e-12) for x, y in zip(a, b)) and len(a) == len(b)


def _counts(r, programs, costs, skew: bool):
    p = r.parallel
    n = programs[0].num_microbatches
    tokens = p.ep * p.micro_batch_size * p.seq_length * 2  # the tiny preset routes top-2
    if skew:
        return skewed_counts(n, moe_layers(costs), 8, tokens, temperature=1.5, seed=3)
    return uniform_counts(n, moe_layers(costs), 8, tokens)


def test_router_prior_is_uniform_and_round_trips(planned):
    from tessera.program.instructions import Program
    from tessera.train.dbo.table import dbo_tables, table_from_dict, table_to_dict

    r, programs, costs, model = planned
    tables = dbo_tables(r, programs, costs, model)
    uniform = rank_tables(programs, costs, _counts(r, programs, costs, False), r.parallel.ep, r.dbo.margin)
    assert tuple(t.rank_table() for t in tables) == uniform
    for t, prog in zip(tables, programs):
        assert t.slots and all(s.idle_ms == (0.0, 0.0) for s in t.slots)  # balanced: nothing to predict yet
        assert {s.kind for s in t.slots} == {"ep", "recv"} and any(s.terms for s in t.slots)
        mine = {l for s in prog.stages for l in range(s.start, s.stop)}
        assert t.loads and {l for _, l, _ in t.loads} <= mine  # only the rank's own layers are live
        back = table_from_dict(json.loads(json.dumps(table_to_dict(t))), Program.from_dict(prog.to_dict()))
        assert back == t


def test_the_job_runs_the_joint_policy_on_units_that_survive_the_round_trip(planned):
    from tessera.dbo.units import unit_table
    from tessera.engine.dbo import DBOPolicy
    from tessera.engine.dbo_joint import JointDBOPolicy
    from tessera.program.instructions import Program
    from tessera.train.dbo.table import JobTable, dbo_tables, make_policy, table_from_dict, table_to_dict

    r, programs, costs, model = planned
    tables = dbo_tables(r, programs, costs, model)
    for t, prog in zip(tables, programs):
        assert isinstance(t, JobTable) and t.units == unit_table(t.rank_table(), prog, costs, "split")
        kinds = {u.kinds for u in t.units.units}
        assert ("expert",) in kinds and len(kinds) > 1  # expert W moves apart from the rest
        assert all(len(u.ms) == r.parallel.ep for u in t.units.units)
        sent = json.loads(json.dumps(table_to_dict(t)))  # what the driver's get_program carries
        assert isinstance(sent["units"]["layers"][0][0], int)
        back = table_from_dict(sent, Program.from_dict(prog.to_dict()))
        assert type(back) is JobTable and back == t and back.units == t.units
        policy = make_policy(r, back, ep_rank=1)
        assert type(policy) is JointDBOPolicy and policy.prior_units == t.units and policy.ep_rank == 1
        assert policy.cap_bytes == r.dbo.pool_mem_gb * 1e9 and policy.joint_pool.joint
        plain = table_from_dict({k: v for k, v in sent.items() if k != "units"}, Program.from_dict(prog.to_dict()))
        assert plain == t.rank_table() and type(make_policy(r, plain, 0)) is DBOPolicy
        assert type(make_policy(r, plain, 0, units=t.units)) is JointDBOPolicy
        other = dict(sent, units=table_to_dict(tables[1 - t.rank])["units"])
        with pytest.raises(ValueError, match="carries units of rank"):
            table_from_dict(other, Program.from_dict(prog.to_dict()))
    chunk_ms = {}  # a chunk's units sum to its W
    for u in tables[0].units.units:
        chunk_ms.setdefault((u.chunk, u.mb), [0.0] * r.parallel.ep)
        chunk_ms[(u.chunk, u.mb)] = [a + b for a, b in zip(chunk_ms[(u.chunk, u.mb)], u.ms)]
    for (c, mb), ms in chunk_ms.items():
        assert ms == pytest.approx(list(tables[0].task(c, mb).ms), rel=1e-9)


def test_with_loads_repredicts_the_rank_s_own_layers(planned):
    r, programs, costs, _ = planned
    ep = r.parallel.ep
    flat, skew = (rank_tables(programs, costs, _counts(r, programs, costs, s), ep, r.dbo.margin) for s in (False, True))
    c = _counts(r, programs, costs, True)
    for a, b in zip(flat, skew):
        same = b.with_loads({(mb, l): v for mb, l, v in b.loads})
        assert all(_close(x.idle_ms, y.idle_ms) for x, y in zip(same.slots, b.slots))
        assert all(_close(x.ms, y.ms) for x, y in zip(same.tasks, b.tasks))
        live = a.with_loads({(mb, l): c.rank_loads(mb, l, ep) for mb, l, _ in a.loads})
        for x, y in zip(live.slots, b.slots):
            if x.kind == "ep":
                assert _close(x.idle_ms, y.idle_ms), (x.instr, x.idle_ms, y.idle_ms)
        assert any(max(s.idle_ms) > 0 for s in live.slots if s.kind == "ep")
        assert all(_close(x.ms, y.ms) for x, y in zip(live.tasks, b.tasks))
        one = a.with_loads({(0, a.loads[0][1]): (300, 100)})  # one (mb, layer): only what names it changes
        changed = [s for s, s0 in zip(one.slots, a.slots) if s != s0]
        assert changed and all(any((t.mb, t.layer) == (0, a.loads[0][1]) for t in s.terms) for s in changed)
        with pytest.raises(ValueError, match="have 3 entries, the EP group has 2"):
            a.with_loads({(0, a.loads[0][1]): (1, 2, 3)})


def test_live_counts_turn_router_counts_into_ep_loads():
    import torch

    from tessera.train.dbo.live import LiveCounts, digest

    live = LiveCounts(None, 1)
    assert live() == {} and live.summary()["dbo_count_exchanges"] == 0  # nothing recorded: no exchange
    live.routed(0, 2, torch.tensor([3, 1, 0, 4], dtype=torch.int64))
    live.routed(1, 2, np.array([2, 2, 2, 2]))
    assert live({(0, 3), (5, 2)}) == {}  # a slot that needs none of them: no exchange
    assert live({(1, 2)}) == {(0, 2): (8,), (1, 2): (8,)}  # one needed: all pending go together
    s = live.summary()
    assert (s["dbo_count_exchanges"], s["dbo_count_rows"], s["dbo_count_tokens"]) == (1, 2, 16)
    assert s["dbo_count_digest"] == digest([3, 1, 0, 4, 2, 2, 2, 2]) < 2 ** 31
    live.reset()
    assert live.summary()["dbo_count_rows"] == 0

    class Two:  # the exchange of a 2-rank EP group whose peer routed the mirror image
        def exchange(self, local):
            return np.stack([local, local[::-1]])

    pair = LiveCounts(Two(), 2)
    pair.routed(0, 0, np.array([5, 1, 0, 2]))
    assert pair() == {(0, 0): (5 + 1 + 2 + 0, 0 + 2 + 5 + 1)}  # experts 0-1 on EP rank 0, 2-3 on rank 1
    pair.routed(0, 1, np.array([1, 1, 1]))
    with pytest.raises(ValueError, match="3 experts per layer must be divisible by ep=2"):
        pair()


def test_policy_repredicts_at_a_slot_and_reset_restores_the_prior(planned):
    from tessera.engine.dbo import DBOPolicy
    from tessera.engine.pool import MovablePool

    r, programs, costs, _ = planned
    ep = r.parallel.ep
    c = _counts(r, programs, costs, True)
    prior = rank_tables(programs, costs, _counts(r, programs, costs, False), ep, r.dbo.margin)[0]
    sent = []

    def live(needed):
        assert needed == {(t.mb, t.layer) for t in slot.terms}
        sent.append(1)
        return {(mb, l): c.rank_loads(mb, l, ep) for mb, l, _ in prior.loads} if len(sent) == 1 else {}

    policy = DBOPolicy(prior, 0, live=live)
    slot = next(s for s in prior.slots if s.kind == "ep")
    policy.select(slot.instr, MovablePool())
    assert policy.table != prior and policy.stats().live_loads == len(prior.loads)
    assert policy.stats().annotated_ms == policy.table.slot(slot.instr).idle_ms[0]
    policy.reset()
    assert policy.table == prior and policy.stats().live_loads == 0


def test_config_fields_and_one_line_errors():
    from tessera.config.resolve import resolve_model
    from tessera.config.validate import DBO_TRANSPORTS, validate_recipe
    from tessera.train.dbo.transport import KINDS

    assert DBO_TRANSPORTS == KINDS
    r = load_recipe(TINY, [*LIVE, "dbo.transport=compiled_graph", "dbo.count_timeout_s=2.5"])
    validate_recipe(r, resolve_model(r))
    assert (r.dbo.routing, r.dbo.transport, r.dbo.count_timeout_s) == ("router", "compiled_graph", 2.5)
    assert load_recipe(TINY, []).dbo.transport == "auto" and load_recipe(TINY, []).dbo.count_timeout_s == 5.0
    for bad, field in (("dbo.transport=nccl", "dbo.transport"), ("dbo.count_timeout_s=0", "dbo.count_timeout_s"),
                       ("dbo.routing=live", "dbo.routing")):
        with pytest.raises(TesseraConfigError, match=field.replace(".", r"\.")) as e:
            bad_recipe = load_recipe(TINY, [bad])
            validate_recipe(bad_recipe, resolve_model(bad_recipe))
        assert "\n" not in str(e.value)
