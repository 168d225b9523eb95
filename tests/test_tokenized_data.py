"""Tokenized training data: ``train.tokenizer``, text / JSONL / Parquet corpora, the token cache,
every data error as one line, and a tokenizer-backed run that trains and exports its tokenizer.

The tokenizers are small BPEs trained here with the ``tokenizers`` library (nothing is
downloaded); the expected token ids come from ``tokenizers.Tokenizer.from_file`` on the same file,
not from the code under test.
"""

from __future__ import annotations

import json
import multiprocessing
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tessera.config.load import load_recipe
from tessera.errors import TesseraConfigError
from tessera.train.worker.corpus import open_token_file
from tessera.train.worker.data import DataShard, ShardSpec, TokenSequences, shard_for

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "tessera trains mixture of experts models on pipelines of ranks",
    "a tokenizer turns text into token ids and back into text",
    "every replica reads its own block of sequences in each iteration",
    "the data position is the only state of the stream",
]


def _bpe(path, vocab: int = 160, added: int = 0, special=("<unk>", "</s>")) -> str:
    """A BPE tokenizer trained on :data:`SENTENCES` (whitespace pre-tokenizer), saved as ``path``;
    ``added`` extra tokens take its ids past ``vocab``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(special),
                                                                   show_progress=False))
    if added:
        tok.add_tokens([f"extra{i}" for i in range(added)])
    tok.save(str(path))
    return str(path)


def _ids(tok_path: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tok_path).encode(text).ids


def _corpus(tmp_path, n: int = 6) -> tuple[list[str], list[str]]:
    """A .txt, a .jsonl and a .parquet file; returns (paths, their non-empty documents in order)."""
    docs = [" ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(3)) for i in range(3 * n)]
    txt = tmp_path / "a.txt"
    txt.write_text(docs[0] + "\n" + docs[1])
    jl = tmp_path / "b.jsonl"
    rows = [{"text": d, "id": i} for i, d in enumerate(docs[2:n + 2])]
    rows.insert(1, {"text": ""})  # an empty document: skipped
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a blank line: skipped
    pqf = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs[n + 2:], "n": list(range(len(docs) - n - 2))}), str(pqf))
    return [str(txt), str(jl), str(pqf)], [docs[0] + "\n" + docs[1], *docs[2:]]


def _recipe(tmp_path, data, tok, *extra):
    data = "[" + ",".join(data) + "]" if isinstance(data, list) else data
    return load_recipe(None, [f"train.data={data}", f"train.tokenizer={tok}", f"logging.out_dir={tmp_path / 'out'}",
                              "parallel.seq_length=8", *extra])


def test_token_file_is_the_tokenizers_encoding_joined_with_eos(tmp_path):
    tok = _bpe(tmp_path / "tok.json")
    files, docs = _corpus(tmp_path)
    recipe = _recipe(tmp_path, files, tok)
    got = open_token_file(recipe)
    eos = _ids(tok, "</s>")
    assert len(eos) == 1
    want: list[int] = []
    for d in docs:
        want += (eos if want else []) + _ids(tok, d)
    tokens = got.array()
    assert got.built and got.dtype == "uint16" and tokens.dtype == np.uint16
    assert tokens.tolist() == want and got.num_tokens == len(want)
    index = json.loads(open(got.index_path).read())
    assert index["separator"] == eos and index["num_tokens"] == len(want)
    assert [(s["path"], s["documents"]) for s in index["sources"]] == [(files[0], 1), (files[1], 7), (files[2], 10)]
    assert [s["size"] for s in index["inputs"]["sources"]] == [os.path.getsize(f) for f in files]
    # the sequences the workers read are windows of that stream, int64, seq_length + 1 long
    seqs = TokenSequences.from_recipe(recipe)
    assert seqs.num_sequences == (len(want) - 1) // 8
    assert seqs.sequence(3).tolist() == want[24:33] and seqs.sequence(3).dtype == torch.int64
    # a glob matching the same files (in sorted order) is the same corpus: the same entry, not encoded again
    globbed = open_token_file(_recipe(tmp_path, str(tmp_path / "[abc].*"), tok))
    assert globbed.bin_path == got.bin_path and not globbed.built


def test_without_eos_documents_are_joined_with_a_blank_lines_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "\n": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    path = str(tmp_path / "word.json")
    tok.save(path)
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert open_token_file(_recipe(tmp_path, str(jl), path)).array().tolist() == [1, 3, 3, 2]


def test_cache_is_built_once_and_rebuilt_when_a_source_or_the_tokenizer_changes(tmp_path):
    tok = _bpe(tmp_path / "tok.json")
    files, _ = _corpus(tmp_path)
    recipe = _recipe(tmp_path, files, tok)
    first = open_token_file(recipe)
    st = os.stat(first.bin_path)
    again = open_token_file(recipe)
    shard_for(recipe, 1)  # what a worker does: maps it
    st2 = os.stat(first.bin_path)
    assert first.built and not again.built
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert again.array().tolist() == first.array().tolist()
    with open(files[1], "a") as f:  # a changed source rebuilds
        f.write(json.dumps({"text": "the lazy dog"}) + "\n")
    changed = open_token_file(recipe)
    assert changed.built and changed.bin_path == first.bin_path and changed.num_tokens > first.num_tokens
    _bpe(tmp_path / "tok.json", vocab=120)  # another tokenizer content under the same path rebuilds
    retok = open_token_file(recipe)
    assert retok.built and retok.array().tolist() != changed.array().tolist()
    assert not open_token_file(recipe).built


def _open_built(recipe, queue) -> None:
    queue.put(open_token_file(recipe).built)


def test_two_processes_at_once_tokenize_the_corpus_once(tmp_path):
    """The build runs under a file lock: of two processes that open a missing entry together, one
    builds and the other maps what it built."""
    tok = _bpe(tmp_path / "tok.json")
    files, _ = _corpus(tmp_path, n=60)
    recipe = _recipe(tmp_path, files, tok)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_open_built, args=(recipe, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(queue.get(timeout=5) for _ in procs) == [False, True]


def test_replicas_read_disjoint_sequences_in_the_byte_paths_order(tmp_path):
    tok = _bpe(tmp_path / "tok.json")
    files, _ = _corpus(tmp_path, n=40)
    recipe = _recipe(tmp_path, files, tok, "parallel.dp=2", "parallel.num_microbatches=2",
                     "parallel.micro_batch_size=2", "train.seed=3")
    spec = ShardSpec(2, 2, 2, 3)
    tokens = open_token_file(recipe).array()
    shards = [shard_for(recipe, d) for d in range(2)]
    n = shards[0].sequences.num_sequences
    assert n == (len(tokens) - 1) // 8 >= 2 * spec.global_batch
    # the byte path's order on a corpus with as many sequences: the same indices
    byte_seqs = TokenSequences(torch.zeros(n * 8 + 1, dtype=torch.uint8), 8)
    for it in range(2):
        per = [s.indices_at(it * spec.global_batch) for s in shards]
        assert per == [DataShard(byte_seqs, spec, d).indices_at(it * spec.global_batch) for d in range(2)]
        assert not set(per[0]) & set(per[1])
        for d, s in enumerate(shards):
            rows = s.next_batch().reshape(-1, 9)
            assert rows.tolist() == [tokens[i * 8:i * 8 + 9].tolist() for i in per[d]]
    # resume: a shard restored at the saved position continues the same stream
    resumed = shard_for(recipe, 1)
    resumed.load_state_dict(shards[1].state_dict())
    assert torch.equal(resumed.next_batch(), shards[1].next_batch())


def test_tokenizer_rules(tmp_path):
    from tessera.flow import resolve
    from tessera.train.job.preflight import check_training_rules

    for bad in ("gpt2", str(tmp_path / "missing.json")):  # a Hub name is not a path: never downloaded
        with pytest.raises(TesseraConfigError) as e:
            resolve(_recipe(tmp_path, "pydoc", bad))
        assert str(e.value).startswith(f"train.tokenizer={bad!r}: is neither 'bytes' nor an existing tokenizer")
        assert "never from the Hugging Face Hub" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TesseraConfigError, match="is a directory without tokenizer.json"):
        resolve(_recipe(tmp_path, "pydoc", str(tmp_path / "empty")))
    # the vocabulary check, before Ray starts: a tokenizer with more ids than the model's 256 rows
    big = _bpe(tmp_path / "big.json", added=200)
    recipe = _recipe(tmp_path, "pydoc", big)
    res = resolve(recipe)
    with pytest.raises(TesseraConfigError) as e:
        check_training_rules(recipe, res.model)
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(big).get_vocab_size(with_added_tokens=True)
    assert n > 256 and str(e.value) == (
        f"model.vocab=256: is smaller than the {n} token ids of train.tokenizer={big!r} (token ids 0..{n - 1}): "
        f"every id needs an embedding row of tiny-qwen3-next; fix: train a model with a vocabulary of at least {n} "
        f"(model.hf_config with vocab_size >= {n}, or model.inline with vocab >= {n}), or a tokenizer of at most "
        "256 ids")
    small = _recipe(tmp_path, "pydoc", _bpe(tmp_path / "tok.json"))
    check_training_rules(small, resolve(small).model)  # fits: no error
    bad_json = tmp_path / "broken.json"
    bad_json.write_text("{not a tokenizer")
    with pytest.raises(TesseraConfigError, match=r"^train.tokenizer='.*broken.json': cannot be loaded as a tokenizer"):
        check_training_rules(_recipe(tmp_path, "pydoc", str(bad_json)), res.model)


def test_data_field_names_the_jsonl_field_and_the_parquet_column(tmp_path):
    tok = _bpe(tmp_path / "tok.json")
    jl, pqf = tmp_path / "f.jsonl", tmp_path / "f.parquet"
    jl.write_text(json.dumps({"body": SENTENCES[0], "text": 3}) + "\n")
    pq.write_table(pa.table({"body": [SENTENCES[1]]}), str(pqf))
    got = open_token_file(_recipe(tmp_path, [str(jl), str(pqf)], tok, "train.data_field=body")).array().tolist()
    assert got == _ids(tok, SENTENCES[0]) + _ids(tok, "</s>") + _ids(tok, SENTENCES[1])


def test_byte_level_reads_lists_globs_and_parquet_as_before(tmp_path):
    from tessera.train.worker.data import load_corpus

    files, docs = _corpus(tmp_path)
    want = b"\n\n".join(d.encode() for d in docs)  # a .txt file's bytes as they are, documents joined by blank lines
    assert load_corpus(files) == want == load_corpus(str(tmp_path / "[abc].*"))
    recipe = _recipe(tmp_path, files, "bytes")
    assert TokenSequences.from_recipe(recipe).sequence(2).tolist() == list(want[16:25])
    assert not (tmp_path / "out").exists()  # bytes need no token cache


def test_the_launcher_hands_workers_absolute_data_paths(tmp_path, monkeypatch):
    from tessera.train.worker.corpus import absolute_data_paths, absolute_plan_inputs

    monkeypatch.chdir(tmp_path)
    _bpe(tmp_path / "tok.json")
    recipe = load_recipe(None, ["train.data=[pydoc,a.jsonl,'s/*.parquet']", "train.tokenizer=tok.json"])
    got = absolute_data_paths(recipe, "/runs")
    assert got.train.data == ("pydoc", str(tmp_path / "a.jsonl"), str(tmp_path / "s" / "*.parquet"))
    assert (got.train.tokenizer, got.train.data_cache) == (str(tmp_path / "tok.json"), "/runs/data-cache")
    assert absolute_data_paths(got, "/elsewhere") is got  # already absolute: unchanged
    assert absolute_data_paths(load_recipe(None), "/runs").train.data == "pydoc"
    plain = absolute_data_paths(load_recipe(None), "/runs")  # unset inputs stay unset
    assert (plain.train.init_from, plain.planner.trace, plain.dbo.counts_path) == (None, "", "")
    # the other inputs a worker (init_from) or the driver actor (trace, recorded counts) reads
    relative = load_recipe(None, ["train.init_from=hf/model", "planner.trace=t.json", "dbo.counts_path=~/counts.json"])
    inputs = absolute_data_paths(relative, "/runs")
    assert (inputs.train.init_from, inputs.planner.trace, inputs.dbo.counts_path) == (
        str(tmp_path / "hf" / "model"), str(tmp_path / "t.json"), os.path.expanduser("~/counts.json"))
    driver = absolute_plan_inputs(relative)  # the driver's recipe (and upgrade --recipe's): its planning inputs
    assert (driver.planner.trace, driver.dbo.counts_path, driver.train.init_from) == (
        inputs.planner.trace, inputs.dbo.counts_path, "hf/model")
    assert absolute_plan_inputs(driver) is driver


def _error(recipe) -> str:
    from tessera.train.job.preflight import check_data

    with pytest.raises(TesseraConfigError) as e:
        check_data(recipe)
    msg = str(e.value)
    assert "\n" not in msg and "; fix: " in msg, msg
    return msg


def test_every_data_error_is_one_line_naming_file_row_and_fix(tmp_path):
    tok = _bpe(tmp_path / "tok.json")

    def write(name: str, text: str) -> str:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    def table(name: str, **cols) -> str:
        pq.write_table(pa.table(cols), str(tmp_path / name))
        return str(tmp_path / name)

    ok = json.dumps({"text": "the fox"})
    os.symlink("/proc/self/mem", tmp_path / "mem.txt")  # opens, but every read fails (EIO)
    cases = [
        (str(tmp_path / "mem.txt"), "cannot be read (OSError: Input/output error); fix: fix the file's permissions"),
        (write("j.jsonl", f"{ok}\n{{oops\n"), "line 2 is not JSON (Expecting property name enclosed in double "
                                              "quotes, column 2); fix: write one JSON object per line"),
        (write("k.jsonl", f"{ok}\n\n{json.dumps({'body': 'x'})}\n"), "line 3 has no \"text\" field (its keys: body); "
                                                                     "fix: give every row a string \"text\""),
        (write("l.jsonl", f"{json.dumps({'text': 7})}\n"), "line 1: \"text\" is a int, not a string; fix: "),
        (write("m.jsonl", "[1, 2]\n"), "line 1 is a JSON list, not an object"),
        (table("n.parquet", body=["x"]), "has no column \"text\" (its columns: body); fix: name the text column with "
                                         "train.data_field=NAME"),
        (table("o.parquet", text=["the fox", None]), "row 2: \"text\" is null, not a string"),
        (table("p.parquet", text=[1, 2]), "column \"text\" holds int64, not strings"),
        (write("q.parquet", "not parquet"), "cannot be read as Parquet"),
        (write("e.jsonl", json.dumps({"text": ""}) + "\n"), "holds no text (1 document(s) in 1 source(s), all empty)"),
        (str(tmp_path / "none-*.jsonl"), "matches no file"),
        (str(tmp_path), "is neither 'pydoc' nor an existing file (a directory)"),
        (write("r.csv", "a,b"), "has an unsupported suffix"),
    ]
    (tmp_path / "bad.txt").write_bytes(b"the fox\n\xff\xfe")
    cases.append((str(tmp_path / "bad.txt"), "line 2 is not UTF-8 text"))
    for path, needle in cases:
        msg = _error(_recipe(tmp_path, path, tok))
        assert msg.startswith(f"train.data={path!r}: ") and needle in msg, (path, msg)
    # a glob or a list names the file at fault, not the pattern
    msg = _error(_recipe(tmp_path, [write("fine.jsonl", ok + "\n"), str(tmp_path / "j.jsonl")], tok))
    assert msg.startswith(f"train.data={str(tmp_path / 'j.jsonl')!r}: line 2 is not JSON")
    # the byte-level path reads the same files with the same errors
    assert "line 3 has no \"text\" field" in _error(_recipe(tmp_path, str(tmp_path / "k.jsonl"), "bytes"))
    # too few tokens: for one global batch (pre-flight), for one sequence (the workers' reader)
    short = write("s.jsonl", json.dumps({"text": SENTENCES[0]}) + "\n")
    n = len(_ids(tok, SENTENCES[0]))
    msg = _error(_recipe(tmp_path, short, tok))
    assert f"holds {(n - 1) // 8} sequences of 9 tokens ({n} tokens), fewer than one global batch" in msg
    assert f"fix: use a corpus of at least {16 * 8 + 1} tokens" in msg
    with pytest.raises(TesseraConfigError) as e:
        TokenSequences.from_recipe(_recipe(tmp_path, short, tok, "parallel.seq_length=64"))
    assert str(e.value) == (f"train.data='{n} tokens': is shorter than one sequence of 65 tokens; fix: use a larger "
                            "corpus or a smaller parallel.seq_length")
    cache = tmp_path / "cache-file"
    cache.write_text("")
    with pytest.raises(TesseraConfigError, match=r"^train.data_cache='.*cache-file': cannot be written"):
        open_token_file(_recipe(tmp_path, short, tok, f"train.data_cache={cache}"))


# --------------------------------------------------------------------------- a run, then export


def test_tokenizer_run_trains_on_two_replicas_and_exports_its_tokenizer(tmp_path, capsys, monkeypatch):
    """Pre-flight encodes the corpus once; two data-parallel ranks (the worker loop on local gloo
    ranks, tests/local_job.py) map it and train 2 steps; ``tessera export`` writes the run's
    tokenizer, which ``AutoTokenizer`` loads offline with the ids training used."""
    import huggingface_hub.constants
    from transformers import AutoTokenizer

    from local_job import run_local_job
    from tessera.cli.main import main
    from tessera.train.job.driver import Driver
    from tessera.train.job.preflight import check_data, check_training_rules
    from tessera.flow import resolve
    from tessera.train.worker.tokenizer import save_run_tokenizer

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tok = _bpe(tmp_path / "tok.json")
    files, docs = _corpus(tmp_path, n=30)
    recipe = _recipe(tmp_path, files, tok, "parallel.pp=1", "parallel.vpp=1", "parallel.dp=2", "parallel.ep=1",
                     "planner.template=1f1b", "parallel.num_microbatches=1", "parallel.micro_batch_size=2",
                     "model.num_layers=2", "train.steps=2", "train.checkpoint_every=2", "logging.wandb_mode=disabled",
                     "planner.overlap=false", "planner.split_w=false")
    check_training_rules(recipe, resolve(recipe).model)
    assert check_data(recipe) > 0  # what tessera train's pre-flight does: the corpus is encoded here, once
    built = open_token_file(recipe)
    st = os.stat(built.bin_path)
    run_dir = str(tmp_path / "out" / "run")
    assert save_run_tokenizer(recipe, run_dir) == os.path.join(run_dir, "tokenizer")  # what run_job does
    rows = run_local_job(recipe, run_dir, Driver(recipe.to_dict(), run_dir, "run"))
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["loss"] < 10 for r in rows)
    st2 = os.stat(built.bin_path)
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)  # the ranks mapped it, none re-encoded
    out = tmp_path / "export"
    assert main(["export", run_dir, "--to", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("config.json, model.safetensors, tokenizer.json, "
                                                    "tokenizer_config.json)")
    exported = AutoTokenizer.from_pretrained(str(out))
    for text in (docs[0], SENTENCES[2]):
        assert exported(text)["input_ids"] == _ids(tok, text)
    assert exported.eos_token == "</s>" and exported.eos_token_id == _ids(tok, "</s>")[0]
    assert exported.model_max_length == resolve(recipe).model.max_positions
    # the first document as training saw it: the start of the token file
    first = exported(docs[0])["input_ids"]
    assert built.array()[:len(first)].tolist() == first
    # a resumed run that now trains on bytes keeps no tokenizer: its export is the byte-level one
    assert save_run_tokenizer(recipe.with_overrides(["train.tokenizer=bytes"]), run_dir) is None
    assert not os.path.exists(os.path.join(run_dir, "tokenizer"))
