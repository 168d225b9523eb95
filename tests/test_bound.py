"""The iteration lower bound (tessera.sim.bound) against every schedule of small instances, its
tightness on 1F1B, and a real preset.

What "every schedule" means. The simulator runs each rank's instruction list in order, so an
execution of a set of Programs is fixed by one order of each rank's instructions; the bound must
hold for every such order that ``validate_programs`` accepts (the same instructions, the same
``FB`` pairs and pair orders, any order). :class:`_Search` computes, for small instances, whether
any of them beats the bound (and, on the smaller ones, the exact optimum), by depth-first search
over

* every order of each rank's compute instructions (``F``, ``B``, ``W``, ``FB``) in which every
  instruction's inputs are computed earlier: a forward after the forward of the previous stage
  (for the same microbatch), a backward after its own forward and the next stage's backward, a
  ``W`` after its ``B``. Every valid order is of this kind: the validator wants a forward's
  input received (or computed locally) before it and a send after the computation it sends, and
  a receive waits for its send, so an order that puts an instruction before one it transitively
  needs deadlocks or is rejected;
* with communication placed canonically: each receive right before the instruction that consumes
  it, each send right after the instruction that produces it (what ``lower_communication`` does),
  and both orders of two sends that leave one ``FB`` on the same link. That loses nothing: the
  simulator's times are max-plus, hence monotone, in when sends are issued and receives posted; a
  receive posted earlier only blocks its rank earlier, and a send issued earlier arrives no later,
  *provided it does not queue on its link behind a transfer of an earlier instruction* (the
  search checks that this never happens, ``queued == 0``; with one ``FB``'s two sends it tries
  both orders). ``register_w`` and ``slot`` take no time. ``reduce_grads`` and
  ``optimizer_step`` end every Program;
* each schedule once: instructions are chosen in increasing (start time, rank), the order in
  which the simulator's clock meets them (every duration is positive, so a predecessor always
  starts strictly earlier), and the start and end of the chosen instruction follow from what is
  already placed (the previous instruction of its rank, arrivals, the p2p and data-parallel links
  of its rank, as in ``tessera.sim.simulator`` and ``tessera.sim.dpsync``);
* branch and bound with a bound that needs no proof: a node is cut when some rank's remaining
  work, started no earlier than the node's clock (later choices start later), plus its optimizer
  step, already reaches the threshold (the bound under test, or the best schedule so far); or
  its remaining weight-gradient work plus the smallest reduce-scatter still to come, or what its
  data-parallel link has queued, plus the optimizer step.

The search's timing model is checked against ``simulate`` on the template's own order (a
"forced" search that must reproduce ``simulate``'s iteration time) and, where the optimum is
computed, on the optimal schedule (compiled into Programs, validated and simulated). Sizes are
capped so that the whole file runs in 7-9 s on two cores: pp 2-3, M 2-4, vpp 1-2, up to 21 compute
instructions per rank; dualpipe-v only with overlap (without it, pp 2 M 4 takes more than a
minute). Where the optimum is computed, the bound equals it on every 1F1B instance and is 0.96-1
of it on the interleaved and dualpipe-v ones (it does not see two ranks competing for the same
microbatches' chain).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import pytest

from tessera.cost.uniform import uniform_costs
from tessera.plan.baseline import baseline_plan
from tessera.program.exchanges import with_exchanges
from tessera.program.compiler import compile_plan, lower_communication, order_sends_fifo
from tessera.program.instructions import COMPUTE_OPS, Instr, Op
from tessera.program.validate import validate_programs
from tessera.sim.bound import LowerBound, efficiency, iteration_lower_bound, plan_efficiency
from tessera.sim.simulator import _compute_dag, side_ends, simulate

EPS = 1e-9  # ms


# --------------------------------------------------------------------------------------------
# the exhaustive search


class _Instance:
    """The compute instructions ("jobs") of Programs, with what the simulator charges for them."""

    def __init__(self, programs, costs):
        self.programs, self.costs = programs, costs
        self.pp = len(programs)
        self.owner = {s.stage: p.rank for p in programs for s in p.stages}
        self.last = len(self.owner) - 1
        self.p2p = costs.p2p_ms
        self.fsdp = costs.dp_shard == "fsdp"
        cache: dict = {}
        self.jobs, self.register, self.template_order = [], [], []
        for p in programs:
            js, reg = [], {}
            for i, ins in enumerate(p.instructions):
                if ins.op == Op.REGISTER_W:  # zero time; kept right after its B
                    key = (ins.mb, p.stages[ins.chunk].stage)
                    reg[next(j["k"] for j in js if j["b"] == key)] = ins
                if ins.op not in COMPUTE_OPS:
                    continue
                st = p.stages
                f = (ins.mb, st[ins.chunk].stage) if ins.op in (Op.F, Op.FB) else None
                b = ((ins.mb, st[ins.chunk].stage) if ins.op == Op.B else
                     (ins.mb2, st[ins.chunk2].stage) if ins.op == Op.FB else None)
                w = (ins.mb, st[ins.chunk].stage) if ins.op == Op.W else b if ins.with_w else None
                bchunk = ins.chunk2 if ins.op == Op.FB else ins.chunk
                dag, sched = _compute_dag(p, ins, costs, i, cache)
                d = sched.makespan
                assert d > 0, "the canonical order needs positive durations"
                fo, bo = side_ends(dag, sched) if ins.op == Op.FB else (d, d)  # early sends
                js.append(dict(k=len(js), ins=ins, f=f, b=b, w=w, d=d, fo=fo, bo=bo, fc=ins.chunk if f else None,
                               bc=bchunk if b else None, wc=bchunk if w else None))
            self.jobs.append(js)
            self.register.append(reg)
            self.template_order.append(list(range(len(js))))

        def chunk_sum(p, attr):
            return {s.chunk: sum(getattr(costs.layer(l).dp, attr) for l in range(s.start, s.stop)) for s in p.stages}

        self.gather = [chunk_sum(p, "gather_ms") for p in programs]
        self.reduce = [chunk_sum(p, "reduce_ms") for p in programs]
        self.opt = [sum(costs.layer(l).dp.optimizer_ms for l in {l for s in p.stages for l in range(s.start, s.stop)})
                    for p in programs]
        self.n_w = [{c: sum(1 for j in js if j["wc"] == c) for c in range(p.vpp)} for p, js in zip(programs, self.jobs)]

    def programs_of(self, orders, swaps, fifo=False):
        """Programs running job order ``orders[r]`` with canonical communication; ``swaps``: the
        (rank, job) whose two sends to one peer go backward side first; ``fifo``: then
        ``order_sends_fifo`` (what the compiler does; sends move later, never earlier)."""
        out = []
        for r, p in enumerate(self.programs):
            compute = []
            for k in orders[r]:
                compute.append(self.jobs[r][k]["ins"])
                if k in self.register[r]:
                    compute.append(self.register[r][k])
            lowered = list(lower_communication(p.template, r, p.pp, p.vpp, tuple(compute)))
            pos = 0
            for k in orders[r]:
                pos = lowered.index(self.jobs[r][k]["ins"], pos)
                if (r, k) in swaps:
                    a, b = lowered[pos + 1], lowered[pos + 2]
                    assert a.op == Op.SEND_ACT and b.op == Op.SEND_GRAD and a.peer == b.peer
                    lowered[pos + 1], lowered[pos + 2] = b, a
            out.append(tuple(lowered))
        if fifo:
            out = order_sends_fifo(tuple(out), tuple(tuple(s.stage for s in p.stages) for p in self.programs))
        progs = tuple(replace(p, instructions=lowered + (Instr(Op.REDUCE_GRADS), Instr(Op.OPTIMIZER_STEP)))
                      for p, lowered in zip(self.programs, out))
        # the compiler's p2p order belongs to the compiled instructions: derive it for the new ones
        return with_exchanges(progs) if fifo else tuple(replace(p, p2p_batches=()) for p in progs)


class _Search:
    """Depth-first search over every schedule (module docstring); ``forced``: follow these job
    orders (evaluates one schedule)."""

    def __init__(self, inst: _Instance, forced=None):
        self.inst, self.forced = inst, forced
        self.best, self.best_orders = math.inf, None
        self.nodes = self.leaves = 0
        self.queued = 0.0  # worst wait of a transfer behind an earlier instruction's transfer, ms

    def run(self, threshold: float = math.inf) -> float:
        """Least iteration time below ``threshold`` (``threshold`` itself if none is below)."""
        I = self.inst
        self.best = threshold
        self.now = [0.0] * I.pp
        self.rem = [sum(j["d"] for j in js) for js in I.jobs]
        self.rem_w = [sum(j["d"] for j in js if j["wc"] is not None) for js in I.jobs]
        self.done = [[False] * len(js) for js in I.jobs]
        self.seq = [[] for _ in range(I.pp)]
        self.swaps: set = set()
        self.f_done: dict = {}
        self.b_done: dict = {}
        self.arrival: dict = {}  # ("act" | "grad", mb, sender stage) -> ms
        self.link: dict = {}  # (src, dst) -> free from, ms
        self.dp_free = [0.0] * I.pp
        self.gathered = [set() for _ in range(I.pp)]
        self.w_left = [dict(x) for x in I.n_w]
        self._dfs((-1.0, -1), sum(len(js) for js in I.jobs))
        return self.best

    def _start(self, r, j):
        """When job ``j`` can start on rank ``r`` if its inputs are computed, else None."""
        I, t = self.inst, self.now[r]
        if j["f"]:
            m, s = j["f"]
            if s > 0:
                if (m, s - 1) not in self.f_done:
                    return None
                if I.owner[s - 1] != r:
                    t = max(t, self.arrival[("act", m, s - 1)])
        if j["b"]:
            m, s = j["b"]
            if j["b"] not in self.f_done:
                return None
            if s < I.last:
                if (m, s + 1) not in self.b_done:
                    return None
                if I.owner[s + 1] != r:
                    t = max(t, self.arrival[("grad", m, s + 1)])
        elif j["w"] and j["w"] not in self.b_done:
            return None
        return t

    def _outputs(self, r, j):
        I, out = self.inst, []
        if j["f"] and j["f"][1] < I.last and I.owner[j["f"][1] + 1] != r:
            out.append((("act", *j["f"]), I.owner[j["f"][1] + 1], j["fo"]))
        if j["b"] and j["b"][1] > 0 and I.owner[j["b"][1] - 1] != r:
            out.append((("grad", *j["b"]), I.owner[j["b"][1] - 1], j["bo"]))
        return out

    def _node_bound(self, t_clock):
        I, lb = self.inst, 0.0
        for r in range(I.pp):
            if self.rem[r] > 0:
                t = max(self.now[r], t_clock)
                min_red = min((I.reduce[r][c] for c, n in self.w_left[r].items() if n > 0), default=0.0)
                v = max(t + self.rem[r], t + self.rem_w[r] + min_red, self.dp_free[r])
            else:
                v = max(self.now[r], self.dp_free[r])
            lb = max(lb, v + I.opt[r])
        return lb

    def _dfs(self, last_key, left):
        self.nodes += 1
        I = self.inst
        if left == 0:
            self.leaves += 1
            end = max(max(self.now[r], self.dp_free[r]) + I.opt[r] for r in range(I.pp))
            if end < self.best - EPS or self.forced is not None:
                self.best = end
                self.best_orders = ([list(s) for s in self.seq], set(self.swaps))
            return
        if self.forced is None and self._node_bound(max(last_key[0], 0.0)) >= self.best - EPS:
            return
        cands = []
        for r in range(I.pp):
            if self.forced is not None:
                ks = self.forced[r][len(self.seq[r]):len(self.seq[r]) + 1]
            else:
                ks = [k for k, d in enumerate(self.done[r]) if not d]
            for k in ks:
                t = self._start(r, I.jobs[r][k])
                if t is not None and (t, r) >= last_key:
                    cands.append((t, r, k))
        for t, r, k in sorted(cands):
            j = I.jobs[r][k]
            outs = self._outputs(r, j)
            two = len(outs) == 2 and outs[0][1] == outs[1][1] and self.forced is None
            for swap in ((False, True) if two else (False,)):
                self._place(r, k, j, t, outs[::-1] if swap else outs, swap, left)

    def _place(self, r, k, j, t, outs, swap, left):
        I = self.inst
        saved = (self.now[r], self.dp_free[r], set(self.gathered[r]), dict(self.w_left[r]))
        end, dpf = t + j["d"], self.dp_free[r]
        if I.fsdp:  # every F and B gathers its chunk(s), from the instruction's start
            cs = [c for c in (j["fc"], j["bc"]) if c is not None and I.gather[r][c] > 0]
            if cs:
                dpf = max(t, dpf) + sum(I.gather[r][c] for c in cs)
                end = max(end, dpf)
        elif j["fc"] is not None and j["fc"] not in self.gathered[r]:  # zero1: a chunk's first forward
            self.gathered[r].add(j["fc"])
            if I.gather[r][j["fc"]] > 0:
                dpf = max(0.0, dpf) + I.gather[r][j["fc"]]
                end = max(end, dpf)
        if j["wc"] is not None:
            c = j["wc"]
            self.w_left[r][c] -= 1
            if (I.fsdp or self.w_left[r][c] == 0) and I.reduce[r][c] > 0:  # zero1: after the chunk's last W
                dpf = max(end, dpf) + I.reduce[r][c]
        self.dp_free[r] = dpf
        if j["f"]:
            self.f_done[j["f"]] = end
        if j["b"]:
            self.b_done[j["b"]] = end
        saved_links: dict = {}
        for key, peer, off in outs:  # each send leaves when its side is done (the simulator's early sends)
            lk = (r, peer)
            free = self.link.get(lk, 0.0)
            if lk not in saved_links:  # this instruction's first send on the link
                saved_links[lk] = self.link.get(lk)
                self.queued = max(self.queued, free - (t + off))
            self.arrival[key] = self.link[lk] = max(t + off, free) + I.p2p
        self.now[r] = end
        self.rem[r] -= j["d"]
        if j["wc"] is not None:
            self.rem_w[r] -= j["d"]
        self.done[r][k] = True
        self.seq[r].append(k)
        if swap:
            self.swaps.add((r, k))
        self._dfs((t, r), left - 1)
        self.swaps.discard((r, k))
        self.seq[r].pop()
        self.done[r][k] = False
        self.rem[r] += j["d"]
        if j["wc"] is not None:
            self.rem_w[r] += j["d"]
        self.now[r], self.dp_free[r], self.gathered[r], self.w_left[r] = saved
        self.f_done.pop(j["f"], None)
        self.b_done.pop(j["b"], None)
        for key, _, _ in outs:
            del self.arrival[key]
        for lk, v in saved_links.items():
            if v is None:
                del self.link[lk]
            else:
                self.link[lk] = v


def check_exhaustive(programs, costs, *, optimum: bool) -> tuple[LowerBound, float, float | None]:
    """Assert that no schedule of ``programs`` beats their bound; returns (bound, the template's
    simulated time, the exact optimum when ``optimum``)."""
    inst = _Instance(programs, costs)
    sim = simulate(programs, costs).iteration_ms
    forced = _Search(inst, forced=inst.template_order)
    assert forced.run() == pytest.approx(sim, rel=1e-12, abs=1e-12)  # the search's timing is the simulator's
    lb = iteration_lower_bound(programs, costs)
    assert lb.ms <= sim + EPS
    refute = _Search(inst)
    refute.run(threshold=lb.ms)
    assert refute.best_orders is None, f"a schedule takes {refute.best} ms, below the bound {lb.ms} ms"
    assert refute.queued <= EPS  # canonical sends never wait behind an earlier instruction's
    if not optimum:
        return lb, sim, None
    s = _Search(inst)
    best = s.run(threshold=sim + 2 * EPS)
    assert s.queued <= EPS
    orders, swaps = s.best_orders  # the template's own order is at most sim, so a schedule is found
    # the search also explores schedules whose links are not first-in-first-out (a superset of
    # what validate_programs accepts, so the bound is checked against more); the best one, made
    # FIFO, is valid and, with sends moved later only, no faster (equal when nothing moved)
    progs = inst.programs_of(orders, swaps, fifo=True)
    validate_programs(progs)
    t = simulate(progs, costs).iteration_ms
    if [p.instructions for p in progs] == [p.instructions for p in inst.programs_of(orders, swaps)]:
        assert t == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert t >= best - EPS
    assert lb.ms <= best + EPS
    return lb, sim, best


# --------------------------------------------------------------------------------------------
# instances


def uniform_programs(template, pp, vpp, m, overlap, split_w, *, a2a_ms=0.3, p2p_ms=0.2):
    """Baseline Programs on uniform costs: one layer per stage, F 1 ms, B 2 ms (1 + W 1 with
    split W), A2As of ``a2a_ms``, p2p ``p2p_ms``."""
    costs = uniform_costs(pp * vpp, 1.0, 1.0 if split_w else 2.0, 1.0 if split_w else 0.0, a2a_ms=a2a_ms,
                          p2p_ms=p2p_ms)
    return compile_plan(baseline_plan(costs, template, pp, vpp, m, overlap=overlap, split_w=split_w)), costs


@lru_cache(maxsize=None)
def tiny_resolved(template, pp, vpp, m, overlap, split_w, dp_shard="zero1"):
    from tessera import flow
    from tessera.config.load import load_recipe

    rec = load_recipe("recipes/tiny-qwen3-next.yaml", [
        f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.num_microbatches={m}", f"planner.template={template}",
        f"planner.overlap={str(overlap).lower()}", f"planner.split_w={str(split_w).lower()}",
        f"parallel.dp_shard={dp_shard}"])
    res = flow.resolve(rec)
    return res, flow.build_costs(res)


def tiny_programs(template, pp, vpp, m, overlap, split_w, dp_shard="zero1"):
    """Baseline Programs of the tiny preset (8 layers DDDA DDDA, MoE A2As, zero1 data parallelism)."""
    from tessera import flow

    res, costs = tiny_resolved(template, pp, vpp, m, overlap, split_w, dp_shard)
    return flow.compile_programs(flow.build_baseline(res, costs)), costs


# (template, pp, vpp, M, overlap, split_w)
T1, TI, TD = "1f1b", "interleaved-1f1b", "dualpipe-v"
UNIFORM = [(T1, pp, 1, m, ov, sw) for pp, m in ((2, 2), (2, 3), (3, 2)) for ov in (False, True) for sw in (False, True)]
UNIFORM += [(T1, pp, 1, m, True, sw) for pp, m in ((2, 4), (3, 3)) for sw in (False, True)]
UNIFORM += [(TI, 2, 2, 2, ov, sw) for ov in (False, True) for sw in (False, True)]
UNIFORM += [(TI, 2, 2, 3, False, True), (TI, 2, 2, 3, True, False), (TI, 2, 2, 3, True, True),
            (TI, 2, 2, 4, True, False), (TI, 2, 2, 4, True, True), (TI, 3, 2, 3, True, True), (TD, 2, 2, 4, True, True)]
TINY = [(T1, 2, 1, 2, ov, sw) for ov in (False, True) for sw in (False, True)]
TINY += [(T1, 2, 1, 3, False, False), (T1, 2, 1, 3, True, False), (T1, 2, 1, 3, True, True),
         (T1, 3, 1, 2, False, True), (T1, 3, 1, 2, True, True), (T1, 3, 1, 3, True, False),
         (TI, 2, 2, 2, False, False), (TI, 2, 2, 2, True, False), (TI, 2, 2, 2, True, True), (TI, 2, 2, 3, True, False),
         (TI, 2, 2, 3, True, True), (TI, 2, 2, 4, True, False), (TD, 2, 2, 4, True, False)]
TINY_FSDP = [(T1, 2, 1, 2, True, True), (TI, 2, 2, 2, True, False)]
# the refutation only (the optimum search takes up to 20 s there)
UNIFORM_NO_OPTIMUM = {(TD, 2, 2, 4, True, True)}
TINY_NO_OPTIMUM = {(TI, 2, 2, 2, True, True), (TI, 2, 2, 3, True, True), (TD, 2, 2, 4, True, False)}


def _id(case) -> str:
    t, pp, vpp, m, ov, sw = case
    return f"{t}-pp{pp}-v{vpp}-m{m}{'-ov' if ov else ''}{'-sw' if sw else ''}"


@pytest.mark.parametrize("case", UNIFORM, ids=[_id(c) for c in UNIFORM])
def test_bound_below_every_schedule_uniform(case):
    lb, sim, best = check_exhaustive(*uniform_programs(*case), optimum=case not in UNIFORM_NO_OPTIMUM)
    assert best is None or best <= sim + EPS


@pytest.mark.parametrize("case", TINY, ids=[_id(c) for c in TINY])
def test_bound_below_every_schedule_tiny_preset(case):
    check_exhaustive(*tiny_programs(*case), optimum=case not in TINY_NO_OPTIMUM)


@pytest.mark.parametrize("case", TINY_FSDP, ids=[_id(c) for c in TINY_FSDP])
def test_bound_below_every_schedule_fsdp(case):
    progs, costs = tiny_programs(*case, dp_shard="fsdp")
    assert costs.dp_shard == "fsdp" and costs.layer(0).dp.gather_ms > 0
    check_exhaustive(progs, costs, optimum=False)


def test_bound_below_every_schedule_with_planned_pair_orders():
    """A Tessera plan (stored pair orders, ``FB`` with ``order >= 0``) on the tiny preset."""
    from tessera import flow

    res, costs = tiny_resolved(TI, 2, 2, 2, True, False)
    programs = flow.compile_programs(flow.plan_recipe(res, costs).tessera)
    assert any(i.op == Op.FB and i.order >= 0 for p in programs for i in p.instructions)
    check_exhaustive(programs, costs, optimum=False)


def test_exhaustive_search_sees_better_orders():
    """The search is not the template in disguise: on 1F1B with split W it finds a schedule
    shorter than the template's (deferring W), and the bound meets that optimum."""
    lb, sim, best = check_exhaustive(*uniform_programs(T1, 2, 1, 3, False, True), optimum=True)
    assert best < sim - 0.5
    assert lb.ms == pytest.approx(best)


# --------------------------------------------------------------------------------------------
# tightness and the bound's parts


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 5), (4, 8), (4, 4), (3, 2)])
def test_1f1b_bound_is_the_known_optimum(pp, m):
    """1F1B, F = 1, B = 2 per stage (no split W, no communication): the optimum
    ``M*(F+B) + (pp-1)*(F+B)`` is what the bound gives and what the simulator reaches."""
    costs = uniform_costs(pp, 1.0, 2.0, 0.0)
    programs = compile_plan(baseline_plan(costs, T1, pp, 1, m, overlap=False, split_w=False))
    lb = iteration_lower_bound(programs, costs)
    optimum = (m + pp - 1) * 3.0 if m >= pp else None
    sim = simulate(programs, costs).iteration_ms
    if optimum is not None:
        assert lb.ms == optimum and sim == optimum
    last = pp - 1
    assert lb.fill_ms[last] == last * 1.0 and lb.work_ms[last] == m * 3.0 and lb.drain_ms[last] == last * 2.0
    assert lb.simple_ms == lb.fill_ms[last] + lb.work_ms[last] + lb.drain_ms[last]
    assert lb.critical_path_ms == pp * 3.0  # one microbatch down and back
    assert lb.ms <= sim and efficiency(lb.ms, sim) == (1.0 if optimum is not None else lb.ms / sim)


def test_parts_with_p2p_and_data_parallelism():
    """Fill counts the forward chain and its transfers; drain the backward chain, the last
    reduce-scatter and the optimizer step."""
    pp, m = 3, 4
    costs = uniform_costs(pp, 1.0, 2.0, 0.0, p2p_ms=0.25)
    programs = compile_plan(baseline_plan(costs, T1, pp, 1, m, overlap=False, split_w=False))
    lb = iteration_lower_bound(programs, costs)
    assert lb.fill_ms == pytest.approx((0.0, 1.25, 2.5))
    assert lb.drain_ms == pytest.approx((0.0, 2.25, 4.5))
    assert lb.ms == pytest.approx(2.5 + m * 3.0 + 4.5)
    assert lb.ms <= simulate(programs, costs).iteration_ms + EPS
    # data parallelism: every layer reduce-scatters 0.5 ms and steps its optimizer 0.25 ms
    from tessera.cost.types import LayerDP

    dp = LayerDP(gather_ms=0.0, reduce_ms=0.5, optimizer_ms=0.25)
    costs_dp = replace(costs, layers=tuple(replace(l, dp=dp) for l in costs.layers))
    lb_dp = iteration_lower_bound(programs, costs_dp)
    assert lb_dp.drain_ms[0] == pytest.approx(0.75)  # B of stage 0 holds W: reduce + optimizer after it
    assert lb_dp.ms >= lb.ms + 0.75 - EPS
    assert lb_dp.ms <= simulate(programs, costs_dp).iteration_ms + EPS


def test_efficiency_rejects_a_bound_above_the_time():
    assert efficiency(90.0, 100.0) == pytest.approx(0.9)
    assert efficiency(100.0 * (1 + 1e-12), 100.0) == 1.0
    with pytest.raises(ValueError, match="exceeds"):
        efficiency(101.0, 100.0)
    with pytest.raises(ValueError, match="positive"):
        efficiency(1.0, 0.0)


# --------------------------------------------------------------------------------------------
# a real preset


def test_real_preset_qwen3_next_80b():
    """Baseline of recipes/qwen3-next-80b.yaml (interleaved 1F1B, pp 8, vpp 2, ep 8, M 16, split
    W, overlap): bound below the simulated iteration, efficiency in (0, 1]. About 0.6 s."""
    from tessera import flow
    from tessera.config.load import load_recipe

    res = flow.resolve(load_recipe("recipes/qwen3-next-80b.yaml"))
    costs = flow.build_costs(res)
    programs = flow.compile_programs(flow.build_baseline(res, costs))
    result = simulate(programs, costs)
    pe = plan_efficiency(programs, costs, result)
    lb = pe.bound
    assert 0.0 < lb.ms <= result.iteration_ms
    assert 0.0 < pe.efficiency <= 1.0 and pe.efficiency == pytest.approx(lb.ms / result.iteration_ms)
    assert pe.efficiency > 0.8  # 0.930 on the cost model of this version
    assert lb.critical_path_ms <= lb.ms and lb.simple_ms <= lb.ms
    busiest = max(range(8), key=lambda r: result.ranks[r].busy_ms)
    assert lb.work_ms[busiest] == pytest.approx(result.ranks[busiest].busy_ms)  # work is what the simulator charges
    assert pe.describe().startswith("lower bound ") and "efficiency" in pe.describe()


def test_search_refutes_a_bound_above_the_optimum():
    """The refutation has teeth: 0.01 ms above the optimum, it finds the schedule below."""
    programs, costs = uniform_programs(TI, 2, 2, 3, False, True)
    lb = iteration_lower_bound(programs, costs)
    s = _Search(_Instance(programs, costs))
    assert s.run(threshold=lb.ms + 0.01) == pytest.approx(lb.ms)  # the bound is the optimum here
    assert s.best_orders is not None


@pytest.mark.parametrize("overrides", [(), ("planner.template=1f1b", "parallel.vpp=1")], ids=["recipe", "1f1b"])
def test_bound_holds_when_the_first_forward_is_shorter_than_its_zero1_gather(overrides):
    """tiny-nemotron-h's planned Programs on the cpu preset: stage 0's first forward computes in
    less time than its chunk's parameter all-gather, and the simulator sends its activations
    when they are computed, before the gather ends; the bound must not delay that send (it once
    did, and came out 1.6% above the simulated iteration)."""
    from pathlib import Path

    from tessera import flow
    from tessera.config.load import load_recipe

    recipe = load_recipe(str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-nemotron-h.yaml"), list(overrides))
    res = flow.resolve(recipe)
    costs = flow.build_costs(res)
    programs = flow.compile_programs(flow.plan_recipe(res, costs).tessera)
    result = simulate(programs, costs)
    first = next(i for i, ins in enumerate(programs[0].instructions) if ins.op.name == "F")
    gather = next(c for c in result.collectives if c.rank == 0 and c.kind == "all_gather")
    sent = min(t.issue_ms for t in result.transfers if t.kind == "act" and t.src == 0)
    assert sent < gather.end_ms  # the case: the send leaves before the gather ends
    assert first == gather.instr
    bound = iteration_lower_bound(programs, costs)
    assert bound.ms <= result.iteration_ms
    assert 0.5 < plan_efficiency(programs, costs, result).efficiency <= 1.0
