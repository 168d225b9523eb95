"""The token-count transports on a real Ray Train job (TorchTrainer, 2 CPU workers, gloo).

The run's shared Ray head (tests/conftest.py; other modules' jobs may run beside it) runs one
job; each worker writes what it saw to a JSON file that the
tests check:

* the all-gather and the compiled-graph transport deliver the same counts, equal to every
  rank's known counts, on every rank; ``auto`` gives :data:`AUTO_KIND`; both latencies are
  measured (reported, not asserted);
* a peer that stays silent past the graph's timeout (EP rank 1, or EP rank 0, which drives the
  graph): the graph step fails on every rank, the exchange goes over the all-gather with the
  right counts, later exchanges too, one warning;
* a graph task that raises (injected on one rank): the same;
* outside a Ray actor the compiled-graph path falls back to the all-gather with one warning;
* the graph's per-step decision on constructed inputs (no Ray).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import numpy as np
import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.xdist_group("ray-counts")  # on the run's shared Ray head (tests/conftest.py)

EXCHANGES = 12
GRACE_S = 3.0  # the graph's slack beyond its timeout (tessera.train.dbo.graph_transport.GRACE_S: 10 s), shortened
N = 8
LOGGER = "tessera.train.dbo.transport"


def _counts(rank: int, step: int) -> np.ndarray:
    return np.arange(N, dtype=np.int64) * (rank + 1) + 100 * step + rank


def _expected(step: int, ep: int = 2) -> list:
    return np.stack([_counts(r, step) for r in range(ep)]).tolist()


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def _loop(config: dict) -> None:
    """Ray Train's per-worker function: every check's observations into ``rank<R>.json``."""
    import time

    import ray.train
    import torch.distributed as dist

    from tessera.train.dbo.graph_transport import build_graph_transport
    from tessera.train.dbo.factory import make_transport
    from tessera.train.dbo.transport import LOG, AllGatherTransport, measure_latency

    rank = ray.train.get_context().get_world_rank()
    group = dist.new_group([0, 1])  # the EP group of this 2-rank job
    seen = _Warnings()
    logging.getLogger(LOGGER).addHandler(seen)
    out: dict = {"rank": rank}

    def run(transport, name: str, silent_at: int = -1, silent_rank: int = 1, silent_s: float = 0.0) -> None:
        got = []
        for step in range(config["exchanges"]):
            if step == silent_at and rank == silent_rank:
                time.sleep(silent_s)
            got.append(transport.exchange(_counts(rank, step)).tolist())
        out[name] = {"kind": transport.kind, "counts": got, "fallen_back": getattr(transport, "fallen_back", None),
                     "reason": getattr(transport, "reason", None), "warnings": list(seen.messages)}
        seen.messages.clear()

    auto = make_transport("auto", group)
    out["auto_kind"] = auto.kind
    auto.close()
    ag = make_transport("allgather", group)
    cg = make_transport("compiled_graph", group, timeout_s=10.0)  # no spurious timeout on a loaded machine
    run(ag, "allgather")
    run(cg, "compiled_graph")
    out["latency_us"] = {"allgather": measure_latency(ag, n=64, reps=config["reps"]),
                         "compiled_graph": measure_latency(cg, n=64, reps=config["reps"])}
    out["compiled_graph"]["after_latency_fallen_back"] = getattr(cg, "fallen_back", None)
    cg.close()
    out["compiled_graph"]["teardown_error"] = getattr(cg, "teardown_error", None)
    ag.close()

    hang = build_graph_transport(AllGatherTransport(group), timeout_s=0.5, logger=LOG, grace_s=GRACE_S)
    run(hang, "silent_peer", silent_at=2, silent_s=2.5)
    hang.close()
    # EP rank 0 drives the graph: its peers wait 2 * 0.5 + GRACE_S s, withdraw their counts, fall
    # back; when it comes, the graph step finds no counts and fails for it too
    lead = build_graph_transport(AllGatherTransport(group), timeout_s=0.5, logger=LOG, grace_s=GRACE_S)
    run(lead, "silent_leader", silent_at=3, silent_rank=0, silent_s=2 * 0.5 + GRACE_S + 2.0)
    lead.close()

    fail = build_graph_transport(AllGatherTransport(group), timeout_s=3.0, logger=LOG, grace_s=GRACE_S,
                                 fail_steps=frozenset({1}) if rank == 1 else frozenset())
    run(fail, "injected_failure")
    fail.close()
    logging.getLogger(LOGGER).removeHandler(seen)
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def job_results(ray_cluster, tmp_path_factory):
    """Run the job once on the run's shared Ray head; ``{rank: observations}``."""
    import ray.cloudpickle
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tessera.train.job.ray_setup import quiet_worker_logs

    temp = tmp_path_factory.mktemp("counts")
    out = temp / "out"
    out.mkdir()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not importable on the workers
    try:
        quiet_worker_logs()  # Ray Train's harmless State-API poll errors
        trainer = TorchTrainer(
            _loop, train_loop_config={"out": str(out), "exchanges": EXCHANGES, "reps": 50},
            torch_config=TorchConfig(backend="gloo", timeout_s=120),
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(name="counts", storage_path=str(temp / "runs"),
                                 failure_config=FailureConfig(max_failures=0, controller_failure_limit=0),
                                 worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                                                                  "OMP_NUM_THREADS": "1"}},
                                 logging_config=LoggingConfig(log_level="WARNING")))
        trainer.fit()
        results = {}
        for r in range(2):
            results[r] = json.loads((out / f"rank{r}.json").read_text())
        return results
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_both_transports_deliver_the_same_counts(job_results):
    from tessera.train.dbo.transport import AUTO_KIND

    expected = [_expected(s) for s in range(EXCHANGES)]
    for rank, res in job_results.items():
        assert res["auto_kind"] == AUTO_KIND
        ag, cg = res["allgather"], res["compiled_graph"]
        assert (ag["kind"], cg["kind"]) == ("allgather", "compiled_graph"), rank
        assert ag["counts"] == expected and cg["counts"] == expected, rank
        assert cg["fallen_back"] is False and cg["after_latency_fallen_back"] is False, (rank, cg["reason"])
        assert cg["warnings"] == [] and ag["warnings"] == [], rank
        lat = res["latency_us"]
        print(f"rank {rank}: median exchange of 64 int64: allgather {lat['allgather']:.0f} us, "
              f"compiled graph {lat['compiled_graph']:.0f} us")
        assert lat["allgather"] > 0 and lat["compiled_graph"] > 0
    assert [job_results[r]["compiled_graph"]["teardown_error"] for r in (0, 1)] == ["", ""]


@pytest.mark.parametrize("case, causes", [
    ("silent_peer", ["EP rank 1: gave no counts for exchange 2 within 0.5 s"] * 2),
    ("silent_leader", ["EP rank 1: gave no counts for exchange 3 within 0.5 s",
                       f"no answer from the compiled graph within {2 * 0.5 + GRACE_S:.0f} s"]),
    ("injected_failure", ["EP rank 1: injected failure of graph step for exchange 1"] * 2)])
def test_failed_graph_step_falls_back_without_losing_it(job_results, case, causes):
    expected = [_expected(s) for s in range(EXCHANGES)]
    for rank, res in job_results.items():
        r = res[case]
        assert r["counts"] == expected, (rank, r["reason"])  # the failed exchange and every later one
        assert r["kind"] == "compiled_graph" and r["fallen_back"] is True, rank
        assert r["reason"] == causes[rank], (rank, r["reason"])
        assert len(r["warnings"]) == 1 and "using the all-gather from now on" in r["warnings"][0], r["warnings"]


def test_outside_an_actor_the_graph_falls_back_with_one_warning(tmp_path, caplog):
    import torch.distributed as dist

    from tessera.train.dbo.graph import graph_support
    from tessera.train.dbo.factory import make_transport
    from tessera.train.dbo.transport import AllGatherTransport

    assert graph_support() is not None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            t = make_transport("compiled_graph")
        assert isinstance(t, AllGatherTransport)
        assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
            f"token counts: the compiled-graph transport is unavailable (EP rank 0: {graph_support()}); "
            "using the all-gather"]
        assert t.exchange(np.array([3, 0, 5])).tolist() == [[3, 0, 5]]
        with pytest.raises(ValueError, match="must be >= 0"):
            t.exchange(np.array([1, -1]))
        with pytest.raises(ValueError, match="dbo.transport='fast'"):
            make_transport("fast")
        t.close()
    finally:
        dist.destroy_process_group()


def test_graph_decisions_and_slots():
    """What every peer decides from the same rows (no Ray), and the slot the training thread and
    the graph's thread share: complete, a failed peer, out of step, ragged lengths; results do
    not share buffers with the rows; counts offered, taken, withdrawn, timed out."""
    from tessera.train.dbo.graph import _consume, _produce, close_slot, decide, open_slot, slot

    a, b = np.array([1, 2, 3]), np.array([4, 5, 6])
    seq, got, err = decide([(0, a, None), (0, b, None)])
    a[0] = 99
    assert (seq, got.tolist(), err) == (0, [[1, 2, 3], [4, 5, 6]], None)
    assert decide([(1, a, None), (1, None, "RuntimeError: x")]) == (1, None, "EP rank 1: RuntimeError: x")
    assert decide([(2, a, None), (3, b, None)]) == (2, None, "EP rank 1 sent exchange 3 while exchange 2 was open "
                                                             "(out of step)")
    assert decide([(4, a, None), (4, a[:1], None)]) == (4, None, "EP ranks passed counts of different lengths "
                                                                 "{0: 3, 1: 1} for exchange 4")
    own = open_slot("t")
    try:
        assert _produce(None, "t", 1, 0.05, (0, a, None)) == (0, None, "gave no counts for exchange 0 within 0.05 s")
        own.offer(1, b)
        assert own.retract(1) and not own.retract(1)  # withdrawn before the graph took it
        own.offer(1, a)  # stale: exchange 2 opens
        threading.Timer(0.05, own.offer, (2, b)).start()
        row = _produce(None, "t", 1, 30.0, (2, a, None))
        assert row[0] == 2 and row[1] is b and row[2] is None and not own.retract(2)
        assert _consume(None, "t", (2, a, None), row) == 2
        result, err = own.wait(2, 1.0)
        assert result.tolist() == [[99, 2, 3], [4, 5, 6]] and err is None
        assert own.wait(3, 0.01) is None
    finally:
        close_slot("t")
    assert slot("t") is None
