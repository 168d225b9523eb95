"""The profile cache (tessera.cost.profile_cache): fingerprints, reuse, corruption, concurrent writers."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from dataclasses import replace

import pytest

from tessera.cost.profile_cache import (FINGERPRINT_FIELDS, Fingerprint, ProfileCache, ProfileCacheWarning,
                                        ProfileItem, make_fingerprint)

BASE = dict(device="cpu", device_count=4, ep=2, tp=1, gpus_per_node=4, dtype="float32",
            layers=[{"mixer": "deltanet", "mlp": "moe", "hidden": 64}], seq_length=64, micro_batch_size=2,
            nccl="none", versions={"torch": "2.13.0", "deepspeed": "0.18.0", "transformers": "5.0.0"})
CHANGED = {"device": "NVIDIA H200", "device_count": 8, "ep": 4, "tp": 2, "gpus_per_node": 8, "dtype": "bfloat16",
           "layers": [{"mixer": "attention", "mlp": "moe", "hidden": 64}], "seq_length": 128, "micro_batch_size": 1,
           "nccl": "2.27.3"}


def _fp(**over) -> Fingerprint:
    return make_fingerprint(**{**BASE, **over})


def _item(name: str, ms: float = 1.0) -> ProfileItem:
    return ProfileItem(name, ms, ms * 0.9, ms * 1.1, reps=5, warmup=2, measured=1.0)


def test_every_listed_field_changes_the_fingerprint():
    base = _fp()
    assert base.digest == _fp().digest  # deterministic
    covered = set()
    for field, value in CHANGED.items():
        assert _fp(**{field: value}).digest != base.digest, field
        covered.add(field)
    for pkg in ("torch", "deepspeed", "transformers"):
        v = {**BASE["versions"], pkg: "9.9"}
        assert _fp(versions=v).digest != base.digest, pkg
        covered.add(pkg)
    assert covered == set(FINGERPRINT_FIELDS)
    assert set(base.as_dict()) == set(FINGERPRINT_FIELDS)


def test_reuse_profiles_only_what_is_missing(tmp_path):
    cache = ProfileCache(tmp_path / "p.sqlite")
    fp = _fp()
    names = ["F.L0.mixer", "B.L0.mixer", "F.L0.expert"]
    assert cache.missing(fp, names) == names
    assert cache.status(fp).exists is False
    cache.put(fp, [_item("F.L0.mixer", 2.0), _item("B.L0.mixer", 3.0)])
    again = ProfileCache(tmp_path / "p.sqlite")  # a second run opens the same file
    assert again.missing(fp, names + ["F.L0.mixer"]) == ["F.L0.expert"]
    got = again.get(fp)
    assert got["B.L0.mixer"].median_ms == 3.0 and got["B.L0.mixer"].p75_ms == pytest.approx(3.3)
    assert again.get(_fp(seq_length=128)) == {}  # another fingerprint sees nothing
    st = again.status(fp)
    assert st.exists and st.items == 2 and not st.stale


def test_stale_mark_and_clear(tmp_path):
    cache = ProfileCache(tmp_path / "p.sqlite")
    fp = _fp()
    cache.put(fp, [_item("F.L0.mixer")])
    cache.mark_stale(fp, 0.14)
    st = cache.status(fp)
    assert st.stale and st.drift == pytest.approx(0.14)
    assert cache.get(fp)["F.L0.mixer"].median_ms == 1.0  # still readable
    cache.put(fp, [_item("F.L0.mixer", 1.2)])  # re-profiled
    assert not cache.status(fp).stale


@pytest.mark.parametrize("damage", ["garbage", "truncate", "foreign"])
def test_corrupted_cache_is_moved_aside_and_rebuilt(tmp_path, damage):
    path = tmp_path / "p.sqlite"
    cache = ProfileCache(path)
    cache.put(_fp(), [_item(f"F.L{i}.mixer") for i in range(200)])
    data = path.read_bytes()
    for side in ("p.sqlite-wal", "p.sqlite-shm"):
        (tmp_path / side).unlink(missing_ok=True)
    if damage == "garbage":
        path.write_bytes(b"this is not a database" * 100)
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 3])
    else:
        path.unlink()
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE other (x)")
        con.commit()
        con.close()
    with pytest.warns(ProfileCacheWarning, match="moved it to"):
        fresh = ProfileCache(path)
    assert fresh.get(_fp()) == {}
    fresh.put(_fp(), [_item("F.L0.mixer")])
    assert list(fresh.get(_fp())) == ["F.L0.mixer"]
    assert len(list(tmp_path.glob("p.sqlite.corrupt-*"))) >= 1  # the damaged file is kept


def _writer(path: str, worker: int, n: int) -> None:
    cache = ProfileCache(path)
    fp = _fp()
    for i in range(n):
        cache.put(fp, [_item(f"w{worker}.{i}", float(i)), _item("shared", float(worker))])


def test_concurrent_writers_do_not_corrupt(tmp_path):
    path = str(tmp_path / "p.sqlite")
    ProfileCache(path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    cache = ProfileCache(path)
    got = cache.get(_fp())
    assert len(got) == 4 * 25 + 1
    assert got["shared"].median_ms in (0.0, 1.0, 2.0, 3.0)
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()


def test_item_values_round_trip(tmp_path):
    cache = ProfileCache(tmp_path / "p.sqlite")
    it = replace(_item("pair:S0|S3"), median_ms=12.5, p25_ms=12.0, p75_ms=13.25, reps=7, warmup=3, measured=42.0)
    cache.put(_fp(), [it])
    assert cache.get(_fp())["pair:S0|S3"] == it


def test_a_stale_profile_is_retimed_whole(tmp_path):
    from pathlib import Path

    from tessera.config.load import load_recipe
    from tessera.train.profile.setup import prepare_profile

    tiny = str(Path(__file__).resolve().parent.parent / "recipes" / "tiny-qwen3-next.yaml")
    recipe = load_recipe(tiny, [f"logging.out_dir={tmp_path}", "planner.search_time_s=1"])
    setup = prepare_profile(recipe)
    assert setup.missing == setup.needed and str(tmp_path) in setup.cache_path
    cache = ProfileCache(setup.cache_path)
    cache.put(setup.fingerprint, [_item(n) for n in setup.needed])
    assert prepare_profile(recipe).missing == ()
    cache.mark_stale(setup.fingerprint, 0.3)
    assert prepare_profile(recipe).missing == setup.needed  # `tessera profile` re-times it all
    cache.put(setup.fingerprint, [_item(n, 2.0) for n in setup.needed])  # ... and the new items clear the mark
    assert prepare_profile(recipe).missing == () and not cache.status(setup.fingerprint).stale


def test_reading_an_absent_cache_creates_nothing(tmp_path):
    """Reads of a cache that does not exist answer "no profile" and leave no file or directory
    behind; the first write makes both."""
    path = tmp_path / "sub" / "profiles.sqlite"
    cache = ProfileCache(path)
    assert cache.get(_fp()) == {} and cache.missing(_fp(), ["a"]) == ["a"] and not cache.status(_fp()).exists
    cache.mark_stale(_fp(), 0.5)
    assert not path.exists() and not path.parent.exists()
    assert cache.put(_fp(), [_item("a", 2.0)]) == 1
    assert path.exists() and ProfileCache(path).get(_fp())["a"].median_ms == 2.0
