"""Rules of checkpoint clean-up (issue 9, item D): ``cleanup_partial`` reports only directories it
really deleted, and raises, naming the path and the reason, when one cannot be deleted.

We run as root, so permission bits cannot make a deletion fail; a partial checkpoint whose
``step_*`` entry is a symbolic link to a directory is a real failure (``shutil.rmtree`` refuses
symbolic links, as root too) — what a run directory whose checkpoints were linked in from other
storage looks like.
"""

from __future__ import annotations

import os

import pytest
import torch

from tessera.train.worker import checkpoint as ckpt


def _complete(path, step: int) -> None:
    ckpt.write_part(str(path), rank=0, world_size=1, layout=(1, 1, 1), step=step, plan_version=0,
                    data_position=0, state={"w": torch.ones(2)})


def _partial(path) -> None:
    os.makedirs(path)
    (path / ckpt.part_name(0)).write_bytes(b"half a part, no marker")


def test_cleanup_reports_exactly_what_it_deleted(tmp_path):
    run = tmp_path / "run"
    _complete(run / ckpt.dir_name(4), 4)
    _partial(run / ckpt.dir_name(8))
    _partial(run / ckpt.dir_name(12))
    removed = ckpt.cleanup_partial(str(run))
    assert sorted(os.path.basename(p) for p in removed) == [ckpt.dir_name(8), ckpt.dir_name(12)]
    assert sorted(os.listdir(run)) == [ckpt.dir_name(4)]
    assert ckpt.cleanup_partial(str(run)) == []  # nothing left to delete


def test_cleanup_raises_with_path_and_reason_when_a_deletion_fails(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _complete(run / ckpt.dir_name(4), 4)
    _partial(run / ckpt.dir_name(8))
    _partial(elsewhere)
    os.symlink(elsewhere, run / ckpt.dir_name(12), target_is_directory=True)
    with pytest.raises(ckpt.CheckpointCleanupError) as e:
        ckpt.cleanup_partial(str(run))
    err = e.value
    assert err.path == str(run / ckpt.dir_name(12))
    assert "Cannot call rmtree on a symbolic link" in err.reason
    assert str(err).startswith(f"cannot delete partial checkpoint {run / ckpt.dir_name(12)}: OSError: ")
    assert "\n" not in str(err)
    assert [os.path.basename(p) for p in err.removed] == [ckpt.dir_name(8)]  # the others were still deleted
    assert sorted(os.listdir(run)) == [ckpt.dir_name(4), ckpt.dir_name(12)]
    assert os.listdir(elsewhere) == [ckpt.part_name(0)]  # nothing deleted through the link


def test_a_checkpoint_deleted_while_it_is_read_does_not_count(tmp_path, monkeypatch):
    """Ray Train deletes checkpoints beyond ``job.num_to_keep`` while the driver or a watcher may
    be reading them: one that vanishes between the listing and the reading of its parts is not
    complete (no FileNotFoundError), and the newest that stays is found."""
    import shutil

    run = tmp_path / "run"
    _complete(run / ckpt.dir_name(2), 2)
    _complete(run / ckpt.dir_name(4), 4)
    digest = ckpt._digest

    def deleted_first(path):  # the retention deletes step 4 just as its part is hashed
        if ckpt.dir_name(4) in str(path):
            shutil.rmtree(run / ckpt.dir_name(4))
        return digest(path)

    monkeypatch.setattr(ckpt, "_digest", deleted_first)
    assert ckpt.check_complete(str(run / ckpt.dir_name(4))) is None
    assert ckpt.latest_complete(str(run)).step == 2
