"""Token counts from the real router: per-expert counts of a forward pass on the training data.

:func:`record_router_counts` builds the recipe's model in one process (embedding and every
decoder layer, all experts local, weights from ``train.seed`` exactly as the job builds them:
they depend only on the seed and the layer index), takes the batches the job's first EP group
trains on (the replicas ``0 .. ep-1`` of ``train.data``, :func:`tessera.train.worker.data.shard_for`)
and runs each microbatch forward under ``torch.no_grad``. Every MoE layer's router
(:meth:`tessera.model.moe.MoEBlock.route`, DeepSpeed's TopKGate) reports ``requested``: the
routes per expert before capacity dropping (what the DBO predicts from; equal to what dispatch
sends in the dropless default). Per (microbatch, MoE layer) the EP group's replicas are summed,
so each row sums to ``ep * micro_batch_size * seq_length * top_k`` (the
:class:`~tessera.dbo.counts.TokenCounts` convention, as :func:`tessera.sim.dbo.recipe_counts`).

``steps`` iterations give ``steps * num_microbatches`` rows (iteration ``s``'s microbatch ``m``
is row ``s * num_microbatches + m``); the weights stay the initial ones (a forward pass only), so
the counts are the router's at the job's first step. ``dbo.routing=recorded`` with
``dbo.counts_path`` pointing at the written file makes the job and ``tessera simulate`` predict
from them (the first ``num_microbatches`` rows).

Command line::

    python -m tessera.train.profile.routes [RECIPE] [OVERRIDES ...] --steps N --out FILE
"""

from __future__ import annotations

import argparse
import sys

import torch

from tessera.dbo.counts import TokenCounts


def _record_routes(module) -> dict[int, list[torch.Tensor]]:
    """Wrap the ``route`` of every MoE block of ``module`` (on the instance only) to append its
    ``requested`` counts (int64 ``[E]``) to the returned ``{decoder layer: [...]}``."""
    seen: dict[int, list[torch.Tensor]] = {}
    for layer in module.layers:
        block = getattr(layer, "moe", None)
        if block is None:
            continue
        rows = seen.setdefault(layer.index, [])

        def route(tokens, residual, _orig=block.route, _rows=rows):
            info = _orig(tokens, residual)
            _rows.append(info.requested.detach().to("cpu", torch.int64).clone())
            return info

        block.route = route
    return seen


def record_router_counts(recipe, steps: int = 1, *, model=None) -> TokenCounts:
    """The real router's token counts on ``recipe``'s training data (module docstring).

    Args:
        recipe: a Recipe (``model``, ``parallel``: ``ep``, ``num_microbatches``,
            ``micro_batch_size``, ``seq_length``; ``train.data``, ``train.seed``).
        steps: iterations to record (>= 1).
        model: the resolved ModelSpec (default: resolved from the recipe).

    Returns:
        :class:`TokenCounts` with ``steps * num_microbatches`` microbatches, one entry per MoE
        layer (decoder index, ascending); ``source`` names the recipe, data and seed.

    Raises:
        ValueError: ``steps`` < 1, or the model has no MoE layer.
        TesseraConfigError: as the data source and the model builder (unreadable ``train.data``,
            a layer kind the engine does not build).
    """
    from tessera.model.stage import StageModule
    from tessera.train.worker.data import shard_for

    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1 (iterations to record)")
    if model is None:
        from tessera.config.resolve import resolve_model

        model = resolve_model(recipe)
    p = recipe.parallel
    moe = [l for l in model.layers if getattr(l.mlp, "kind", None) == "moe"]
    if not moe:
        raise ValueError(f"model {model.name} has no MoE layer: there are no router counts to record")
    num_experts = moe[0].mlp.num_experts
    net = StageModule(model, (-1, model.num_layers), seed=recipe.train.seed, split_w=False)
    seen = _record_routes(net)
    shards = [shard_for(recipe, r) for r in range(p.ep)]  # the first EP group's replicas
    table = []
    with torch.no_grad():
        for _ in range(steps):
            batches = [s.next_batch() for s in shards]  # [M, mbs, S + 1] per replica
            for mb in range(p.num_microbatches):
                for rows in seen.values():
                    rows.clear()
                for tokens in batches:
                    net(tokens[mb, :, :-1])
                per_layer = []
                for layer in sorted(seen):
                    total = torch.stack(seen[layer]).sum(0)
                    per_layer.append(tuple(int(c) for c in total.tolist()))
                table.append(tuple(per_layer))
    source = f"router {model.name} data={recipe.train.data} seed={recipe.train.seed} ep={p.ep} steps={steps}"
    return TokenCounts(tuple(sorted(seen)), num_experts, tuple(table), source)


def main(argv=None) -> int:
    """``python -m tessera.train.profile.routes [RECIPE] [OVERRIDES] --steps N --out FILE``:
    write :meth:`TokenCounts.to_json` of :func:`record_router_counts` to ``FILE`` and print the
    skew (:func:`tessera.dbo.counts.skew_max_over_mean` at ``parallel.ep``) on stderr."""
    from tessera.config.load import load_recipe
    from tessera.dbo.counts import skew_max_over_mean
    from tessera.errors import TesseraConfigError

    ap = argparse.ArgumentParser(prog="python -m tessera.train.profile.routes",
                                 description="Record the real router's per-expert token counts (JSON for "
                                             "dbo.routing=recorded, dbo.counts_path=FILE).")
    ap.add_argument("args", nargs="*", help="recipe file or shipped name (optional), then key=value overrides")
    ap.add_argument("--steps", type=int, default=1, help="iterations to record (default 1)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ns = ap.parse_args(argv)
    path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = ns.args[1:] if path is not None else ns.args
    try:
        recipe = load_recipe(path, overrides)
        counts = record_router_counts(recipe, ns.steps)
    except (TesseraConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(ns.out, "w") as f:
        f.write(counts.to_json())
    ep = recipe.parallel.ep
    skew = skew_max_over_mean(counts, ep) if ep > 1 else 1.0
    print(f"{ns.out}: {counts.num_microbatches} microbatches x {len(counts.layers)} MoE layers x "
          f"{counts.num_experts} experts; skew max/mean at ep={ep}: {skew:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
