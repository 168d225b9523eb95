"""Training data: embedded corpus, determinism, replica sharding, position restore, file sources."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.config.load import load_recipe
from tessera.errors import TesseraConfigError
from tessera.train.worker.data import DataShard, ShardSpec, TokenSequences, load_corpus, shard_for

SPEC = ShardSpec(dp=2, num_microbatches=4, micro_batch_size=2, seed=0)


def _seqs(n_bytes: int = 4000, seq_length: int = 16) -> TokenSequences:
    data = bytes((7 * i + i // 13) % 256 for i in range(n_bytes))
    return TokenSequences(torch.frombuffer(bytearray(data), dtype=torch.uint8), seq_length)


def test_embedded_corpus_is_pydoc_topics_joined_in_key_order():
    from pydoc_data.topics import topics

    data = load_corpus("pydoc")
    assert data == "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    assert len(data) > 100_000
    seqs = TokenSequences.from_source("pydoc", 64)
    assert seqs.num_sequences == (len(data) - 1) // 64
    s = seqs.sequence(3)
    assert s.dtype == torch.int64 and s.shape == (65,) and int(s.max()) < 256
    assert bytes(s.tolist()) == data[3 * 64:3 * 64 + 65]


def test_batches_are_deterministic_and_shaped():
    recipe = load_recipe(None)
    a, b = shard_for(recipe, 0), shard_for(recipe, 0)
    p = recipe.parallel
    for _ in range(3):
        x, y = a.next_batch(), b.next_batch()
        assert x.shape == (p.num_microbatches, p.micro_batch_size, p.seq_length + 1)
        assert torch.equal(x, y)
    other_seed = shard_for(recipe.with_overrides(["train.seed=1"]), 0)
    assert not torch.equal(shard_for(recipe, 0).next_batch(), other_seed.next_batch())


def test_replica_shards_are_disjoint_and_cover_each_epoch():
    seqs = _seqs()
    n = seqs.num_sequences
    shards = [DataShard(seqs, SPEC, d) for d in range(SPEC.dp)]
    seen: list[int] = []
    iterations = n // SPEC.global_batch
    for it in range(iterations):
        per = [s.indices_at(it * SPEC.global_batch) for s in shards]
        assert not set(per[0]) & set(per[1])
        seen += per[0] + per[1]
    assert len(seen) == len(set(seen)) == iterations * SPEC.global_batch
    # the full epoch (positions 0..n-1) is a permutation of all sequences
    assert sorted(shards[0].sequence_index(p) for p in range(n)) == list(range(n))
    # the next epoch is another permutation
    assert [shards[0].sequence_index(p) for p in range(n, 2 * n)] != [shards[0].sequence_index(p) for p in range(n)]


def test_batch_rows_are_the_indexed_sequences():
    seqs = _seqs()
    shard = DataShard(seqs, SPEC, replica=1)
    idx = shard.indices_at(0)
    batch = shard.next_batch().reshape(-1, seqs.seq_length + 1)
    assert torch.equal(batch, torch.stack([seqs.sequence(i) for i in idx]))
    assert shard.position == SPEC.global_batch


def test_position_restore_continues_the_same_stream():
    seqs = _seqs()
    ref = DataShard(seqs, SPEC, replica=0)
    batches = [ref.next_batch() for _ in range(5)]
    saved = None
    run = DataShard(seqs, SPEC, replica=0)
    for k in range(2):
        assert torch.equal(run.next_batch(), batches[k])
    saved = run.state_dict()
    assert saved == {"position": 2 * SPEC.global_batch}
    resumed = DataShard(seqs, SPEC, replica=0)
    resumed.load_state_dict(saved)
    for k in range(2, 5):
        assert torch.equal(resumed.next_batch(), batches[k])
    with pytest.raises(ValueError, match="multiple of the global batch"):
        resumed.load_state_dict({"position": 3})


def test_text_and_jsonl_sources(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world " * 50)
    assert load_corpus(str(txt)) == ("hello world " * 50).encode()
    jl = tmp_path / "b.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in ("first doc", "second doc")) + "\n")
    assert load_corpus(str(jl)) == b"first doc\n\nsecond doc"
    recipe = load_recipe(None, [f"train.data={txt}", "parallel.seq_length=8"])
    assert shard_for(recipe, 1).next_batch().shape == (4, 2, 9)
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(TesseraConfigError, match="line 1"):
        load_corpus(str(bad))
    with pytest.raises(TesseraConfigError, match="pydoc"):
        load_corpus(str(tmp_path / "missing.txt"))
    short = tmp_path / "s.txt"
    short.write_text("abc")
    with pytest.raises(TesseraConfigError, match="shorter than one sequence"):
        TokenSequences.from_source(str(short), 64)
