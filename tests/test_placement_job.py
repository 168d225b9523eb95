"""The node check of a running job on local gloo ranks: workers whose nodes interleave are mapped to
the planned placement and train as workers that came node by node.

The tiny recipe (pp=2 x dp=2, ep=2: 4 ranks) on 2-GPU nodes (``hardware.inline.gpus_per_node=2``:
rank order ``ep-dp-pp``, each EP group inside a node, the pipeline across nodes), cut to 4 layers,
32-token sequences and 2 steps, runs twice through the job's worker loop
(tests/local_job.py, the driver's :meth:`~tessera.train.job.driver.Driver.place_ranks` answered
by :func:`tessera.spec.placement.check_nodes` on the planned placement): once with the ranks' nodes
``a a b b`` (as Ray Train numbers them: as planned, nothing mapped) and once ``a b a b`` (a launcher
that deals ranks round-robin: slots mapped to ranks ``0 2 1 3``, so each EP group is again one
node's two ranks). Both runs give the same losses and bitwise the same checkpoint, part by part
(parts are numbered by replica and pipeline rank, not world rank). The same check on a real
multi-node Ray cluster: tests/test_multinode.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.config.load import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
STEPS = 2
CUT = ("hardware.inline.gpus_per_node=2", "model.num_layers=4", "parallel.seq_length=32", "planner.overlap=false",
       "planner.split_w=false", f"train.steps={STEPS}", f"train.checkpoint_every={STEPS}",
       "logging.wandb_mode=disabled")


def _run(tmp_path: Path, name: str, node_ids: list[str]):
    from local_job import run_local_job
    from tessera.train.job.driver import Driver

    recipe = load_recipe(TINY, [*CUT, f"logging.out_dir={tmp_path}", f"job.run_name={name}"])
    run_dir = str(tmp_path / name)
    out: list[dict] = []
    rows = run_local_job(recipe, run_dir, Driver(recipe.to_dict(), run_dir, name), node_ids=node_ids, out=out)
    return rows, out, run_dir


def test_interleaved_nodes_are_remapped_and_train_as_the_planned_order(tmp_path):
    from tessera.spec.placement import place
    from tessera.train.worker import checkpoint as ckpt

    planned = place(2, 2, 2, 2).to_dict()
    same_rows, same, same_dir = _run(tmp_path, "grouped", ["a", "a", "b", "b"])
    mixed_rows, mixed, mixed_dir = _run(tmp_path, "interleaved", ["a", "b", "a", "b"])

    for placed in (r["placed"] for r in same):  # every rank got the driver's same answer
        assert (placed["remapped"], placed["ranks"], placed["nodes"]) == (False, [], [0, 0, 1, 1])
        assert placed["placement"] == planned
    for placed in (r["placed"] for r in mixed):
        assert (placed["remapped"], placed["ranks"], placed["nodes"]) == (True, [0, 2, 1, 3], [0, 1, 0, 1])
        assert placed["placement"] == planned  # mapped: each EP group on one node, the pipeline across
    # position (replica * pp + pipeline rank) of each world rank: ranks 0 and 2 share node a, so
    # they hold stage 0 of replicas 0 and 1 (one EP group) in the mapped run
    assert [r["slot"] for r in same] == [0, 2, 1, 3]
    assert [r["slot"] for r in mixed] == [0, 1, 2, 3]

    assert [r["step"] for r in same_rows] == [r["step"] for r in mixed_rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in mixed_rows] == [r["loss"] for r in same_rows]
    a, b = ckpt.latest_complete(same_dir), ckpt.latest_complete(mixed_dir)
    assert a.step == b.step == STEPS
    for part in range(4):
        x, y = ckpt.load_part(a.path, part)["state"], ckpt.load_part(b.path, part)["state"]
        assert x["param_names"] == y["param_names"]
        for mx, my in zip(x["modules"], y["modules"]):
            assert mx.keys() == my.keys() and all(torch.equal(mx[k], my[k]) for k in mx), part
