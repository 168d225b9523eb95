"""What every ``tessera`` subcommand shares: the recipe arguments, loading the recipe they name,
the output directory, and the exit codes (0 ok; 2 bad input: one line on stderr)."""

from __future__ import annotations

import argparse
import os

EXIT_OK, EXIT_USAGE = 0, 2


def add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """``RECIPE [overrides...]``: shared by subcommands that take a recipe."""
    p.add_argument("recipe", metavar="RECIPE", nargs="?", default="default",
                   help="recipe YAML (e.g. recipes/qwen3-next-80b.yaml; a shipped recipe also by its name, e.g. "
                        "qwen3-next-80b, from any directory); 'default' or omitted: the shipped recipes/tiny-qwen3-next.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="omegaconf dotlist overrides, e.g. parallel.pp=8 parallel.vpp=2")


def load_cli_recipe(args: argparse.Namespace):
    """The Recipe named by ``args.recipe`` with ``args.overrides`` applied."""
    from tessera.config.load import load_recipe

    recipe, overrides = args.recipe, list(args.overrides)
    if "=" in recipe and not os.path.exists(recipe):  # `tessera simulate parallel.pp=2`: no recipe given
        recipe, overrides = "default", [recipe] + overrides
    return load_recipe(None if recipe == "default" else recipe, overrides)


def output_dir(args: argparse.Namespace, recipe) -> str:
    """``--out`` if given, else ``logging.out_dir/<recipe name>`` (an object-store
    ``logging.out_dir``: its local stand-in on this machine, :func:`tessera.config.storage_rules.local_dir`)."""
    from tessera.config.storage_rules import local_dir

    return args.out or os.path.join(local_dir(recipe.logging.out_dir), recipe.name)


def cost_options_line(settings: dict) -> str:
    """The "cost options" row of ``tessera simulate`` and ``tessera plan``: a
    :func:`tessera.config.cost_rules.cost_settings` dict in one line, e.g. ``bf16; cuda graphs:
    none; routing: balanced`` or ``fp8 (tensorwise); cuda graphs: attn, moe_router; routing:
    dropless 1.30`` (the busiest EP rank's load over the mean)."""
    prec = settings["precision"] + (f" ({settings['fp8_recipe']})" if settings["fp8_recipe"] else "")
    graphs = ", ".join(settings["cuda_graphs"]) or "none"
    routing = settings["moe_routing"]
    if routing != "balanced":
        routing += f" {settings['moe_max_over_mean']:.2f}"
    return f"{prec}; cuda graphs: {graphs}; routing: {routing}"
