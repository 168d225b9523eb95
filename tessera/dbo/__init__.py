"""The dynamic bubble optimizer's shared logic (docs/dbo.md): token-count sources
(:mod:`~tessera.dbo.counts`), slot prediction (:mod:`~tessera.dbo.predict`), the choice rule
(:mod:`~tessera.dbo.choice`), layer-level W units (:mod:`~tessera.dbo.units`) and the EP group's
joint choice (:mod:`~tessera.dbo.joint`). The engine (:mod:`tessera.engine.dbo`) and the simulator
(:mod:`tessera.sim.dbo`) both run it; the slot annotations are :mod:`tessera.program.slots`."""

from tessera.dbo.choice import SlotChoice, choose, over_cap
from tessera.dbo.counts import (TokenCounts, counts_for_skew, recorded_counts, skew_max_over_mean, skewed_counts,
                                uniform_counts)
from tessera.dbo.joint import JointPool
from tessera.dbo.predict import RankTable, SlotPrediction, WTask, moe_layers, rank_tables
from tessera.dbo.units import UnitTable, WUnit, unit_table

__all__ = ["SlotChoice", "choose", "over_cap", "TokenCounts", "counts_for_skew", "recorded_counts",
           "skew_max_over_mean", "skewed_counts", "uniform_counts", "RankTable", "SlotPrediction", "WTask",
           "moe_layers", "rank_tables", "JointPool", "UnitTable", "WUnit", "unit_table"]
