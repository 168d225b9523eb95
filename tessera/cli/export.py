"""``tessera export RUN_DIR --to PATH [--recipe RECIPE [KEY=VALUE ...]]``: the trained model of a
run as a Hugging Face directory of its model family (Qwen3-Next, Qwen3-MoE, DeepSeek-V3,
Nemotron-H: ``config.json`` + ``model.safetensors``, :mod:`tessera.model.hf`) that
``transformers.AutoModelForCausalLM.from_pretrained(PATH)`` loads, with the tokenizer the run
trained on (``tokenizer.json`` + ``tokenizer_config.json``) that
``transformers.AutoTokenizer.from_pretrained(PATH)`` loads offline: the run's ``train.tokenizer``
as the run directory keeps it (:func:`tessera.train.worker.tokenizer.export_tokenizer`), or the
byte-level one (:func:`tessera.model.hf.save_byte_tokenizer`).

The weights come from the run's newest complete checkpoint, whatever its partition and EP size
(:func:`tessera.train.worker.hf_io.export_run`; the run directory local or on object storage,
``s3://`` / ``gs://``); the model from the checkpoint itself, or from
``--recipe`` (the recipe the run trained, for checkpoints that do not record it). Prints one
line, ``tessera export: RUN_DIR step S -> PATH (N tensors, FILES)``; bad input (no complete
checkpoint, a model without an HF equivalent in its family) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os

from tessera.cli.common import EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``tessera export``."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds step_*/ checkpoints), e.g. "
                                                      "out/tiny-qwen3-next/tiny-qwen3-next-20260101-120000, or on "
                                                      "object storage s3://BUCKET/PATH/<run> / gs://...")
    p.add_argument("--to", required=True, metavar="PATH", help="the Hugging Face directory to write (created)")
    p.add_argument("--recipe", metavar="RECIPE", default=None,
                   help="the run's recipe (default: the model recorded in the checkpoint)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of --recipe, e.g. model.num_layers=4")


def run(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from tessera.errors import TesseraConfigError
    from tessera.train.worker.hf_io import export_run

    model = None
    if args.recipe is not None:
        from tessera.cli.common import load_cli_recipe
        from tessera.config.resolve import resolve_model

        model = resolve_model(load_cli_recipe(argparse.Namespace(recipe=args.recipe,
                                                                 overrides=list(args.overrides or ()))))
    elif args.overrides:
        raise TesseraConfigError("KEY=VALUE", " ".join(args.overrides), "overrides apply to --recipe only",
                                 "give --recipe RECIPE before them, or drop them")
    files, info = export_run(args.run_dir, args.to, model)
    count = 0
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(args.to, name), framework="pt") as f:
                count += len(list(f.keys()))
    print(f"tessera export: {args.run_dir} step {info.step} -> {args.to} ({count} tensors, {', '.join(files)})")
    return EXIT_OK
