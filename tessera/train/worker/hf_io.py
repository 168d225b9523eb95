"""Read and write Hugging Face checkpoint directories (``config.json`` + safetensors) of every
model family Tessera builds (Qwen3-Next, Qwen3-MoE, DeepSeek-V3, Nemotron-H: :mod:`tessera.model.hf`).

* :func:`~tessera.config.train_rules.check_hf_dir`: the ``train.init_from`` rule (a directory
  with ``config.json`` and at least one ``*.safetensors`` file);
* :func:`load_into_stages`: the job start with ``train.init_from`` (:mod:`tessera.train.worker.loop`):
  every rank reads only the tensors of the stages it holds (safetensors' lazy ``safe_open``),
  after checking the whole directory's tensor names and shapes (file headers only) against the
  recipe's model: a missing, unexpected or misshapen tensor is an error, never a silent drop;
* :func:`export_state` / :func:`export_run`: the trained model as an HF directory that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads (``tessera export``), from named
  state or from a run's newest complete checkpoint, whatever its partition and EP size.

The name map and the config conversion are :mod:`tessera.model.hf`, per family. Tensors keep
their values bitwise; a dtype change on load (e.g. a BF16 checkpoint into FP32 parameters) is
``copy_``'s cast. The tensors are the stages' parameters and persistent buffers (the sigmoid
router's ``e_score_correction_bias``). Routed experts are read per expert or from transformers
5's stacked layout (``experts.gate_up_proj [E, 2I, H]`` / ``experts.up_proj [E, I, H]`` and
``experts.down_proj [E, H, I]``), whichever the directory has; Nemotron-H names may start with
``backbone.`` (``save_pretrained``) or ``model.`` (transformers' in-memory names). Not read, with
a note on the ranks that hold the head: multi-token-prediction tensors (``mtp.*``; DeepSeek's
``model.layers.<L>.*`` after the last layer), which Tessera's executable model does not build;
transformers skips them on load too (``_keys_to_ignore_on_load_unexpected``).
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
_STACKED = re.compile(r"(.+\.experts)\.(gate_up_proj|up_proj|down_proj)")
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_ROUTED = re.compile(r".+\.experts\.\d+\..+")


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


def _names(model, d: HFDir) -> dict[str, str]:
    """The directory's tensors a model of ``model``'s family reads: name in
    :func:`tessera.model.hf.hf_name`'s spelling (:func:`tessera.model.hf.canonical`) -> name in
    the files; skipped tensors (:func:`tessera.model.hf.ignored`) left out."""
    from tessera.model.hf import canonical, ignored

    return {canonical(model, n): n for n in d.shapes if not ignored(model, n)}


def _expected(model, d: HFDir) -> dict[str, tuple[int, ...]]:
    """The names and shapes the directory must hold: :func:`tessera.model.hf.hf_shapes`, without
    ``lm_head.weight`` when config.json ties it to the embedding, with each MoE layer's experts
    either per expert or stacked (whichever the directory has)."""
    from tessera.model.hf import hf_shapes

    want = hf_shapes(model)
    have = _names(model, d)
    if d.config.get("tie_word_embeddings", False) and "lm_head.weight" not in have:
        del want["lm_head.weight"]
    prefixes = {m.group(1) for name in have if (m := _STACKED.fullmatch(name))}
    for prefix in prefixes:
        per = {n: s for n, s in want.items() if n.startswith(prefix + ".")}
        if not per:
            continue
        experts = 1 + max(int(_PER_EXPERT.fullmatch(n).group(2)) for n in per)
        ffn, hidden = per[f"{prefix}.0.up_proj.weight"]
        for n in per:
            del want[n]
        if f"{prefix}.0.gate_proj.weight" in per:  # SwiGLU experts: gate rows, then up rows
            want[f"{prefix}.gate_up_proj"] = (experts, 2 * ffn, hidden)
        else:  # Nemotron-H's up/down experts
            want[f"{prefix}.up_proj"] = (experts, ffn, hidden)
        want[f"{prefix}.down_proj"] = (experts, hidden, ffn)
    return want


def check_tensors(model, d: HFDir) -> list[str]:
    """Every tensor ``model`` needs is in ``d`` with its shape, and ``d`` holds no other tensor
    (multi-token-prediction tensors aside, module docstring). Returns those skipped (sorted).

    Raises:
        TesseraConfigError: naming the first missing, unexpected or misshapen tensor and the count.
    """
    want = _expected(model, d)
    names = _names(model, d)
    have = {n: d.shapes[src] for n, src in names.items()}
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
    return sorted(set(d.shapes) - set(names.values()))


def _read(d: HFDir, name: str, handles: dict, names: dict[str, str], embed: str) -> torch.Tensor:
    """One tensor of ``d`` by its :func:`tessera.model.hf.hf_name` (``names``: :func:`_names`;
    ``embed``: the embedding's name, the head of a tied checkpoint); a per-expert name absent
    from ``d`` is sliced from the stacked tensor."""
    from safetensors import safe_open

    m = _PER_EXPERT.fullmatch(name)
    src = name
    if name not in names and m is not None:
        prefix, _, proj = m.groups()
        stacked = "gate_up_proj" if f"{prefix}.gate_up_proj" in names else "up_proj"
        src = f"{prefix}.{'down_proj' if proj == 'down_proj' else stacked}"
    if src not in names and name == "lm_head.weight":  # tied: the head is the embedding
        src = embed
    disk = names[src]
    file = d.files[disk]
    if file not in handles:
        handles[file] = safe_open(file, framework="pt")
    f = handles[file]
    if src == name or src == embed:
        return f.get_tensor(disk)
    piece = f.get_slice(disk)
    e = int(m.group(2))
    if m.group(3) == "down_proj" or src.endswith(".up_proj"):
        return piece[e:e + 1][0]
    ffn = d.shapes[disk][1] // 2
    rows = slice(0, ffn) if m.group(3) == "gate_proj" else slice(ffn, 2 * ffn)
    return piece[e:e + 1, rows][0]


def load_into_stages(path: str, modules, model) -> int:
    """Copy the HF checkpoint at ``path`` into this rank's stages ``modules``
    (:class:`~tessera.model.stage.StageModule` list; routed experts by their global ids): names and
    shapes of the whole directory are checked first (:func:`check_tensors`), then only this
    rank's tensors are read. Returns the number of tensors set (every parameter and persistent
    buffer of ``modules``). Skipped multi-token-prediction tensors are named in one line on
    stdout by the ranks that hold the head.

    Raises:
        TesseraConfigError: :func:`~tessera.config.train_rules.check_hf_dir`'s rule;
            config.json describes another model (:func:`tessera.model.hf.config_mismatch`); the
            model has no HF equivalent in its family; a tensor is missing, unexpected or misshapen.
    """
    from tessera.model.hf import config_mismatch, hf_name, stage_params

    d = open_hf_dir(path)
    why = config_mismatch(model, d.config)
    if why is not None:
        raise TesseraConfigError(FIELD, path, f"config.json describes another model: {why}",
                                 "point train.init_from at a checkpoint of the recipe's model, or make the recipe's "
                                 f"model that one (model.hf_config={os.path.join(path, CONFIG)})")
    skipped = check_tensors(model, d)
    if skipped and any(getattr(m, "head", None) is not None for m in modules):
        print(f"tessera: {FIELD}: skipped {len(skipped)} multi-token-prediction tensor(s) (e.g. {skipped[0]}): "
              "Tessera does not build MTP heads", flush=True)
    names, embed = _names(model, d), hf_name("embed.weight", None, family=model.family)
    handles: dict = {}
    count = 0
    with torch.no_grad():
        for m in modules:
            for name, p in stage_params(m).items():
                p.copy_(_read(d, name, handles, names, embed))
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
        mixer = model.layers[int(m.group(1))].mixer if m else None
        kind = mixer.kind if mixer is not None else None
        out[hf_name(name, kind, offsets.get(m.group(0)[:-1], 0) if m else 0, model.family)] = t
    return out


_EXPORTED = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens)\.json$"
                       r"|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$"
                       r"|chat_template\.jinja$|vocab\.(json|txt)$|merges\.txt$|tokenizer\.model$")
"""Names an export writes (an earlier export in ``--to`` is overwritten; anything else is refused)."""


def export_state(tensors: dict[str, torch.Tensor], model, to: str, max_shard_size: str = "5GB",
                 tokenizer: str | None = None) -> list[str]:
    """Write ``tensors`` (HF names, :func:`hf_state`) with ``model``'s config as an HF directory
    ``to``: ``config.json`` (the family's config, :func:`tessera.model.hf.hf_config`), ``model.safetensors``
    (``huggingface_hub.save_torch_state_dict``: shards of at most ``max_shard_size`` plus
    ``model.safetensors.index.json`` when larger) and the tokenizer the model was trained with:
    ``tokenizer``, a run's saved tokenizer directory
    (:func:`tessera.train.worker.tokenizer.export_tokenizer`), or for None the byte-level one
    (``tokenizer.json``, ``tokenizer_config.json``: :func:`tessera.model.hf.save_byte_tokenizer`).
    Returns the files in ``to`` (sorted).

    Raises:
        TesseraConfigError: the model has no HF equivalent, or ``tensors`` lacks / adds a
            tensor or has another shape than the model (field ``export``); ``to`` holds files an
            export does not write (field ``--to``: nothing is written).
    """
    from huggingface_hub import save_torch_state_dict

    from tessera.model.hf import hf_config, hf_name, hf_shapes, save_byte_tokenizer

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
    config = hf_config(model)
    config.dtype = str(tensors[hf_name("embed.weight", None, family=model.family)].dtype).removeprefix("torch.")
    config.save_pretrained(to)
    state = {n: tensors[n].detach().to("cpu").contiguous() for n in sorted(want)}
    save_torch_state_dict(state, to, max_shard_size=max_shard_size, safe_serialization=True)
    if tokenizer is None:
        save_byte_tokenizer(to, model)
    else:
        from tessera.train.worker.tokenizer import export_tokenizer

        export_tokenizer(tokenizer, to, model)
    return sorted(os.listdir(to))


def run_state(run_dir: str):
    """``(HF tensors, model spec dict or None, CheckpointInfo)`` of the newest complete checkpoint
    of ``run_dir``: for each EP rank, the parts of its first replica's pipeline group
    (:func:`tessera.train.upgrade.reshard.state_from_parts`), experts shifted to their global ids.

    Raises:
        TesseraConfigError: ``run_dir`` does not exist, or holds no complete checkpoint (field
            ``RUN_DIR``).
    """
    from tessera.train.worker.checkpoint import latest_complete, load_part
    from tessera.train.upgrade.entries import PARAM
    from tessera.train.upgrade.reshard import state_from_parts

    from tessera.train import storage

    if not storage.is_dir(run_dir):  # a local path or an s3:// / gs:// URI
        raise TesseraConfigError("RUN_DIR", run_dir, "does not exist (or is not a directory)",
                                 "give a run directory: <logging.out_dir>/<run name>, as tessera train prints it")
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
    """Export the newest complete checkpoint of ``run_dir`` (a local path or an ``s3://`` /
    ``gs://`` URI: :mod:`tessera.train.storage`; :func:`run_state`) to the local directory ``to``
    (:func:`export_state`), with the tokenizer the run trained with (the copy the run directory
    keeps, :func:`tessera.train.worker.tokenizer.run_tokenizer`; none: byte level). ``model``:
    the run's ModelSpec; default the one the checkpoint records
    (``EngineStepRunner.state_dict()["model"]``). Returns ``(files, CheckpointInfo)``.

    Raises:
        TesseraConfigError: no complete checkpoint; no model given and none recorded (field
            ``--recipe``); the model has no HF equivalent or does not match the state.
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
            if ep_rank == 0 or _ROUTED.fullmatch(n):
                tensors[n] = t
    from tessera.train import storage
    from tessera.train.worker.tokenizer import run_tokenizer

    tokenizer = run_tokenizer(run_dir)
    if tokenizer is None or not storage.is_remote(tokenizer):
        return export_state(tensors, model, to, tokenizer=tokenizer), info
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tessera-tokenizer-") as tmp:  # AutoTokenizer reads a local directory
        local = os.path.join(tmp, "tokenizer")
        storage.download(tokenizer, local)
        return export_state(tensors, model, to, tokenizer=local), info
