"""Read and write Hugging Face Qwen3-Next checkpoint directories (``config.json`` + safetensors).

* :func:`~tessera.config.train_rules.check_hf_dir`: the ``train.init_from`` rule (a directory
  with ``config.json`` and at least one ``*.safetensors`` file);
* :func:`load_into_stages`: the job start with ``train.init_from`` (:mod:`tessera.train.worker.loop`):
  every rank reads only the tensors of the stages it holds (safetensors' lazy ``safe_open``),
  after checking the whole directory's tensor names and shapes (file headers only) against the
  recipe's model: a missing, unexpected or misshapen tensor is an error, never a silent drop;
* :func:`export_state` / :func:`export_run`: the trained model as an HF directory that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads (``tessera export``), from named
  state or from a run's newest complete checkpoint, whatever its partition and EP size.

The name map and the config conversion are :mod:`tessera.model.hf`. Tensors keep their values
bitwise; a dtype change on load (e.g. a BF16 checkpoint into FP32 parameters) is ``copy_``'s cast.
Not read: ``mtp.*`` tensors (multi-token-prediction heads, which Tessera's executable model does
not build; transformers' ``Qwen3NextForCausalLM`` skips them on load too,
``_keys_to_ignore_on_load_unexpected``).
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

import torch

from tessera.config.train_rules import check_hf_dir
from tessera.errors import TesseraConfigError

CONFIG = "config.json"
FIELD = "train.init_from"
_IGNORED = re.compile(r"^mtp\.")
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class HFDir:
    """An HF checkpoint directory's index: ``config`` (config.json), ``files`` (tensor name ->
    safetensors file) and ``shapes`` (name -> shape), from the file headers only."""

    path: str
    config: dict
    files: dict[str, str]
    shapes: dict[str, tuple[int, ...]]


def open_hf_dir(path: str, field: str = FIELD) -> HFDir:
    """Index ``path`` (:class:`HFDir`); every ``*.safetensors`` file in it is read (headers).

    Raises:
        TesseraConfigError: :func:`~tessera.config.train_rules.check_hf_dir`'s rule, an
            unreadable config.json, or a tensor name in two files.
    """
    from safetensors import safe_open

    check_hf_dir(path, field)
    try:
        with open(os.path.join(path, CONFIG)) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TesseraConfigError(field, path, f"config.json is not readable JSON ({e})",
                                 "write it with save_pretrained") from None
    files, shapes = {}, {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in files:
                    raise TesseraConfigError(field, path, f"tensor {name} is in both {os.path.basename(files[name])} "
                                             f"and {os.path.basename(file)}", "keep one copy of each tensor")
                files[name], shapes[name] = file, tuple(f.get_slice(name).get_shape())
    return HFDir(path, config, files, shapes)


def _expected(model, d: HFDir) -> dict[str, tuple[int, ...]]:
    """The names and shapes the directory must hold: :func:`tessera.model.hf.hf_shapes`, without
    ``lm_head.weight`` when config.json ties it to the embedding, with each MoE layer's experts
    either per expert or stacked (whichever the directory has)."""
    from tessera.model.hf import hf_shapes

    want = hf_shapes(model)
    if d.config.get("tie_word_embeddings", False) and "lm_head.weight" not in d.shapes:
        del want["lm_head.weight"]
    prefixes = {m.group(1) for name in d.shapes if (m := _STACKED.fullmatch(name))}
    for prefix in prefixes:
        per = {n: s for n, s in want.items() if n.startswith(prefix + ".")}
        if not per:
            continue
        experts = 1 + max(int(_PER_EXPERT.fullmatch(n).group(2)) for n in per)
        ffn, hidden = per[f"{prefix}.0.gate_proj.weight"]
        for n in per:
            del want[n]
        want[f"{prefix}.gate_up_proj"] = (experts, 2 * ffn, hidden)
        want[f"{prefix}.down_proj"] = (experts, hidden, ffn)
    return want


def check_tensors(model, d: HFDir) -> None:
    """Every tensor ``model`` needs is in ``d`` with its shape, and ``d`` holds no other tensor
    (``mtp.*`` aside, module docstring).

    Raises:
        TesseraConfigError: naming the first missing, unexpected or misshapen tensor and the count.
    """
    want = _expected(model, d)
    have = {n: s for n, s in d.shapes.items() if not _IGNORED.match(n)}
    fix = "point train.init_from at a checkpoint of the recipe's model (same layers and dims)"
    missing = sorted(set(want) - set(have))
    if missing:
        raise TesseraConfigError(FIELD, d.path, f"lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]} "
                                 f"{want[missing[0]]}", fix)
    extra = sorted(set(have) - set(want))
    if extra:
        raise TesseraConfigError(FIELD, d.path, f"holds {len(extra)} tensor(s) the model has no place for, e.g. "
                                 f"{extra[0]} {have[extra[0]]}", fix)
    bad = sorted(n for n in want if tuple(want[n]) != tuple(have[n]))
    if bad:
        raise TesseraConfigError(FIELD, d.path, f"{len(bad)} tensor(s) have another shape, e.g. {bad[0]} is "
                                 f"{have[bad[0]]}, the model needs {want[bad[0]]}", fix)


def _read(d: HFDir, name: str, handles: dict) -> torch.Tensor:
    """One tensor of ``d``; a per-expert name absent from ``d`` is sliced from the stacked tensor."""
    from safetensors import safe_open

    m = _PER_EXPERT.fullmatch(name)
    src = name
    if name not in d.files and m is not None:
        prefix, e, proj = m.groups()
        src = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    if src not in d.files and name == "lm_head.weight":  # tied: the head is the embedding
        src = "model.embed_tokens.weight"
    file = d.files[src]
    if file not in handles:
        handles[file] = safe_open(file, framework="pt")
    f = handles[file]
    if src == name:
        return f.get_tensor(name)
    if src == "model.embed_tokens.weight":
        return f.get_tensor(src)
    piece = f.get_slice(src)
    e = int(m.group(2))
    if m.group(3) == "down_proj":
        return piece[e:e + 1][0]
    ffn = d.shapes[src][1] // 2
    rows = slice(0, ffn) if m.group(3) == "gate_proj" else slice(ffn, 2 * ffn)
    return piece[e:e + 1, rows][0]


def load_into_stages(path: str, modules, model) -> int:
    """Copy the HF checkpoint at ``path`` into this rank's stages ``modules``
    (:class:`~tessera.model.stage.StageModule` list; routed experts by their global ids): names and
    shapes of the whole directory are checked first (:func:`check_tensors`), then only this
    rank's tensors are read. Returns the number of parameters set (every one of ``modules``).

    Raises:
        TesseraConfigError: :func:`~tessera.config.train_rules.check_hf_dir`'s rule;
            config.json describes another model (:func:`tessera.model.hf.config_mismatch`); the
            model has no Qwen3-Next equivalent; a tensor is missing, unexpected or misshapen.
    """
    from tessera.model.hf import config_mismatch, stage_params

    d = open_hf_dir(path)
    why = config_mismatch(model, d.config)
    if why is not None:
        raise TesseraConfigError(FIELD, path, f"config.json describes another model: {why}",
                                 "point train.init_from at a checkpoint of the recipe's model, or make the recipe's "
                                 f"model that one (model.hf_config={os.path.join(path, CONFIG)})")
    check_tensors(model, d)
    handles: dict = {}
    count = 0
    with torch.no_grad():
        for m in modules:
            for name, p in stage_params(m).items():
                p.copy_(_read(d, name, handles))
                count += 1
    return count


def hf_state(named: dict[str, torch.Tensor], model, expert_offsets: dict[str, int] | None = None) -> dict:
    """HF name -> tensor of Tessera global-name tensors ``named`` (one EP rank's: experts under
    their EP-local ids, shifted by ``expert_offsets[layer prefix]``, ``"layers.<i>"`` -> offset;
    default 0)."""
    from tessera.model.hf import hf_name

    out = {}
    offsets = expert_offsets or {}
    for name, t in named.items():
        m = re.match(r"layers\.(\d+)\.", name)
        kind = model.layers[int(m.group(1))].mixer.kind if m else None
        out[hf_name(name, kind, offsets.get(m.group(0)[:-1], 0) if m else 0)] = t
    return out


_EXPORTED = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map)\.json$"
                       r"|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")
"""Names an export writes (an earlier export in ``--to`` is overwritten; anything else is refused)."""


def export_state(tensors: dict[str, torch.Tensor], model, to: str, max_shard_size: str = "5GB") -> list[str]:
    """Write ``tensors`` (HF names, :func:`hf_state`) with ``model``'s config as an HF directory
    ``to``: ``config.json`` (``Qwen3NextConfig.save_pretrained``), ``model.safetensors``
    (``huggingface_hub.save_torch_state_dict``: shards of at most ``max_shard_size`` plus
    ``model.safetensors.index.json`` when larger) and the byte-level tokenizer the model was
    trained with (``tokenizer.json``, ``tokenizer_config.json``:
    :func:`tessera.model.hf.save_byte_tokenizer`). Returns the files in ``to`` (sorted).

    Raises:
        TesseraConfigError: the model has no Qwen3-Next equivalent, or ``tensors`` lacks / adds a
            tensor or has another shape than the model (field ``export``); ``to`` holds files an
            export does not write (field ``--to``: nothing is written).
    """
    from huggingface_hub import save_torch_state_dict

    from tessera.model.hf import hf_shapes, qwen3_next_config, save_byte_tokenizer

    want = hf_shapes(model)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    bad = sorted(n for n in set(want) & set(tensors) if tuple(tensors[n].shape) != want[n])
    for what, names in (("lacks", missing), ("has no place for", extra), ("has another shape for", bad)):
        if names:
            raise TesseraConfigError("export", to, f"the state {what} {len(names)} tensor(s) of the model, e.g. "
                                     f"{names[0]}", "export a complete checkpoint of the run's model")
    others = sorted(f for f in (os.listdir(to) if os.path.isdir(to) else ()) if not _EXPORTED.match(f))
    if others:  # never write into, or list as ours, someone else's directory
        raise TesseraConfigError("--to", to, f"holds {len(others)} file(s) an export does not write, e.g. {others[0]}",
                                 "give a new or empty directory (a directory of an earlier export is fine)")
    os.makedirs(to, exist_ok=True)
    config = qwen3_next_config(model)
    config.dtype = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    config.save_pretrained(to)
    state = {n: tensors[n].detach().to("cpu").contiguous() for n in sorted(want)}
    save_torch_state_dict(state, to, max_shard_size=max_shard_size, safe_serialization=True)
    save_byte_tokenizer(to, model)
    return sorted(os.listdir(to))


def run_state(run_dir: str):
    """``(HF tensors, model spec dict or None, CheckpointInfo)`` of the newest complete checkpoint
    of ``run_dir``: for each EP rank, the parts of its first replica's pipeline group
    (:func:`tessera.train.upgrade.reshard.state_from_parts`), experts shifted to their global ids.

    Raises:
        TesseraConfigError: no complete checkpoint in ``run_dir`` (field ``RUN_DIR``).
    """
    from tessera.train.worker.checkpoint import latest_complete, load_part
    from tessera.train.upgrade.entries import PARAM
    from tessera.train.upgrade.reshard import state_from_parts

    info = latest_complete(run_dir)
    if info is None:
        raise TesseraConfigError("RUN_DIR", run_dir, "has no complete checkpoint (step_*/ with every rank's marker)",
                                 "train with train.checkpoint_every > 0 (or to the last step), then export")
    pp, _dp, ep = info.layout
    named: dict[int, dict[str, torch.Tensor]] = {}
    spec = None
    for ep_rank in range(ep):
        parts = [load_part(info.path, ep_rank * pp + p)["state"] for p in range(pp)]  # replica ep_rank
        spec = spec or next((s.get("model") for s in parts if s.get("model")), None)
        named[ep_rank] = {n: e[PARAM] for n, e in state_from_parts(parts).items()}
    return named, spec, info


def export_run(run_dir: str, to: str, model=None) -> tuple[list[str], object]:
    """Export the newest complete checkpoint of ``run_dir`` (:func:`run_state`) to ``to``
    (:func:`export_state`). ``model``: the run's ModelSpec; default the one the checkpoint
    records (``EngineStepRunner.state_dict()["model"]``). Returns ``(files, CheckpointInfo)``.

    Raises:
        TesseraConfigError: no complete checkpoint; no model given and none recorded (field
            ``--recipe``); the model has no Qwen3-Next equivalent or does not match the state.
    """
    from tessera.spec.model import ModelSpec

    named, spec, info = run_state(run_dir)
    if model is None:
        if spec is None:
            raise TesseraConfigError("--recipe", None, f"checkpoint {info.path} does not record its model",
                                     "pass the run's recipe: tessera export RUN_DIR --to PATH --recipe RECIPE")
        model = ModelSpec.from_dict(spec)
    tensors: dict[str, torch.Tensor] = {}
    ep = len(named)
    moe = model.moe
    local = moe.num_experts // ep if moe is not None else 0
    for ep_rank, state in named.items():
        offsets = {f"layers.{l.index}": ep_rank * local for l in model.layers}
        for n, t in hf_state(state, model, offsets).items():
            if ep_rank == 0 or ".mlp.experts." in n:
                tensors[n] = t
    return export_state(tensors, model, to), info
