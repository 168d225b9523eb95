"""Rules of the job metrics (issue 9, items E3 and E8): exact values on constructed inputs, so a
missing dp factor, a bubble ratio over the wrong total or a fill rate that is always 0 fails."""

from __future__ import annotations

import math

import pytest

from tessera.config.schema import ParallelConfig
from tessera.spec.model import DenseMLPSpec, LayerSpec, ModelSpec
from tessera.train.worker.metrics import aggregate, iteration_flops, summarize
from tessera.train.worker.step import StepMetrics

KW = dict(step=3, tokens=24 * 10, plan_version=1, data_position=48)


def test_iteration_flops_by_hand_include_every_replica():
    # one dense layer (plain 2-matrix MLP, no mixer): per token 3 x 2 x (h*ffn + ffn*h) for the
    # MLP and 3 x 2 x h*v for the output head; embedding, norms and loss count 0 model FLOPs
    h, v, ffn, seq = 8, 16, 4, 10
    model = ModelSpec("hand", h, v, (LayerSpec(0, None, DenseMLPSpec(ffn, gated=False)),))
    per_sequence = 6 * seq * (h * v + 2 * h * ffn)  # 11520
    p = ParallelConfig(dp=4, num_microbatches=3, micro_batch_size=2, seq_length=seq)
    assert iteration_flops(model, p) == per_sequence * 2 * 3 * 4 == 276480
    one = ParallelConfig(dp=1, num_microbatches=3, micro_batch_size=2, seq_length=seq)
    assert iteration_flops(model, one) == 69120


def _ranks():
    """Two pipeline ranks: rank 0 (no loss) waits 20 ms of 100 and fills 10 ms of slots; rank 1
    (the head) waits 30 ms of 80 and fills none."""
    return [StepMetrics(loss=None, wall_ms=100.0, idle_ms=20.0, slot_fill_ms=10.0, exposed_a2a_ms=4.0),
            StepMetrics(loss=2.5, wall_ms=80.0, idle_ms=30.0, slot_fill_ms=0.0, exposed_a2a_ms=7.0)]


def test_summarize_exact_values():
    it = summarize(_ranks(), flops=6e12, peak_flops=1e14, **KW)
    assert it.iteration_ms == 100.0 and it.loss == 2.5
    assert it.tokens_per_s == pytest.approx(240 / 0.1, rel=1e-12)
    assert it.mfu == pytest.approx(6e12 / (0.1 * 1e14), rel=1e-12)  # 0.6
    assert it.bubble_ratio == pytest.approx(50 / 180, rel=1e-12)  # summed waits over summed wall time
    assert it.bubble_fill_rate == pytest.approx(10 / 60, rel=1e-12)  # filled / (filled + still idle)
    assert it.exposed_a2a_ms == 7.0
    assert (it.step, it.tokens, it.plan_version, it.data_position, it.attempt) == (3, 240, 1, 48, 0)


def test_summarize_edge_cases():
    none = summarize([StepMetrics(loss=None, wall_ms=50.0)], flops=1.0, peak_flops=0.0, **KW)
    assert math.isnan(none.loss) and none.mfu == 0.0 and none.bubble_ratio == 0.0 and none.bubble_fill_rate == 0.0
    unmeasured = summarize([_ranks()[0], StepMetrics(loss=1.0, wall_ms=10.0)], flops=1.0, peak_flops=1.0, **KW)
    assert unmeasured.exposed_a2a_ms is None
    with pytest.raises(ValueError, match="at least one rank"):
        summarize([], flops=1.0, peak_flops=1.0, **KW)


def test_aggregate_on_one_process_uses_the_same_rules():
    local = StepMetrics(loss=1.25, wall_ms=200.0, idle_ms=30.0, slot_fill_ms=10.0)
    it = aggregate(local, flops=5e12, peak_flops=1e14, **KW)
    assert it.loss == 1.25 and it.iteration_ms == 200.0
    assert it.mfu == pytest.approx(5e12 / (0.2 * 1e14), rel=1e-12)  # 0.25
    assert it.bubble_ratio == pytest.approx(0.15, rel=1e-12)
    assert it.bubble_fill_rate == pytest.approx(0.25, rel=1e-12)
    assert it.exposed_a2a_ms is None
