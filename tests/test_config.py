"""Recipe loading (omegaconf schema, overrides, model/hardware resolution) and every validation rule."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest

from tessera.config.frozen import FrozenDict
from tessera.config.load import Recipe, load_recipe, recipe_from_dict
from tessera.config.resolve import resolve_hardware, resolve_model
from tessera.config.validate import validate_memory, validate_recipe
from tessera.errors import TesseraConfigError
from tessera.program.memory import rank_memory_bytes

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
QWEN = str(RECIPES / "qwen3-next-80b.yaml")


def _err(path, overrides=()) -> str:
    """Message of the TesseraConfigError raised by loading + resolving + validating a recipe."""
    with pytest.raises(TesseraConfigError) as ei:
        r = load_recipe(path, overrides)
        m = resolve_model(r)
        validate_recipe(r, m)
        resolve_hardware(r)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# --------------------------------------------------------------------------- loading


def test_default_recipe_is_the_shipped_tiny_recipe_file():
    import tessera
    from tessera.config.load import DEFAULT_RECIPE, SHIPPED_RECIPES

    # package data inside the tessera package; the checkout's recipes/ is a link to the same folder
    assert DEFAULT_RECIPE.parent == SHIPPED_RECIPES == Path(tessera.__file__).resolve().parent / "recipes"
    assert RECIPES.resolve() == SHIPPED_RECIPES and DEFAULT_RECIPE.is_file()
    d = load_recipe(None)
    f = load_recipe(str(RECIPES / "tiny-qwen3-next.yaml"))
    assert d == f and hash(d) == hash(f)
    assert (d.name, d.model.preset, d.hardware.preset) == ("tiny-qwen3-next", "tiny-qwen3-next", "cpu")
    assert (d.parallel.pp, d.parallel.ep, d.parallel.seq_length) == (2, 2, 64)


def test_recipe_is_frozen_hashable_and_round_trips():
    r = load_recipe(QWEN, ["hardware.inline.mem_gb=96", "model.inline.x=[1,2]"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.parallel.pp = 4  # type: ignore[misc]
    assert isinstance(r.hardware.inline, FrozenDict) and r.hardware.inline["mem_gb"] == 96
    assert r.model.inline["x"] == (1, 2)
    assert len({r, load_recipe(QWEN, ["hardware.inline.mem_gb=96", "model.inline.x=[1,2]"])}) == 1
    d = json.loads(json.dumps(r.to_dict()))
    assert d["parallel"] == {"pp": 8, "vpp": 2, "ep": 8, "tp": 1, "dp": 8, "num_microbatches": 16,
                             "micro_batch_size": 1, "seq_length": 4096, "moe_dispatcher": "alltoall", "dp_shard": "zero1",
                             "rank_order": "auto"}
    assert d["model"]["inline"] == {"x": [1, 2]}
    assert recipe_from_dict(d) == r
    assert pickle.loads(pickle.dumps(r)) == r  # Ray ships recipes to workers


def test_yaml_values_and_schema_defaults(tmp_path):
    r = load_recipe(QWEN)
    assert isinstance(r, Recipe)
    assert (r.parallel.pp, r.parallel.vpp, r.parallel.ep, r.parallel.num_microbatches) == (8, 2, 8, 16)
    assert r.planner.template == "interleaved-1f1b"
    assert r.planner.memory_margin == 0.05 and r.dbo.pool_mem_gb == 4.0  # schema defaults
    # the YAML round-trips through to_yaml
    assert load_recipe(_write(tmp_path, r.to_yaml())) == r


def test_overrides_apply_in_order_and_with_overrides():
    r = load_recipe(QWEN, ["parallel.pp=4", "parallel.vpp=3", "planner.overlap=false", "parallel.pp=6"])
    assert (r.parallel.pp, r.parallel.vpp, r.planner.overlap) == (6, 3, False)
    r2 = r.with_overrides(["parallel.ep=16", "name=x"])
    assert (r2.parallel.ep, r2.name, r2.parallel.pp) == (16, "x", 6)
    assert r.parallel.ep == 8  # unchanged


def test_unknown_key_in_yaml_names_field_and_known_keys(tmp_path):
    path = _write(tmp_path, "name: x\nparallel:\n  pp: 2\n  pipline: 4\n")
    msg = _err(path)
    assert msg.startswith("parallel.pipline=4: unknown key in parallel")
    assert "known keys: pp, vpp, ep" in msg


def test_unknown_key_in_override_suggests_close_match():
    msg = _err(QWEN, ["paralel.pp=3"])
    assert msg.startswith("paralel=") and "did you mean 'parallel'?" in msg


def test_wrong_type_names_field_value_and_type():
    msg = _err(QWEN, ["parallel.pp=eight"])
    assert msg.startswith("parallel.pp='eight'") and "Integer" in msg and "of type int" in msg
    assert "planner.overlap='maybe'" in _err(QWEN, ["planner.overlap=maybe"])


def test_bad_override_syntax_and_section_scalar():
    assert _err(QWEN, ["parallel.pp"]).startswith("override='parallel.pp': must have the form")
    msg = _err(QWEN, ["parallel=8"])
    assert msg.startswith("parallel=8: is a section") and "num_microbatches" in msg


def test_missing_file_and_invalid_yaml(tmp_path):
    assert "file does not exist" in _err(str(tmp_path / "nope.yaml"))
    msg = _err(_write(tmp_path, "name: x\nparallel: [1, 2\n"))
    assert "is not valid YAML at line" in msg


# --------------------------------------------------------------------------- model and hardware


def test_model_preset_truncation_and_too_many_layers():
    m = resolve_model(load_recipe(QWEN, ["model.num_layers=8"]))
    assert m.num_layers == 8 and m.kinds == "DE DE DE AE DE DE DE AE"
    msg = _err(QWEN, ["model.num_layers=60"])
    assert msg.startswith("model.num_layers=60") and "48 layers of qwen3-next-80b-a3b" in msg


def test_hf_config_path_relative_to_recipe(tmp_path):
    cfg = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "full_attention_interval": 4,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 16,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
           "_name_or_path": "my-qwen3-next"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    path = _write(tmp_path, "name: hf\nmodel:\n  hf_config: hf/config.json\nhardware:\n  preset: cpu\n")
    r = load_recipe(path)
    assert Path(r.model.hf_config).is_absolute()
    m = resolve_model(r)
    assert (m.name, m.num_layers, m.hidden, m.moe.num_experts) == ("my-qwen3-next", 8, 64, 16)
    assert m.kinds == "DE DE DE AE DE DE DE AE"
    assert "ep=3" in _err(path, ["parallel.ep=3", "parallel.dp=3"]).replace("parallel.ep=3", "ep=3")
    assert "file does not exist" in _err(path, ["model.hf_config=/no/such/config.json"])


def test_inline_model_spec_and_pattern():
    from tessera.spec.presets import get_model

    tiny = get_model("tiny-qwen3-next")
    r = recipe_from_dict({"model": {"inline": tiny.to_dict()}})
    assert resolve_model(r) == tiny
    pat = {"name": "p", "pattern": "ME*E", "hidden": 64, "vocab": 256,
           "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
           "mamba": {"num_heads": 4, "head_dim": 16, "state_size": 16, "n_groups": 1},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn": 32}}
    m = resolve_model(recipe_from_dict({"model": {"inline": pat}}))
    assert m.kinds == "M- -E A- -E"
    assert "model.inline" in _err(None, ["model.preset=null", "model.inline.hidden=3"])


def test_hardware_preset_and_inline_override():
    hw = resolve_hardware(load_recipe(QWEN, ["hardware.inline.mem_gb=96", "hardware.inline.comm_sms=24"]))
    assert (hw.name, hw.mem_gb, hw.comm_sms) == ("h800", 96.0, 24)
    msg = _err(QWEN, ["hardware.inline.mem_gbs=96"])
    assert msg.startswith("hardware.inline.mem_gbs=96") and "did you mean 'mem_gb'?" in msg
    assert _err(QWEN, ["hardware.inline.mem_gb=lots"]).startswith("hardware.inline.mem_gb='lots': must be of type float")
    # a HardwareSpec field written one level too high points at hardware.inline
    msg = _err(QWEN, ["hardware.mem_gb=10"])
    assert msg.startswith("hardware.mem_gb=10: unknown key") and "did you mean 'hardware.inline.mem_gb'?" in msg
    assert "did you mean" not in _err(QWEN, ["hardware.foo=1"])


@pytest.mark.parametrize("override,needle", [
    ("hardware.inline.comm_sms=132", "hardware.inline.comm_sms=132: comm_sms=132 must be below num_sms=132"),
    ("hardware.inline.num_sms=10", "hardware.inline.num_sms=10: comm_sms=20 must be below num_sms=10"),
    ("hardware.inline.mem_gb=0", "hardware.inline.mem_gb=0.0: must be > 0"),
    ("hardware.inline.inter_node_gbs=-5", "hardware.inline.inter_node_gbs=-5.0: must be > 0"),
    ("hardware.inline.link_latency_us=-1", "hardware.inline.link_latency_us=-1.0: must be >= 0"),
    ("hardware.inline.mfu_efficiency=-1", "hardware.inline.mfu_efficiency=-1.0: must be in (0, 1]"),
    ("hardware.inline.mfu_efficiency=1.5", "hardware.inline.mfu_efficiency=1.5: must be in (0, 1]"),
])
def test_hardware_values_out_of_range(override, needle):
    msg = _err(QWEN, [override])
    assert msg.startswith(needle) and "; fix: " in msg


def test_every_hardware_preset_is_in_range():
    from tessera.config.resolve import check_hardware as _check_hardware
    from tessera.spec.hardware_presets import get_hardware

    for name in ("h100-sxm", "h800", "h200", "cpu"):
        _check_hardware(get_hardware(name), set())


# --------------------------------------------------------------------------- validation rules


@pytest.mark.parametrize("field,value", [("pp", 0), ("vpp", 0), ("ep", -2), ("dp", 0), ("tp", 0),
                                         ("num_microbatches", 0), ("micro_batch_size", 0), ("seq_length", -1)])
def test_sizes_must_be_positive(field, value):
    msg = _err(QWEN, [f"parallel.{field}={value}"])
    assert msg.startswith(f"parallel.{field}={value}: must be >= 1")


@pytest.mark.parametrize("override,start", [("planner.memory_margin=1.5", "planner.memory_margin=1.5"),
                                            ("planner.time_limit_s=0", "planner.time_limit_s=0.0"),
                                            ("train.lr=0", "train.lr=0.0"), ("model.num_layers=-1", "model.num_layers=-1")])
def test_knobs_in_range(override, start):
    assert _err(QWEN, [override]).startswith(start)


def test_more_virtual_stages_than_layers():
    msg = _err(None, ["parallel.pp=8", "parallel.vpp=2", "parallel.num_microbatches=8"])
    assert msg.startswith("parallel.vpp=2:") and "8*2 = 16 virtual stages exceed the 8 layers of tiny-qwen3-next" in msg
    assert "use pp*vpp <= 8" in msg


def test_ep_must_divide_experts():
    # only values that also divide dp*tp are proposed, or a dp change that makes them valid
    msg = _err(QWEN, ["parallel.ep=3", "parallel.dp=3"])
    assert msg == ("parallel.ep=3: must divide the 512 experts of qwen3-next-80b-a3b; "
                   "fix: use parallel.ep=1; or parallel.ep=2 with parallel.dp=4; or parallel.ep=4 with parallel.dp=4")
    assert _err(QWEN, ["parallel.ep=3"]).endswith("fix: use parallel.ep=1, 2, 4 or 8")  # dp=8


def test_ep_divides_dp_times_tp_with_tp_above_1():
    """``ep | dp*tp``, not ``ep | dp``: tp ranks count (tiny-qwen3-next: 8 experts, tp=2 splits it)."""
    r = load_recipe(None, ["parallel.ep=4", "parallel.dp=2", "parallel.tp=2"])
    validate_recipe(r, resolve_model(r))  # 4 | 2*2
    msg = _err(None, ["parallel.ep=8", "parallel.dp=2", "parallel.tp=2"])
    assert msg.startswith("parallel.ep=8: must divide dp*tp = 2*2 = 4")
    assert msg.endswith("fix: use parallel.ep=1, 2 or 4; or parallel.dp=4 or 8")
    assert _err(None, ["parallel.ep=4", "parallel.dp=1", "parallel.tp=2"]).startswith("parallel.ep=4: must divide dp*tp = 1*2")


def test_ep_must_divide_dp_times_tp():
    msg = _err(QWEN, ["parallel.ep=16"])
    assert msg.startswith("parallel.ep=16: must divide dp*tp = 8*1 = 8") and "dp=16" in msg


def test_unknown_presets_list_known_ones():
    msg = _err(QWEN, ["model.preset=qwen4"])
    assert msg.startswith("model.preset='qwen4': unknown preset") and "qwen3-next-80b-a3b" in msg and "deepseek-v3" in msg
    msg = _err(QWEN, ["hardware.preset=b300"])
    assert msg.startswith("hardware.preset='b300'") and "h800" in msg and "cpu" in msg


def test_unknown_template_and_cost_source():
    msg = _err(QWEN, ["planner.template=gpipe"])
    assert msg.startswith("planner.template='gpipe'") and "interleaved-1f1b" in msg and "dualpipe-v" in msg
    assert _err(QWEN, ["planner.cost_source=magic"]).startswith("planner.cost_source='magic'")


def test_interleaving_needs_enough_microbatches():
    msg = _err(QWEN, ["parallel.pp=6", "parallel.num_microbatches=3"])
    assert msg.startswith("parallel.num_microbatches=3") and "3 < 6" in msg


def test_1f1b_rejects_vpp():
    msg = _err(QWEN, ["planner.template=1f1b"])
    assert msg.startswith("parallel.vpp=2") and "1f1b" in msg


# --------------------------------------------------------------------------- memory rule (needs the plan)


def _small_run(overrides):
    from tessera.flow import build_baseline, build_costs, compile_programs, resolve

    res = resolve(load_recipe(QWEN, ["model.num_layers=8", "parallel.pp=4", "parallel.vpp=1",
                                     "parallel.num_microbatches=8", *overrides]))
    costs = build_costs(res)
    return res, costs, compile_programs(build_baseline(res, costs))


def test_memory_rule_names_rank_need_and_capacity():
    res, costs, programs = _small_run(["hardware.inline.mem_gb=4", "planner.activation_recompute=false"])
    with pytest.raises(TesseraConfigError) as ei:
        validate_memory(res.recipe, res.hardware, programs, costs)
    msg = str(ei.value)
    need = [b / 1e9 for b in rank_memory_bytes(programs, costs)]
    worst = max(range(4), key=lambda r: need[r])
    assert f"rank {worst} needs {need[worst]:.1f} GB, capacity 3.8 GB (h800: 4 GB less planner.memory_margin=0.05)" in msg
    assert "fix: set planner.activation_recompute=selective with planner.recompute_modules=[moe_act,layernorm] or =full (cheaper in time first), set parallel.dp_shard=fsdp" in msg
    assert "raise parallel.pp" in msg


@pytest.mark.parametrize("recompute", [False, True])
def test_rank_memory_matches_simulator(recompute):
    from tessera.sim.simulator import simulate

    res, costs, programs = _small_run([f"planner.activation_recompute={recompute}"])
    need = validate_memory(res.recipe, res.hardware, programs, costs)
    sim = simulate(programs, costs)
    assert need == pytest.approx([m.peak_mem_gb for m in sim.ranks], rel=1e-9)
    assert all(0 < n < 76 for n in need)


def test_uneven_layers_are_placed_exactly_once():
    from tessera.flow import build_baseline, build_costs, resolve

    res = resolve(load_recipe(QWEN, ["model.num_layers=30", "parallel.pp=4", "parallel.vpp=1",
                                     "parallel.num_microbatches=8"]))
    part = build_baseline(res, build_costs(res)).partition
    assert part.num_stages == 4 and sum(part.sizes()) == 30 and min(part.sizes()) >= 1
    assert part.bounds[0] == -1 and part.bounds[-1] == 31
    assert all(a < b for a, b in zip(part.bounds, part.bounds[1:]))


# --------------------------------------------------------------------------- model source (one per layer)


def _hf_config(tmp_path: Path, layers: int = 4) -> str:
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": layers, "vocab_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "_name_or_path": "my-moe"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_override_source_replaces_the_recipe_source(tmp_path):
    from tessera.config.resolve import model_source

    hf = _hf_config(tmp_path)
    r = load_recipe(QWEN, [f"model.hf_config={hf}", "parallel.pp=2", "parallel.vpp=1", "parallel.ep=8"])
    assert (r.model.preset, r.model.hf_config, r.model.inline) == (None, hf, None)
    assert model_source(r) == f"hf_config {hf}"
    m = resolve_model(r)
    assert (m.name, m.num_layers, m.moe.num_experts) == ("my-moe", 4, 8)
    # and a preset override replaces an hf_config recipe
    path = _write(tmp_path, f"name: hf\nmodel:\n  hf_config: {hf}\n")
    r2 = load_recipe(path, ["model.preset=tiny-qwen3-next"])
    assert (r2.model.preset, r2.model.hf_config) == ("tiny-qwen3-next", None)
    assert model_source(r2) == "preset tiny-qwen3-next"


def test_missing_hf_config_override_is_an_error_on_a_preset_recipe():
    # the default recipe sets model.preset; the override's source replaces it, so the missing file is found
    msg = _err(None, ["model.hf_config=no-such-config.json"])
    assert msg.startswith("model.hf_config='no-such-config.json': file does not exist (looked in ")


def test_two_sources_in_one_layer(tmp_path):
    hf = _hf_config(tmp_path)
    path = _write(tmp_path, f"name: x\nmodel:\n  preset: tiny-qwen3-next\n  hf_config: {hf}\n")
    msg = _err(path)
    assert msg.startswith(f"model.hf_config={hf!r}: model.preset='tiny-qwen3-next' is set in the same recipe")
    msg = _err(QWEN, ["model.preset=deepseek-v3", f"model.hf_config={hf}"])
    assert "is set in the same overrides" in msg and "one model source" in msg
    # a null is not a source: clearing one and setting another in the same layer is fine
    r = load_recipe(QWEN, ["model.preset=null", f"model.hf_config={hf}"])
    assert resolve_model(r).name == "my-moe"


def test_preset_null_and_inline_sources():
    from tessera.config.resolve import model_source
    from tessera.spec.presets import get_model

    with pytest.raises(TesseraConfigError, match="needs one of preset, hf_config or inline"):
        model_source(load_recipe(QWEN, ["model.preset=null"]))
    assert "needs one of preset, hf_config or inline" in _err(QWEN, ["model.preset=null"])
    tiny = get_model("tiny-qwen3-next")
    r = recipe_from_dict({"model": {"inline": tiny.to_dict()}})
    assert model_source(r) == "inline" and model_source(load_recipe(QWEN)) == "preset qwen3-next-80b-a3b"


def test_inline_override_merges_into_the_recipe_inline(tmp_path):
    pat = {"name": "p", "pattern": "*E*E", "hidden": 64, "vocab": 256,
           "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn": 32}}
    path = _write(tmp_path, json.dumps({"name": "p", "model": {"inline": pat}}))
    m = resolve_model(load_recipe(path, ["model.inline.hidden=128"]))
    assert (m.hidden, m.kinds, m.moe.num_experts) == (128, "A- -E A- -E", 4)


def test_recipe_path_errors_suggest_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "qwen.yaml").write_text("name: q\n")
    msg = _err(str(tmp_path / "d"))
    assert msg.startswith(f"recipe={str(tmp_path / 'd')!r}: is a directory") and f"{tmp_path}/d/qwen.yaml" in msg
    msg = _err(str(tmp_path / "d" / "qwem.yaml"))
    assert "file does not exist" in msg and f"did you mean {tmp_path}/d/qwen.yaml" in msg
    msg = _err(str(tmp_path / "kimi-k2.yml"))  # not in that folder: the shipped recipes/ are searched too
    assert "file does not exist" in msg and "recipes/kimi-k2.yaml" in msg


# --------------------------------------------------------------------------- tp, bounds, dbo


def test_tp_split_dims_follow_the_cost_model():
    from tessera.config.model_checks import tp_split_dims
    from tessera.spec.presets import get_model

    assert tp_split_dims(get_model("qwen3-next-80b-a3b")) == (
        ("Gated DeltaNet key heads", 16), ("Gated DeltaNet value heads", 32), ("shared-expert FFN width", 512),
        ("attention query heads", 16), ("attention KV heads", 2), ("vocabulary", 151936))
    # routed experts are whole on every GPU (expert_ffn 2688 is absent); Mamba-2 groups and dense MLPs split
    assert tp_split_dims(get_model("nemotron-3-super-120b-a12b")) == (
        ("Mamba-2 heads", 128), ("Mamba-2 groups", 8), ("shared-expert FFN width", 5376),
        ("attention query heads", 32), ("attention KV heads", 2), ("vocabulary", 131072))


def test_tp_must_divide_heads_and_widths():
    msg = _err(QWEN, ["parallel.tp=3"])
    assert msg.startswith("parallel.tp=3: must divide the 16 Gated DeltaNet key heads of qwen3-next-80b-a3b")
    assert msg.endswith("fix: use parallel.tp=1 or 2")
    msg = _err(QWEN, ["parallel.tp=4"])
    assert msg.startswith("parallel.tp=4: must divide the 2 attention KV heads of qwen3-next-80b-a3b (")
    r = load_recipe(QWEN, ["parallel.tp=2"])
    validate_recipe(r, resolve_model(r))
    r = load_recipe(str(RECIPES / "deepseek-v3.yaml"), ["parallel.tp=8"])  # MLA: 128 heads, no KV heads
    validate_recipe(r, resolve_model(r))


@pytest.mark.parametrize("override,start", [
    ("parallel.num_microbatches=100000000", "parallel.num_microbatches=100000000: must be <= 4096 ("),
    ("parallel.seq_length=2000000", "parallel.seq_length=2000000: must be <= 1048576 ("),
    ("parallel.vpp=65", "parallel.vpp=65: must be <= 64 ("),
    ("parallel.dp=70000", "parallel.dp=70000: must be <= 65536 ("),
    ("parallel.tp=129", "parallel.tp=129: must be <= 128 ("),
    ("planner.candidate_radius=5", "planner.candidate_radius=5: must be <= 4 ("),
])
def test_bounds_name_the_limit(override, start):
    assert _err(QWEN, [override]).startswith(start)


def test_the_limits_themselves_are_valid():
    r = load_recipe(QWEN, ["parallel.num_microbatches=4096"])  # the measured worst case (docs/recipes.md)
    validate_recipe(r, resolve_model(r))
    msg = _err(str(RECIPES / "qwen3-235b.yaml"), ["parallel.num_microbatches=4096"])
    assert msg.startswith("parallel.num_microbatches=4096: num_layers*num_microbatches = 94*4096 = 385024 exceeds 262144")
    assert msg.endswith("fix: use parallel.num_microbatches=256, 512, 1024 or 2048")


def test_inline_model_sizes_are_checked():
    base = {"name": "p", "pattern": "*E", "hidden": 64, "vocab": 256,
            "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn": 32}}
    def msg(**change):
        d = {**base, **change}
        with pytest.raises(TesseraConfigError) as ei:
            r = recipe_from_dict({"model": {"inline": d}})
            validate_recipe(r, resolve_model(r))
        return str(ei.value)
    assert msg(hidden=0).startswith("model.inline.hidden=0: must be in 1..16777216")
    assert msg(vocab=2**30).startswith("model.inline.vocab=1073741824: must be in 1..16777216")
    assert msg(attention={"num_heads": -4, "num_kv_heads": 2, "head_dim": 16}).startswith(
        "model.inline.layers[0].mixer.num_heads=-4: must be in 1..")
    assert msg(moe={"num_experts": 4, "top_k": 5, "expert_ffn": 32}).startswith(
        "model.inline.layers[1].mlp.top_k=5: must be <= num_experts=4")
    assert msg(pattern="*E" * 600).startswith("model.inline.pattern=1200: more than 1024 layers")
    assert msg(mtp_layers=100).startswith("model.inline.mtp_layers=100: must be in 0..16")
    # the router's own fields: a softmax router would ignore what only the sigmoid router reads
    moe = {"num_experts": 4, "top_k": 2, "expert_ffn": 32}
    assert msg(moe={**moe, "router": "topk"}).startswith("model.inline.layers[1].mlp.router='topk': must be 'softmax'")
    assert msg(moe={**moe, "routed_scaling": 2.5}).startswith(
        "model.inline.layers[1].mlp.routed_scaling=2.5: is read by the sigmoid (DeepSeek-V3) router only")
    assert msg(moe={**moe, "num_groups": 2}).startswith("model.inline.layers[1].mlp.num_groups=2: is read by the sigmoid")
    assert msg(moe={**moe, "router": "sigmoid", "num_groups": 3}).startswith(
        "model.inline.layers[1].mlp.num_groups=3: must divide num_experts=4")
    assert msg(moe={**moe, "router": "sigmoid", "num_groups": 2, "topk_groups": 3}).startswith(
        "model.inline.layers[1].mlp.topk_groups=3: must be <= num_groups=2")
    assert msg(moe={**moe, "router": "sigmoid", "num_groups": 4}).startswith(
        "model.inline.layers[1].mlp.num_groups=4: a group's score is its two best experts'")


def test_dbo_enabled_is_accepted_and_its_knobs_stay_validated():
    r = load_recipe(QWEN, ["dbo.enabled=true"])
    validate_recipe(r, resolve_model(r))  # the engine and the simulator run it (docs/dbo.md)
    assert _err(QWEN, ["dbo.routing=sticky"]).startswith("dbo.routing='sticky': must be one of ('uniform', 'zipf'")
    assert _err(QWEN, ["dbo.routing=recorded"]).startswith("dbo.counts_path='': must name the recorded token-count")
    assert _err(QWEN, ["dbo.pool_mem_gb=-1"]).startswith("dbo.pool_mem_gb=-1.0: must be a finite number >= 0")
    assert _err(QWEN, ["dbo.margin=-0.5"]).startswith("dbo.margin=-0.5: must be a finite number >= 0")


def test_a_shipped_recipe_loads_by_name_from_any_directory(tmp_path, monkeypatch):
    """A bare name, a file name or the docs' recipes/<file> loads the shipped recipe when no such
    file exists here; a local file of that name wins; an unknown name stays the one-line error."""
    from tessera.config.load import SHIPPED_RECIPES, load_recipe, shipped_recipe
    from tessera.errors import TesseraConfigError

    monkeypatch.chdir(tmp_path)
    for name in ("qwen3-next-80b", "qwen3-next-80b.yaml", "recipes/qwen3-next-80b.yaml"):
        assert shipped_recipe(name) == str(SHIPPED_RECIPES / "qwen3-next-80b.yaml")
        assert load_recipe(name).name == "qwen3-next-80b"
    assert shipped_recipe("other/qwen3-next-80b.yaml") is None and shipped_recipe("nope") is None
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "qwen3-next-80b.yaml").write_text("name: mine\n")
    assert load_recipe("recipes/qwen3-next-80b.yaml").name == "mine"
    with pytest.raises(TesseraConfigError, match="recipe='nope': file does not exist"):
        load_recipe("nope")


# --------------------------------------------------------------------------- the shipped recipes

SHIPPED = sorted(p.name for p in RECIPES.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_simulates_within_memory(name):
    """Every recipe in recipes/ passes every value rule, its baseline plan the memory rule on
    every rank, and it simulates (``tessera simulate``'s flow)."""
    from tessera.config.validate import capacity_gb
    from tessera.flow import simulate_recipe

    run = simulate_recipe(load_recipe(str(RECIPES / name)))
    p = run.resolved.recipe.parallel
    assert len(run.memory_gb) == p.pp and max(run.memory_gb) <= capacity_gb(run.resolved.recipe, run.resolved.hardware)
    assert run.summary()["iteration_ms"] > 0


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-nemotron-h", "tiny-qwen3-moe", "tiny-qwen3-next"])
def test_tiny_recipes_run_their_preset_on_four_cpu_workers(name):
    r = load_recipe(str(RECIPES / f"{name}.yaml"))
    assert (r.name, r.model.preset, r.hardware.preset) == (name, name, "cpu")
    assert (r.parallel.pp, r.parallel.vpp, r.parallel.ep, r.parallel.dp, r.parallel.tp) == (2, 2, 2, 2, 1)


@pytest.mark.parametrize("name,gpus", [("deepseek-v3-8xh100", 8), ("qwen3-next-80b-16xh100", 16)])
def test_h100_node_recipes_fit_their_nodes_as_their_comments_say(name, gpus):
    """The 8- and 16-GPU H100 recipes: pp*dp GPUs, expert-parallel groups inside a node, every
    pipeline rank's peak memory under 80 GB, and the baseline peaks their comment block quotes."""
    import re

    from tessera.flow import simulate_recipe

    path = RECIPES / f"{name}.yaml"
    run = simulate_recipe(load_recipe(str(path)))
    r, hw = run.resolved.recipe, run.resolved.hardware
    p = r.parallel
    assert hw.name == "h100-sxm" and p.pp * p.dp * p.tp == gpus and p.ep <= hw.gpus_per_node
    assert max(run.memory_gb) < 80.0, run.memory_gb
    quoted = re.search(r"`tessera simulate` \(the baseline plan\): peak memory ([\d.]+) / ([\d.]+) GB", path.read_text())
    assert quoted and tuple(float(x) for x in quoted.groups()) == tuple(round(m, 1) for m in run.memory_gb), (
        quoted and quoted.groups(), run.memory_gb)


def test_the_cut_deepseek_v3_keeps_its_layer_kinds():
    """recipes/deepseek-v3-8xh100.yaml: fewer layers and experts than the deepseek-v3 preset, the
    same layer kinds and dims (MLA, the first 3 layers dense, sigmoid-routed MoE with groups,
    top-8, an ungated shared expert), no MTP module (the engine builds none)."""
    import dataclasses

    from tessera.spec.presets import get_model

    cut = resolve_model(load_recipe(str(RECIPES / "deepseek-v3-8xh100.yaml")))
    full = get_model("deepseek-v3")
    assert (cut.num_layers, cut.moe.num_experts) == (12, 32) and cut.kinds == " ".join(["LF"] * 3 + ["LE"] * 9)
    assert full.kinds.startswith(cut.kinds) and cut.family == full.family == "deepseek_v3"
    assert {l.mixer for l in cut.layers} == {full.layers[0].mixer}
    assert cut.layers[0].mlp == full.layers[0].mlp
    assert cut.moe == dataclasses.replace(full.moe, num_experts=32)
    assert (cut.hidden, cut.vocab, cut.rope_theta, cut.max_positions) == (
        full.hidden, full.vocab, full.rope_theta, full.max_positions)
    assert (cut.mtp_layers, full.mtp_layers) == (0, 1)
