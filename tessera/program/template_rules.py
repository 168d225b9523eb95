"""Stage placements and shape rules of the pipeline templates (used by the registry of
:mod:`tessera.program.templates`, which documents each template)."""

from __future__ import annotations

from tessera.errors import TesseraConfigError
from tessera.program.template_steps import (_Step, _dualpipe_v_steps, _one_f_one_b_steps, _zb_h1_steps,
                                            _zb_v_steps)


def _chunk_major(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def _chunk_major_owner(stage: int, pp: int) -> tuple[int, int]:
    return stage % pp, stage // pp


def _v_placement(rank: int, chunk: int, pp: int) -> int:
    return rank if chunk == 0 else 2 * pp - 1 - rank


def _v_owner(stage: int, pp: int) -> tuple[int, int]:
    return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)


def _one_f_one_b_rules(pp: int, vpp: int, m: int) -> None:
    if vpp != 1:
        raise TesseraConfigError("parallel.vpp", vpp, "template 1f1b runs one model chunk per rank (vpp must be 1)",
                                 "set parallel.vpp=1 or planner.template=interleaved-1f1b")


def _interleaved_rules(pp: int, vpp: int, m: int) -> None:
    if vpp > 1 and m < pp:
        raise TesseraConfigError("parallel.num_microbatches", m,
                                 f"interleaving needs num_microbatches >= pp; {m} < {pp}",
                                 f"set parallel.num_microbatches >= {pp} or parallel.vpp=1")


def _dualpipe_v_rules(pp: int, vpp: int, m: int) -> None:
    if vpp != 2:
        raise TesseraConfigError("parallel.vpp", vpp, "template dualpipe-v places exactly two chunks per rank in a V "
                                 f"(vpp must be 2, got {vpp})", "set parallel.vpp=2")
    if m < 2 * pp:
        raise TesseraConfigError("parallel.num_microbatches", m,
                                 f"dualpipe-v needs num_microbatches >= 2*pp; {m} < {2 * pp}",
                                 f"set parallel.num_microbatches >= {2 * pp} or use another template")


def _zb_h1_rules(pp: int, vpp: int, m: int) -> None:
    if vpp != 1:
        raise TesseraConfigError("parallel.vpp", vpp, "template zb-h1 runs one model chunk per rank (vpp must be 1)",
                                 "set parallel.vpp=1 or planner.template=zb-v (vpp=2)")


def _zb_v_rules(pp: int, vpp: int, m: int) -> None:
    if vpp != 2:
        raise TesseraConfigError("parallel.vpp", vpp, "template zb-v places exactly two chunks per rank in a V "
                                 f"(vpp must be 2, got {vpp})", "set parallel.vpp=2")
    if m < 2 * pp - 1:
        raise TesseraConfigError("parallel.num_microbatches", m,
                                 f"zb-v needs num_microbatches >= 2*pp-1 (rank 0's warm-up forwards); "
                                 f"{m} < {2 * pp - 1}",
                                 f"set parallel.num_microbatches >= {2 * pp - 1} or use another template")


def _one_f_one_b_builder(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    return _one_f_one_b_steps(pp, m, rank, overlap, split)


def _dualpipe_v_builder(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    return _dualpipe_v_steps(pp, m, rank)  # FB -> F, B and W splits are applied by _materialise


def _zb_h1_builder(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    return _zb_h1_steps(pp, m, rank, overlap)  # split_w=False is rejected by compute_schedule


def _zb_v_builder(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    return _zb_v_steps(pp, m, rank, overlap)


