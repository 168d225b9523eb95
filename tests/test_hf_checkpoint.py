"""Hugging Face checkpoints (``train.init_from``, ``tessera export``; tessera.model.hf, tessera.train.worker.hf_io).

Qwen3-Next first (the sections below it: DeepSeek-V3, Nemotron-H and Qwen3-MoE). A random tiny Qwen3-Next is built with transformers from the tiny-qwen3-next preset's config
(``qwen3_next_config``; nothing is downloaded) and saved with ``save_pretrained``. It is loaded
into Tessera stages at two partitions (pp=1: one stage; pp=2/vpp=2: four chunks on two ranks,
each rank reading only its own tensors; and EP = 2 on two gloo ranks, each reading its own
experts) and every parameter is compared bitwise with the file.
Exported back (from named state, and with ``tessera export`` from a real one-rank run's
checkpoint written by the worker loop's own checkpoint code), transformers loads the directory
and its logits equal Tessera's on a fixed batch, and ``AutoTokenizer`` loads the exported byte-level
tokenizer offline with the ids of Tessera's data pipeline; a (pp, dp, ep) = (2, 2, 2) checkpoint exports
every expert at its global id.

Logits tolerance: fp32, ``atol=1e-5`` (measured: about 2e-7). The modules are the same
transformers classes on both sides, but the MoE is computed in another order: Tessera routes with
DeepSpeed's ``topkgating`` (softmax, top-k, renormalise by the clamped sum) and adds expert
outputs through its dispatch/combine index_add, transformers with its own router and per-expert
loop; the gates agree to rounding, not bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.config.load import load_recipe
from tessera.errors import TesseraConfigError
from tessera.model.hf import check_supported, config_mismatch, hf_config, hf_name, qwen3_next_config, stage_params
from tessera.model.stage import StageModule
from tessera.spec.model import MoESpec
from tessera.spec.presets import get_model
from tessera.train.worker import checkpoint as ckpt
from tessera.train.worker.data import TokenSequences
from tessera.train.worker.hf_io import export_state, hf_state, load_into_stages
from tessera.train.upgrade.reshard import named_state

pytestmark = pytest.mark.xdist_group("hf_checkpoint")  # module fixtures built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
ONE_RANK = ["parallel.pp=1", "parallel.vpp=1", "parallel.dp=1", "parallel.ep=1", "planner.template=1f1b",
            "parallel.num_microbatches=1", "parallel.micro_batch_size=2", "parallel.seq_length=16"]
ATOL = 1e-5
PP1 = [[(-1, 9)]]
PP2_VPP2 = [[(-1, 2), (4, 6)], [(2, 4), (6, 9)]]  # per rank: its chunks (extended indices, head = 8)


def hf_model(model, seed=0):
    """A random transformers model of ``model``'s family (``hf_config``); norms and Mamba /
    DeltaNet ``dt_bias`` moved off their constant init so that a wrong map shows, and the sigmoid
    routers' ``e_score_correction_bias`` (zero at init) set to N(0, 0.05): about the spread of the
    affinities, so it changes which experts are chosen (asserted where used)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config(model)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or "dt_bias" in n:
                p.add_(0.1 * torch.randn_like(p))
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return hf


@pytest.fixture(scope="module")
def tiny():
    return get_model("tiny-qwen3-next")


@pytest.fixture(scope="module")
def hf_dir(tiny, tmp_path_factory):
    hf = hf_model(tiny)
    path = tmp_path_factory.mktemp("hf") / "tiny"
    hf.save_pretrained(path)
    return hf, str(path)


def batch():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))


def tessera_logits(stages, ids):
    """Logits ``[B, S, V]`` of stages covering the whole model, in layer order."""
    stages = sorted(stages, key=lambda s: s.start)
    with torch.no_grad():
        x = stages[0].embed(ids)
        for s in stages:
            for layer in s.layers:
                x = layer(x)
        return stages[-1].head.logits(x)


def hf_logits(path_or_model, ids):
    from transformers import AutoModelForCausalLM

    m = path_or_model
    if isinstance(m, str):
        m = AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits, m


@pytest.mark.parametrize("partition", [PP1, PP2_VPP2], ids=["pp1", "pp2-vpp2"])
def test_init_from_loads_every_parameter_at_any_partition(tiny, hf_dir, partition):
    hf, path = hf_dir
    on_disk = load_file(os.path.join(path, "model.safetensors"))
    loaded = set()
    ranks = []
    for chunks in partition:  # one rank at a time: each builds and loads only its chunks
        stages = [StageModule(tiny, c, seed=3) for c in chunks]
        before = {n: p.clone() for s in stages for n, p in stage_params(s).items()}
        n = load_into_stages(path, stages, tiny)
        mine = {n: p for s in stages for n, p in stage_params(s).items()}
        assert n == len(mine) and not loaded & set(mine)
        for name, p in mine.items():
            assert torch.equal(p, on_disk[name]), name
        assert any(not torch.equal(before[k], mine[k]) for k in mine)  # the seeded init was replaced
        loaded |= set(mine)
        ranks.append(stages)
    assert loaded == set(on_disk)  # together the ranks hold every tensor of the file
    ids = batch()
    ours = tessera_logits([s for r in ranks for s in r], ids)
    theirs, _ = hf_logits(hf, ids)
    assert torch.allclose(ours, theirs, rtol=0, atol=ATOL), (ours - theirs).abs().max()


def test_stacked_expert_files_load_the_same(tiny, hf_dir, tmp_path):
    """transformers 5's in-memory layout (``experts.gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``) written as is: each expert's rows are sliced out of the stacked tensors."""
    hf, path = hf_dir
    sd = hf.state_dict()
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 64)
    (tmp_path / "config.json").write_text(Path(path, "config.json").read_text())
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    stage = StageModule(tiny, (3, 5))
    load_into_stages(str(tmp_path), [stage], tiny)
    per_expert = load_file(os.path.join(path, "model.safetensors"))
    for name, p in stage_params(stage).items():
        assert torch.equal(p, per_expert[name]), name


def test_export_gives_transformers_the_same_logits(tiny, hf_dir, tmp_path):
    hf, path = hf_dir
    stages = [StageModule(tiny, c) for c in PP2_VPP2[0] + PP2_VPP2[1]]
    for s in stages:
        load_into_stages(path, [s], tiny)
    with torch.no_grad():  # move off the loaded values: the export must carry the stages' own weights
        for s in stages:
            for p in s.parameters():
                p.add_(0.01 * torch.randn_like(p))
    named = {n: e["param"] for n, e in named_state(stages, None).items()}
    files = export_state(hf_state(named, tiny), tiny, str(tmp_path / "out"))
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["norm_topk_prob"], config["rms_norm_eps"]) == (
        "qwen3_next", ["Qwen3NextForCausalLM"], True, 1e-6)
    ids = batch()
    ours = tessera_logits(stages, ids)
    theirs, m = hf_logits(str(tmp_path / "out"), ids)
    assert type(m).__name__ == "Qwen3NextForCausalLM"
    assert torch.allclose(ours, theirs, rtol=0, atol=ATOL), (ours - theirs).abs().max()
    assert not torch.allclose(ours, hf_logits(hf, ids)[0], atol=1e-3)  # not the original weights


def test_expert_names_follow_the_ep_offset():
    assert hf_name("layers.3.moe.experts.1.up_proj.weight", "attention", 4) == \
        "model.layers.3.mlp.experts.5.up_proj.weight"
    assert hf_name("layers.2.attn.A_log", "deltanet") == "model.layers.2.linear_attn.A_log"
    assert hf_name("layers.3.attn.q_norm.weight", "attention") == "model.layers.3.self_attn.q_norm.weight"
    assert hf_name("layers.0.moe.gate.wg.weight", "deltanet") == "model.layers.0.mlp.gate.weight"
    with pytest.raises(KeyError, match="no Hugging Face Qwen3-Next name"):
        hf_name("layers.0.attn.kv_a_proj.weight", "mla")


def test_init_from_errors_are_one_line(tiny, hf_dir, tmp_path):
    _, path = hf_dir
    with pytest.raises(TesseraConfigError) as e:  # the recipe rule, before anything starts
        _validate(load_recipe(TINY, [f"train.init_from={tmp_path}"]))
    assert str(e.value) == (f"train.init_from={str(tmp_path)!r}: must hold config.json and *.safetensors files "
                            "(missing: config.json, *.safetensors); fix: point it at a Hugging Face model directory "
                            "(save_pretrained output: config.json + model*.safetensors), or null for seeded weights")
    with pytest.raises(TesseraConfigError, match=r"^train.init_from='/nonexistent/x': must be a directory; fix: "):
        _validate(load_recipe(TINY, ["train.init_from=/nonexistent/x"]))
    _validate(load_recipe(TINY, [f"train.init_from={path}"]))  # a good directory passes
    # a tensor missing / one too many / another model in config.json: named, never dropped
    sd = load_file(os.path.join(path, "model.safetensors"))
    extra = "model.layers.0.mlp.experts.8.up_proj.weight"
    for case, tensors in (("lacks 1 tensor(s) the model needs, e.g. model.norm.weight (64,)",
                           {k: v for k, v in sd.items() if k != "model.norm.weight"}),
                          (f"holds 1 tensor(s) the model has no place for, e.g. {extra} (64, 64)",
                           {**sd, extra: sd["model.layers.0.mlp.experts.0.up_proj.weight"].clone()})):
        bad = tmp_path / case.split()[0]
        bad.mkdir()
        (bad / "config.json").write_text(Path(path, "config.json").read_text())
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(TesseraConfigError) as e:  # every rank checks the whole file, not only its part
            load_into_stages(str(bad), [StageModule(tiny, (2, 3))], tiny)
        assert str(e.value).startswith(f"train.init_from={str(bad)!r}: {case}; fix: ") and "\n" not in str(e.value)
    other = dataclasses.replace(tiny, layers=tiny.layers[:4])
    with pytest.raises(TesseraConfigError, match=r"config.json describes another model: num_layers=8 where the "
                                                 r"model has 4"):
        load_into_stages(path, [StageModule(other, (3, 5))], other)
    with pytest.raises(TesseraConfigError, match=r"^model.layers\[0\].mixer='mla': Qwen3-Next layers have"):
        qwen3_next_config(get_model("tiny-deepseek-v3"))
    with pytest.raises(TesseraConfigError, match=r"^model.layers\[0\].mixer='mamba2'"):
        qwen3_next_config(get_model("tiny-nemotron-h"))


def _validate(recipe):
    from tessera.flow import resolve

    resolve(recipe)


# --------------------------------------------------------------------------- a real run, then tessera export


class _Driver:
    def __init__(self, program: dict):
        self.program = program

    def call(self, method, *args):
        if method == "plan_dict":
            return {"plan": {"name": "p"}, "plan_version": 0}
        return [] if method == "pending_versions" else None

    def send(self, method, *args):
        pass


class _Session:
    """One process: broadcast is the identity; saves write the real checkpoint files."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def broadcast(self, obj, rank):
        return obj

    def checkpoint_path(self):
        return None

    def save(self, step, metrics, *, die_before_marker=False, **part):
        ckpt.write_part(os.path.join(self.run_dir, ckpt.dir_name(step)), step=step, **part)

    def barrier(self):
        pass

    def reduce_switch(self, moved_bytes, seconds):
        return moved_bytes, seconds


def test_run_from_init_from_then_tessera_export(tiny, hf_dir, tmp_path, capsys, monkeypatch):
    """One rank, the real engine: the run starts from the HF directory, trains 2 steps, checkpoints;
    ``tessera export`` writes the checkpoint's weights, which transformers loads with Tessera's logits,
    and the byte-level tokenizer, which ``AutoTokenizer`` loads offline."""
    from transformers import AutoTokenizer

    from tessera.cli.main import main

    import huggingface_hub.constants

    # nothing may come from the Hub (every request raises OfflineModeIsEnabled): the directory has it all
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    from tessera.flow import build_baseline, build_costs, compile_programs, resolve
    from tessera.train.worker.data import shard_for
    from tessera.train.worker.step import RankInfo, make_step_runner
    from tessera.train.worker.loop import WorkerConfig, WorkerLoop

    hf, path = hf_dir
    recipe = load_recipe(TINY, [*ONE_RANK, "train.steps=2", "train.checkpoint_every=2", f"train.init_from={path}",
                                "logging.wandb_mode=disabled"])
    res = resolve(recipe)
    program = compile_programs(build_baseline(res, build_costs(res)))[0]
    run_dir = tmp_path / "run"

    def loop():
        runner = make_step_runner(recipe, program, RankInfo(0, 1, 0, 0, 0), None, model=res.model)
        return WorkerLoop(WorkerConfig(recipe.to_dict(), "r", str(run_dir), "d"), recipe, rank=0, world=1,
                          device="cpu", driver=_Driver(program.to_dict()), runner=runner, data=shard_for(recipe, 0),
                          model=res.model, version=0, session=_Session(str(run_dir)))

    first = loop()
    assert first.restore() == 0  # no checkpoint: the weights come from train.init_from
    on_disk = load_file(os.path.join(path, "model.safetensors"))
    assert all(torch.equal(p, on_disk[n]) for m in first.runner.modules for n, p in stage_params(m).items())
    first.prepare_metrics()
    for step in (1, 2):
        first.checkpoint(step, first.step(step))
    trained = [StageModule(res.model, (-1, 9))]
    trained[0].load_state_dict(first.runner.modules[0].state_dict())
    again = loop()
    assert again.restore() == 2  # the checkpoint takes precedence over train.init_from
    assert all(torch.equal(a, b) for a, b in zip(again.runner.modules[0].parameters(), trained[0].parameters()))

    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--to", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (f"tessera export: {run_dir} step 2 -> {out} (305 tensors, config.json, model.safetensors, "
                    "tokenizer.json, tokenizer_config.json)")
    ids = batch()
    theirs, model = hf_logits(str(out), ids)
    ours = tessera_logits(trained, ids)
    assert torch.allclose(ours, theirs, rtol=0, atol=ATOL), (ours - theirs).abs().max()
    # the exported tokenizer is the byte-level encoding the run trained on: the same ids as
    # Tessera's data pipeline reading the same text from a file, and back to the text
    text = "def f(x):\n\treturn x ** 2  # ünïcödé ✓ 🙂"
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    tessera_ids = TokenSequences.from_source(str(tmp_path / "text.txt"), seq_length=4).tokens.tolist()
    tok = AutoTokenizer.from_pretrained(str(out))
    got = tok(text)["input_ids"]
    assert got == tessera_ids and len(got) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(got) == text and tok.model_max_length == tiny.max_positions
    assert tok.convert_ids_to_tokens(got[:4]) == ["d", "e", "f", "Ġ"]  # byte 32 is GPT-2's stand-in for a space
    encoded = tok(text, return_tensors="pt")["input_ids"]  # tokenizer -> model: Tessera's logits on the same ids
    assert torch.allclose(tessera_logits(trained, encoded), model(encoded).logits.detach(), rtol=0, atol=ATOL)
    assert not torch.allclose(ours, hf_logits(hf, ids)[0], atol=1e-4)  # trained away from the start
    again_out = tmp_path / "export-recipe"  # the model from the run's recipe instead of the checkpoint
    assert main(["export", str(run_dir), "--to", str(again_out), "--recipe", TINY]) == 0
    capsys.readouterr()
    assert load_file(str(again_out / "model.safetensors")).keys() == load_file(str(out / "model.safetensors")).keys()
    assert main(["export", str(tmp_path / "nothing"), "--to", str(out)]) == 2
    assert "tessera export: error: RUN_DIR=" in (err := capsys.readouterr().err) and "does not exist" in err
    (tmp_path / "empty-run").mkdir()
    assert main(["export", str(tmp_path / "empty-run"), "--to", str(out)]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err
    # an earlier export is written over; a directory with anything else is refused, nothing written
    assert main(["export", str(run_dir), "--to", str(out)]) == 0
    capsys.readouterr()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["export", str(run_dir), "--to", str(busy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--to=" in err[0] and "notes.txt" in err[0] and "new or empty directory" in err[0], err
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]


def _ep_world(rank, size, *, path):
    """One EP rank (the world is the EP group): its stage of layers 3-4 loaded from ``path``."""
    import torch.distributed as dist

    stage = StageModule(get_model("tiny-qwen3-next"), (3, 5), ep_group=dist.group.WORLD)
    load_into_stages(path, [stage], stage.model_spec)
    return {n: p.detach().clone() for n, p in stage_params(stage).items()}


def test_init_from_under_ep2_reads_each_ranks_own_experts(hf_dir):
    """Two gloo ranks, EP = 2: rank r holds and reads experts 4r..4r+3 of each MoE layer."""
    import functools

    from tessera.testing import run_local

    _, path = hf_dir
    got = run_local(functools.partial(_ep_world, path=path), 2, timeout_s=180)
    on_disk = load_file(os.path.join(path, "model.safetensors"))
    for r, tensors in enumerate(got):
        experts = {int(n.split(".")[5]) for n in tensors if ".mlp.experts." in n}
        assert experts == set(range(4 * r, 4 * r + 4))
        assert all(torch.equal(t, on_disk[n]) for n, t in tensors.items())
    assert set(got[0]) | set(got[1]) == {n for n in on_disk if n.startswith(("model.layers.3.", "model.layers.4."))}


def _ep_part(stage, ep_rank: int, local: int) -> dict:
    """The checkpoint part an EP rank's stage writes (``EngineStepRunner.state_dict`` form): its
    routed experts ``[ep_rank*local, (ep_rank+1)*local)`` under EP-local ids, no optimizer state."""
    import re

    sd, names = {}, []
    params = dict(stage.named_parameters())  # param_names: parameters only (the optimizer's); buffers are in sd
    for key, t in stage.state_dict().items():
        is_param = key in params
        m = re.match(r"(layers\.(\d+)\.moe\.experts)\.(\d+)\.(.+)", key)
        if m is not None:
            e = int(m.group(3)) - ep_rank * local
            if not 0 <= e < local:
                continue
            key = f"{m.group(1)}.{e}.{m.group(4)}"
        sd[key] = t
        k = re.match(r"layers\.(\d+)\.(.+)", key)
        if is_param:
            names.append(f"layers.{max(stage.start, 0) + int(k.group(1))}.{k.group(2)}" if k else key)
    return {"modules": [sd], "optimizer": {"state": {}, "param_groups": [{"params": list(range(len(names)))}]},
            "stages": [(0, stage.start, stage.stop)], "param_names": names, "model": stage.model_spec.to_dict()}


def _export_pp2_ep2(stages, tmp_path):
    """Step-3 checkpoint of layout (pp, dp, ep) = (2, 2, 2) from the two pipeline ``stages`` of one
    model: replica ``r`` is EP rank ``r`` and writes its experts (:func:`_ep_part`); exported from
    ``tmp_path/run`` to ``tmp_path/out``. Returns ``export_run``'s ``(files, CheckpointInfo)``."""
    from tessera.train.worker.hf_io import export_run

    step = tmp_path / "run" / ckpt.dir_name(3)
    for replica in (0, 1):
        for p, stage in enumerate(stages):
            ckpt.write_part(str(step), rank=replica * 2 + p, world_size=4, layout=(2, 2, 2), step=3, plan_version=0,
                            data_position=0, state=_ep_part(stage, replica, 4))
    return export_run(str(tmp_path / "run"), str(tmp_path / "out"))


def test_export_of_a_pp2_ep2_checkpoint_puts_every_expert_at_its_global_id(tiny, hf_dir, tmp_path):
    """Layout (pp, dp, ep) = (2, 2, 2): replica r is EP rank r and holds experts 4r..4r+3 as 0..3."""
    _, path = hf_dir
    stages = [StageModule(tiny, (-1, 4)), StageModule(tiny, (4, 9))]
    load_into_stages(path, stages, tiny)
    files, info = _export_pp2_ep2(stages, tmp_path)
    assert (info.step, info.layout, files) == (3, (2, 2, 2), ["config.json", "model.safetensors", "tokenizer.json",
                                                            "tokenizer_config.json"])
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    src = load_file(os.path.join(path, "model.safetensors"))
    assert sorted(out) == sorted(src) and all(torch.equal(out[n], src[n]) for n in src)


# --------------------------------------------------------------------------- DeepSeek-V3, Nemotron-H, Qwen3-MoE
#
# The same round trip for the other families, in process: a random transformers model of the
# tiny preset (hf_model: non-zero correction biases) -> save_pretrained -> init_from into Tessera
# stages (one stage; two ranks' stages) -> the same logits, and each Tessera layer gives the
# transformers layer's output (DeepseekV3DecoderLayer, NemotronHBlock of each kind M E * -,
# Qwen3MoeDecoderLayer) on the input that layer saw; stages -> export -> AutoModelForCausalLM ->
# the same logits. Measured max |logit difference| (fp32): about 2e-7 for each family.

FAMILY_PRESETS = {"deepseek_v3": "tiny-deepseek-v3", "nemotron_h": "tiny-nemotron-h", "qwen3_moe": "tiny-qwen3-moe"}
SIGMOID = ("deepseek_v3", "nemotron_h")


def latent(model, width: int = 32):
    """``model`` with latent-space routed experts of ``width`` (Nemotron 3 Super's MoE kind)."""
    layers = tuple(dataclasses.replace(l, mlp=dataclasses.replace(l.mlp, latent_dim=width))
                   if isinstance(l.mlp, MoESpec) else l for l in model.layers)
    return dataclasses.replace(model, layers=layers)


@pytest.fixture(scope="module", params=sorted(FAMILY_PRESETS) + ["nemotron_h+latent"])
def family_dir(request, tmp_path_factory):
    """``(family, model, HF model, its save_pretrained directory)``; ``nemotron_h+latent``:
    tiny-nemotron-h with latent-space experts (``fc1_latent_proj`` / ``fc2_latent_proj``)."""
    family = request.param.split("+")[0]
    model = get_model(FAMILY_PRESETS[family])
    if request.param.endswith("+latent"):
        model = latent(model)
    hf = hf_model(model)
    path = tmp_path_factory.mktemp("hf") / request.param
    hf.save_pretrained(path)
    return family, model, hf, str(path)


def _halves(model):
    """Two ranks' stages: embedding + the first half of the layers, the rest + head."""
    n = model.num_layers
    return [[(-1, n // 2)], [(n // 2, n + 1)]]


def _hf_layers(hf):
    return hf.model.layers


def test_family_init_from_gives_transformers_logits_layer_by_layer(family_dir):
    family, model, hf, path = family_dir
    on_disk = load_file(os.path.join(path, "model.safetensors"))
    ids = batch()
    theirs, _ = hf_logits(hf, ids)
    for partition in ([[(-1, model.num_layers + 1)]], _halves(model)):
        stages, loaded = [], set()
        for chunks in partition:  # each rank reads its own tensors
            mine = [StageModule(model, c, seed=3) for c in chunks]
            load_into_stages(path, mine, model)
            tensors = {n: t for s in mine for n, t in stage_params(s).items()}
            assert all(torch.equal(t, on_disk[n]) for n, t in tensors.items())
            assert not loaded & set(tensors)
            loaded |= set(tensors)
            stages += mine
        assert loaded == set(on_disk)
        ours = tessera_logits(stages, ids)
        assert torch.allclose(ours, theirs, rtol=0, atol=ATOL), (ours - theirs).abs().max()
    # layer by layer: each Tessera layer on the hidden states the transformers layer received
    seen = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
             for layer in _hf_layers(hf)]
    hf_logits(hf, ids)
    for h in hooks:
        h.remove()
    assert len(seen) == model.num_layers
    with torch.no_grad():
        for (x, want), layer in zip(seen, [l for s in sorted(stages, key=lambda s: s.start) for l in s.layers]):
            got = layer(x)
            assert torch.allclose(got, want, rtol=0, atol=ATOL), (layer.index, (got - want).abs().max())
    if family in SIGMOID:  # the correction bias is loaded and changes the routing
        biases = [n for n in on_disk if n.endswith("gate.e_score_correction_bias")]
        assert biases and all(on_disk[n].abs().min() > 0 for n in biases)
        with torch.no_grad():
            saved = {n: b.clone() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}
            for n, b in hf.named_buffers():
                if n in saved:
                    b.zero_()
            unbiased, _ = hf_logits(hf, ids)
            for n, b in hf.named_buffers():
                if n in saved:
                    b.copy_(saved[n])
        assert not torch.allclose(unbiased, theirs, atol=1e-4)


def test_family_export_gives_transformers_the_same_logits(family_dir, tmp_path):
    family, model, hf, path = family_dir
    stages = [StageModule(model, c) for rank in _halves(model) for c in rank]
    load_into_stages(path, stages, model)
    with torch.no_grad():  # move off the loaded values: the export must carry the stages' own tensors
        for s in stages:
            for t in stage_params(s).values():
                t.add_(0.01 * torch.randn_like(t))
    named = {n: e["param"] for n, e in named_state(stages, None).items()}
    files = export_state(hf_state(named, model), model, str(tmp_path / "out"))
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    arch = {"deepseek_v3": "DeepseekV3ForCausalLM", "nemotron_h": "NemotronHForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    assert (config["model_type"], config["architectures"], config["norm_topk_prob"]) == (family, [arch], True)
    if family == "deepseek_v3":
        assert (config["n_group"], config["topk_group"], config["routed_scaling_factor"], config["first_k_dense_replace"],
                config["n_shared_experts"], config["num_nextn_predict_layers"]) == (4, 2, 2.5, 1, 1, 0)
    if family == "nemotron_h":
        assert (config["layers_block_type"], config["layer_norm_epsilon"]) == (
            ["linear_attention", "moe", "linear_attention", "full_attention", "moe", "linear_attention", "mlp", "moe"],
            1e-5)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    mine = {n: t for s in stages for n, t in stage_params(s).items()}
    assert written.keys() == mine.keys() and all(torch.equal(written[n], t) for n, t in mine.items())
    ids = batch()
    ours = tessera_logits(stages, ids)
    theirs, m = hf_logits(str(tmp_path / "out"), ids)
    assert type(m).__name__ == arch
    assert torch.allclose(ours, theirs, rtol=0, atol=ATOL), (ours - theirs).abs().max()
    if family in SIGMOID:  # transformers runs with the exported (moved) biases
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                assert torch.equal(b, written[n.replace("model.", "backbone.", 1) if family == "nemotron_h" else n])
    assert not torch.allclose(ours, hf_logits(hf, ids)[0], atol=1e-3)  # not the original weights


def test_family_stacked_experts_and_mtp_tensors(family_dir, tmp_path, capsys):
    """transformers 5's in-memory state dict written as is (stacked experts; Nemotron-H under
    ``model.`` instead of ``backbone.``) loads the same tensors; multi-token-prediction tensors
    are skipped with a note on the rank holding the head."""
    family, model, hf, path = family_dir
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    stacked = {"deepseek_v3": ("model.layers.1.mlp.experts.gate_up_proj", (8, 64, 64)),
               "nemotron_h": ("model.layers.1.mixer.experts.up_proj", (8, 64, model.moe.latent_dim or 64)),
               "qwen3_moe": ("model.layers.0.mlp.experts.gate_up_proj", (8, 128, 64))}[family]
    assert tuple(sd[stacked[0]].shape) == stacked[1]
    mtp = {"deepseek_v3": "model.layers.4.eh_proj.weight", "nemotron_h": "mtp.layers.0.norm.weight"}.get(family)
    if mtp is not None:
        sd[mtp] = torch.ones(64)
    (tmp_path / "config.json").write_text(Path(path, "config.json").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    stages = [StageModule(model, c) for rank in _halves(model) for c in rank]
    for s in stages:
        load_into_stages(str(tmp_path), [s], model)
    per_expert = load_file(os.path.join(path, "model.safetensors"))
    assert all(torch.equal(t, per_expert[n]) for s in stages for n, t in stage_params(s).items())
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ([f"tessera: train.init_from: skipped 1 multi-token-prediction tensor(s) (e.g. {mtp}): Tessera "
                    "does not build MTP heads"] if mtp else [])


MISMATCHES = {
    "deepseek_v3": [({"routed_scaling_factor": 1.0}, "routed_scaling_factor=1.0 where the model has 2.5"),
                    ({"n_group": 1}, "n_group=1 where the model has 4"),
                    ({"topk_group": 4}, "topk_group=4 where the model has 2"),
                    ({"norm_topk_prob": False}, "norm_topk_prob=False where the model has True"),
                    ({"rope_interleave": False}, "rope_interleave=False where the model has True"),
                    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05 where the model has 1e-06"),
                    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}},
                     "rope_parameters.rope_type='yarn' where the model has 'default'"),
                    ({"first_k_dense_replace": 2}, "layers[1].mlp=DenseMLPSpec(ffn=128, gated=True) where the model "
                                                   "has MoESpec("),
                    ({"model_type": "nemotron_h"}, "model_type='nemotron_h' where the model needs 'deepseek_v3'")],
    "nemotron_h": [({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06 where the model has 1e-05"),
                   ({"norm_topk_prob": False}, "norm_topk_prob=False where the model has True"),
                   ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5 where the model has 1.0"),
                   ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu' where the model has 'relu2'"),
                   ({"time_step_limit": [0.0, 1.0]}, "time_step_limit=[0.0, 1.0] where the model has [0.0, inf]"),
                   ({"chunk_size": 64}, "layers[0].mixer=Mamba2Spec(num_heads=8, head_dim=16, state_size=16, "
                                        "n_groups=2, conv_kernel=4, chunk_size=64) where the model has")],
    "qwen3_moe": [({"norm_topk_prob": False}, "norm_topk_prob=False where the model has True"),
                  ({"use_sliding_window": True}, "use_sliding_window=True where the model has False"),
                  ({"num_local_experts": 16}, "layers[0].mlp=MoESpec(num_experts=16,")],
}


def test_family_config_mismatch_and_refusals_are_one_line(family_dir, tmp_path):
    family, model, _, path = family_dir
    config = json.loads(Path(path, "config.json").read_text())
    assert config_mismatch(model, config) is None
    for change, why in MISMATCHES[family]:
        got = config_mismatch(model, {**config, **change})
        assert got is not None and got.startswith(why) and "\n" not in got, (change, got)
    bad = tmp_path / "bad"  # through the import: one line, nothing loaded
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config, **MISMATCHES[family][0][0]}))
    (bad / "model.safetensors").symlink_to(os.path.join(path, "model.safetensors"))
    with pytest.raises(TesseraConfigError) as e:
        load_into_stages(str(bad), [StageModule(model, (2, 3))], model)
    assert str(e.value).startswith(f"train.init_from={str(bad)!r}: config.json describes another model: "
                                   f"{MISMATCHES[family][0][1]}; fix: ") and "\n" not in str(e.value)


def _with(model, index, **change):
    """``model`` with layer ``index``'s MLP spec changed (``mixer=...`` sets the mixer)."""
    from tessera.spec.model import LayerSpec

    layers = list(model.layers)
    l = layers[index]
    mixer = change.pop("mixer", l.mixer)
    layers[index] = LayerSpec(index, mixer, dataclasses.replace(l.mlp, **change) if change else l.mlp)
    return dataclasses.replace(model, layers=tuple(layers))


def test_models_without_an_hf_equivalent_are_refused_in_one_line():
    from tessera.spec.model import DenseMLPSpec, Mamba2Spec

    ds, nh, qm = get_model("tiny-deepseek-v3"), get_model("tiny-nemotron-h"), get_model("tiny-qwen3-moe")
    cases = [
        (_with(ds, 2, router="softmax", routed_scaling=1.0), r"model.layers\[2\].mlp='moe': DeepSeek-V3 MoE layers "
                                                             r"route by sigmoid"),
        (_with(ds, 1, latent_dim=16), r"model.layers\[1\].mlp='moe': DeepSeek-V3 MoE layers"),
        (_with(ds, 3, expert_ffn=64, shared_expert_ffn=64), r"model.layers\[3\].mlp='moe': DeepSeek-V3 has one moe "
                                                            r"shape for all layers"),
        (_with(ds, 1, shared_expert_ffn=48), r"model.layers\[1\].mlp.shared_expert_ffn=48: DeepSeek-V3 has "
                                             r"n_shared_experts"),
        (dataclasses.replace(ds, layers=tuple(dataclasses.replace(l, index=i) for i, l in
                                              enumerate((ds.layers[1], ds.layers[0], *ds.layers[2:])))),
         r"model.layers\[1\].mlp='dense': DeepSeek-V3 has its dense layers first"),
        (_with(nh, 1, latent_dim=32), r"model.layers\[4\].mlp='moe': Nemotron-H has one moe shape"),
        (_with(nh, 4, shared_expert_ffn=0), r"model.layers\[4\].mlp='moe': Nemotron-H MoE blocks"),
        (_with(nh, 2, mixer=Mamba2Spec(8, 16, 16, 2, chunk_size=64)), r"model.layers\[2\].mixer='mamba2': "
                                                                     r"Nemotron-H has one mamba2 shape"),
        (dataclasses.replace(nh, layers=(*nh.layers[:6], dataclasses.replace(nh.layers[6], mixer=nh.layers[5].mixer),
                                         nh.layers[7])), r"model.layers\[6\].mlp='dense': a Nemotron-H layer is one "
                                                         r"block"),
        (_with(qm, 0, shared_expert_ffn=64), r"model.layers\[0\].mlp='moe': Qwen3-MoE MoE layers"),
        (_with(qm, 1, router="sigmoid"), r"model.layers\[1\].mlp='moe': Qwen3-MoE MoE layers"),
    ]
    for model, message in cases:
        for call in (check_supported, hf_config):
            with pytest.raises(TesseraConfigError, match="^" + message) as e:
                call(model)
            assert "\n" not in str(e.value) and "; fix: export/import Hugging Face checkpoints" in str(e.value)
    assert isinstance(nh.layers[6].mlp, DenseMLPSpec)


def test_family_names_follow_the_ep_offset():
    assert hf_name("layers.1.moe.gate.e_score_correction_bias", "mla", 0, "deepseek_v3") == \
        "model.layers.1.mlp.gate.e_score_correction_bias"
    assert hf_name("layers.2.moe.experts.1.gate_proj.weight", "mla", 4, "deepseek_v3") == \
        "model.layers.2.mlp.experts.5.gate_proj.weight"
    assert hf_name("layers.1.moe.shared_expert.down_proj.weight", "mla", 0, "deepseek_v3") == \
        "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert hf_name("layers.0.attn.kv_a_proj_with_mqa.weight", "mla", 0, "deepseek_v3") == \
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert hf_name("layers.4.moe.experts.1.up_proj.weight", None, 4, "nemotron_h") == \
        "backbone.layers.4.mixer.experts.5.up_proj.weight"
    assert hf_name("layers.4.post_attention_layernorm.weight", None, 0, "nemotron_h") == "backbone.layers.4.norm.weight"
    assert hf_name("layers.0.input_layernorm.weight", "mamba2", 0, "nemotron_h") == "backbone.layers.0.norm.weight"
    assert hf_name("layers.0.attn.A_log", "mamba2", 0, "nemotron_h") == "backbone.layers.0.mixer.A_log"
    assert hf_name("embed.weight", None, 0, "nemotron_h") == "backbone.embeddings.weight"
    assert hf_name("head.norm.weight", None, 0, "nemotron_h") == "backbone.norm_f.weight"
    assert hf_name("layers.0.attn.q_norm.weight", "attention", 0, "qwen3_moe") == "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(KeyError, match="no Hugging Face DeepSeek-V3 name"):
        hf_name("layers.1.moe.shared_expert_gate.weight", "mla", 0, "deepseek_v3")


@pytest.mark.parametrize("family_dir", SIGMOID, indirect=True)
def test_sigmoid_family_pp2_ep2_checkpoint_exports_experts_and_biases(family_dir, tmp_path):
    """(pp, dp, ep) = (2, 2, 2) checkpoint parts as the worker writes them (module state dicts
    with the correction biases, parameters by name): every expert at its global id and every
    bias in the export, bitwise the loaded directory's."""
    _, model, _, path = family_dir
    stages = [StageModule(model, c[0]) for c in _halves(model)]
    load_into_stages(path, stages, model)
    files, info = _export_pp2_ep2(stages, tmp_path)
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    src = load_file(os.path.join(path, "model.safetensors"))
    assert sorted(out) == sorted(src) and all(torch.equal(out[n], src[n]) for n in src)
    assert sum(n.endswith("e_score_correction_bias") for n in out) == 3



def _worker_loop(recipe, run_dir):
    """A one-rank WorkerLoop of ``recipe`` with the real engine and checkpoint files (_Session)."""
    from tessera.flow import build_baseline, build_costs, compile_programs, resolve
    from tessera.train.worker.data import shard_for
    from tessera.train.worker.loop import WorkerConfig, WorkerLoop
    from tessera.train.worker.step import RankInfo, make_step_runner

    res = resolve(recipe)
    program = compile_programs(build_baseline(res, build_costs(res)))[0]
    runner = make_step_runner(recipe, program, RankInfo(0, 1, 0, 0, 0), None, model=res.model)
    return WorkerLoop(WorkerConfig(recipe.to_dict(), "r", str(run_dir), "d"), recipe, rank=0, world=1, device="cpu",
                      driver=_Driver(program.to_dict()), runner=runner, data=shard_for(recipe, 0), model=res.model,
                      version=0, session=_Session(str(run_dir)))


@pytest.mark.parametrize("family_dir", ["deepseek_v3"], indirect=True)
def test_deepseek_run_moves_the_correction_bias_checkpoints_and_exports_it(family_dir, tmp_path, capsys):
    """One rank, the real engine on tiny-deepseek-v3 started from the transformers directory
    (non-zero correction biases): the engine's aux-loss-free update (bias_update_rate 0.001)
    moves each bias by at most 0.001 per step, the checkpoint restores the moved biases, and
    ``tessera export`` writes them: transformers gives Tessera's logits."""
    from tessera.cli.main import main

    _, model, _, path = family_dir
    recipe = load_recipe(TINY, [*ONE_RANK, "model.preset=tiny-deepseek-v3", "train.steps=2", "train.checkpoint_every=2",
                                f"train.init_from={path}", "logging.wandb_mode=disabled"])
    run_dir = tmp_path / "run"

    def biases(loop):
        return {n: t.clone() for n, t in stage_params(loop.runner.modules[0]).items() if n.endswith("_bias")}

    first = _worker_loop(recipe, run_dir)
    assert first.restore() == 0
    on_disk = load_file(os.path.join(path, "model.safetensors"))
    start = biases(first)
    assert len(start) == 3 and all(torch.equal(t, on_disk[n]) for n, t in start.items())
    first.prepare_metrics()
    for step in (1, 2):
        first.checkpoint(step, first.step(step))
    trained = biases(first)
    moved = max((trained[n] - start[n]).abs().max().item() for n in start)
    assert 0 < moved <= 2 * 0.001 + 1e-6
    again = _worker_loop(recipe, run_dir)
    assert again.restore() == 2
    assert all(torch.equal(t, trained[n]) for n, t in biases(again).items())
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--to", str(out)]) == 0
    capsys.readouterr()
    written = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(written[n], t) for n, t in trained.items())
    ids = batch()
    ours = tessera_logits(list(again.runner.modules), ids)
    theirs, m = hf_logits(str(out), ids)
    assert type(m).__name__ == "DeepseekV3ForCausalLM"
    assert torch.allclose(ours, theirs, rtol=0, atol=ATOL), (ours - theirs).abs().max()
