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
