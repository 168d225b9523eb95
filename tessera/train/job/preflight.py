"""Pre-flight checks of a training job: everything that can be checked before Ray starts.

``tessera train``, ``python -m tessera.launch`` and ``ray job submit -- python -m tessera.launch``
all call :func:`preflight` (the launcher once before it connects to Ray, with the resources of
the cluster it is about to start when it starts one, and :func:`tessera.train.job.run.run_job` again
once connected, with the cluster's own resources). Each broken rule raises one
:class:`~tessera.errors.TesseraConfigError` (one line: field, value, rule, fix; exit code 2).

Checks, in order (the first broken one is reported):

1. the recipe's value rules (:func:`tessera.flow.resolve`: sizes, bounds, layout, template);
2. training rules: ``parallel.tp == 1`` (the engine has no tensor parallelism), a vocabulary
   that holds every id of ``train.tokenizer`` (256 for the byte-level default;
   :func:`tessera.train.worker.tokenizer.check_vocab`), and
   ``parallel.seq_length <= model.max_positions`` when the model has attention layers (RoPE
   tables are built for that many positions);
3. the data source (:func:`check_data`): ``train.data`` exists, is readable, parses, and holds
   at least one global batch of sequences; with a tokenizer this encodes the corpus once into
   the token cache (:func:`tessera.train.worker.corpus.open_token_file`), which the workers then
   map; an object-store ``logging.out_dir`` answers with these credentials (:func:`check_storage`);
4. memory: every rank's peak under the baseline plan's Programs fits the device
   (:func:`tessera.config.validate.validate_memory`; the driver's overlap-aware plan is checked
   again by the planner, whose errors reach the user in the same form); with ``dbo.enabled`` the
   Programs are slot-annotated with W deferred, as the job runs them, and the recipe's token
   counts must cover them (:func:`check_dbo_counts`);
5. the cluster, when known (:func:`check_cluster`, :func:`check_host_memory`,
   :func:`check_oversubscription`): it offers ``pp * dp`` workers' CPUs, one GPU per worker on GPU
   recipes, their ``job.resources_per_worker``, and on CPU recipes the host memory all workers'
   stages need and CPUs for no more than :data:`MAX_THREADS_PER_CPU` busy threads each (unless
   ``job.oversubscribe``);
6. every layer kind is one the engine builds (:func:`check_buildable`: one layer of each distinct
   spec is built on torch's ``meta`` device, which allocates nothing, so the real builder decides
   and the rule cannot drift from it), last because it imports the model code (torch,
   transformers, DeepSpeed: seconds); ``tessera train --address`` checks the address just before
   it (``before_build``), so an unreachable cluster or a missing token is reported within a
   second or two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

from tessera.errors import TesseraConfigError


def local_cluster(num_cpus: float | None = None, gpu: bool = False) -> dict[str, float]:
    """Resources of the local Ray this launcher would start: ``num_cpus`` (``--num-cpus``) or
    the CPUs this process may run on, the host memory available now (``memory``, bytes, as Ray
    names it), and (``gpu``: only then, since it imports CUDA) the CUDA devices torch sees."""
    import psutil  # a dependency of ray[default]

    cpus = float(num_cpus) if num_cpus else float(len(os.sched_getaffinity(0)))
    out = {"CPU": cpus, "memory": float(psutil.virtual_memory().available)}
    if gpu:
        import torch

        out["GPU"] = float(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return out


def check_training_rules(recipe, model) -> None:
    """``parallel.tp == 1``, a vocabulary holding the tokenizer's ids and sequences no longer
    than the attention layers' ``max_positions`` (module docstring, item 2; the layer kinds are
    :func:`check_buildable`'s).

    Raises:
        TesseraConfigError: ``parallel.tp != 1``, ``model.vocab`` under the tokenizer's ids
            (256 for bytes), or ``seq_length`` over ``model.max_positions`` in a model with
            attention layers.
    """
    from tessera.train.worker.tokenizer import check_vocab

    if recipe.parallel.tp != 1:
        raise TesseraConfigError("parallel.tp", recipe.parallel.tp,
                                 "must be 1 for training (the engine has no tensor parallelism yet; "
                                 "tessera simulate and tessera plan model tp > 1)", "set parallel.tp=1")
    check_vocab(recipe, model)
    has_rope = any(getattr(l.mixer, "kind", None) == "attention" for l in model.layers)
    if has_rope and recipe.parallel.seq_length > model.max_positions:
        raise TesseraConfigError("parallel.seq_length", recipe.parallel.seq_length,
                                 f"exceeds the {model.max_positions} positions the attention layers of {model.name} "
                                 "are built for (ModelSpec.max_positions)",
                                 f"use parallel.seq_length <= {model.max_positions}")


def check_buildable(model) -> None:
    """Build one decoder layer of each distinct layer spec on the ``meta`` device (no memory).

    Raises:
        TesseraConfigError: the builder's own error for a layer kind the engine does not build
            (latent-space experts); a multi-token-prediction module (``mtp_layers > 0``) or tied
            embeddings, which the planner costs but the engine does not build (refused rather
            than trained without).
    """
    import torch

    from tessera.model.layers import DecoderLayer

    if model.mtp_layers:
        raise TesseraConfigError("model.mtp_layers", model.mtp_layers, "multi-token-prediction modules are planned "
                                 "and costed but not built by the engine (training would silently leave them out)",
                                 "train with model.mtp_layers=0")
    if model.tie_embeddings:
        raise TesseraConfigError("model.tie_embeddings", True, "tied input/output embeddings are not built by the "
                                 "engine (the head would train its own matrix)",
                                 "train an untied model (model.inline.tie_embeddings=false, or an HF config with "
                                 "tie_word_embeddings=false)")

    seen = set()
    with torch.device("meta"):
        for spec in model.layers:
            key = (spec.mixer, spec.mlp)
            if key in seen:
                continue
            seen.add(key)
            DecoderLayer(model, spec, split_w=False)


def check_data(recipe) -> int:
    """Check ``train.data`` against the recipe's batch shape; returns the number of sequences.
    With a tokenizer (``train.tokenizer``) the corpus is encoded here, once, into the token cache
    the workers map (:func:`tessera.train.worker.corpus.open_token_file`).

    Raises:
        TesseraConfigError: unknown source, missing / unreadable / unparsable file (naming the
            line or row), no text, or fewer sequences of ``parallel.seq_length + 1`` tokens than
            one global batch (``dp * num_microbatches * micro_batch_size``).
    """
    from tessera.train.job.outputs import out_root
    from tessera.train.worker.corpus import absolute_data_paths, open_token_file
    from tessera.train.worker.data import load_corpus
    from tessera.train.worker.tokenizer import is_bytes

    tr = recipe.train
    if is_bytes(tr.tokenizer):
        count, unit = len(load_corpus(tr.data, tr.data_field)), "bytes"
    else:  # where the workers will look (the run root's cache)
        count, unit = open_token_file(absolute_data_paths(recipe, out_root(recipe))).num_tokens, "tokens"
    p = recipe.parallel
    need = p.dp * p.num_microbatches * p.micro_batch_size
    have = max(0, (count - 1) // p.seq_length)  # as TokenSequences.num_sequences
    if have < need:
        raise TesseraConfigError(
            "train.data", tr.data,
            f"holds {have} sequences of {p.seq_length + 1} {unit} ({count} {unit}), fewer than one global batch "
            f"of dp*num_microbatches*micro_batch_size = {p.dp}*{p.num_microbatches}*{p.micro_batch_size} = {need}",
            f"use a corpus of at least {need * p.seq_length + 1} {unit}, or lower parallel.seq_length, "
            "parallel.num_microbatches or parallel.micro_batch_size")
    return have


def check_storage(recipe) -> None:
    """With ``logging.out_dir`` on object storage (``s3://``, ``gs://``): the prefix can be
    listed and created with the environment's credentials and endpoint
    (:mod:`tessera.train.storage`); a local ``logging.out_dir`` is not touched here.

    Raises:
        TesseraConfigError: the store does not answer, refuses the credentials, or has no such
            bucket (field ``logging.out_dir``; the store's own reason in the rule).
    """
    from tessera.train import storage
    from tessera.train.job.outputs import out_root

    root = out_root(recipe)
    if not storage.is_remote(root):
        return
    try:
        storage.makedirs(root)
        storage.list_dir(root)
    except OSError as e:
        raise TesseraConfigError("logging.out_dir", recipe.logging.out_dir,
                                 f"cannot be written ({' '.join(str(e).split())[:300]})",
                                 "check the bucket name and the credentials and endpoint in the environment "
                                 "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION; "
                                 "GOOGLE_APPLICATION_CREDENTIALS for gs://)") from None


def check_memory(res) -> tuple[float, ...]:
    """Per-rank peak memory (GB) of the baseline plan's Programs (with ``dbo.enabled`` as the
    job runs them: slot-annotated, W deferred); raises when a rank does not fit
    (:func:`tessera.config.validate.validate_memory`); with ``dbo.enabled`` then
    :func:`check_dbo_counts` on the same Programs."""
    from tessera.config.validate import validate_memory
    from tessera.flow import build_baseline, build_costs, compile_programs, resolve

    if res.recipe.planner.cost_source == "profile":  # memory needs no times; the profile may not exist yet
        res = resolve(res.recipe.with_overrides(["planner.cost_source=analytic"]))
    costs = build_costs(res)
    dbo = res.recipe.dbo.enabled
    programs = compile_programs(build_baseline(res, costs), costs if dbo else None)
    memory = validate_memory(res.recipe, res.hardware, programs, costs)
    if dbo:
        check_dbo_counts(res.recipe, res.model, programs, costs)
    return memory


def check_dbo_counts(recipe, model, programs, costs) -> None:
    """With ``dbo.enabled``: the recipe's token counts (``dbo.routing``; a ``recorded`` file at
    ``dbo.counts_path``) cover the Programs' MoE layers and microbatches with the model's expert
    count (:func:`tessera.train.dbo.table.dbo_tables` builds the tables from them).

    Raises:
        TesseraConfigError: the counts cannot be read or do not fit (names ``dbo.counts_path``
            for recorded counts, else ``dbo.routing``).
    """
    from tessera.train.dbo.table import dbo_tables

    d = recipe.dbo
    try:
        dbo_tables(recipe, programs, costs, model)
    except ValueError as e:
        field, value = ("dbo.counts_path", d.counts_path) if d.routing == "recorded" else ("dbo.routing", d.routing)
        raise TesseraConfigError(field, value, f"gives token counts the job cannot use: {e}",
                                 "record counts for this recipe (python -m tessera.train.profile.routes RECIPE --out "
                                 "FILE) or use a skew model (dbo.routing=zipf)") from None
    moe = next((l.mlp for l in model.layers if getattr(l.mlp, "kind", None) == "moe"), None)
    if moe is not None and d.routing == "recorded":
        from tessera.dbo.counts import recorded_counts

        got = recorded_counts(d.counts_path).num_experts
        if got != moe.num_experts:
            raise TesseraConfigError("dbo.counts_path", d.counts_path,
                                     f"holds counts for {got} experts, {model.name} has {moe.num_experts}",
                                     "record counts for this recipe (python -m tessera.train.profile.routes)")


def check_cluster(recipe, cluster: Mapping[str, float]) -> dict:
    """The per-worker resources of the job on ``cluster``
    (:func:`tessera.train.job.trainer.worker_resources`); raises when it cannot hold them.

    Raises:
        TesseraConfigError: a GPU recipe on a cluster with too few GPUs (names
            ``hardware.preset``), too few CPUs (names ``job.cpus_per_worker`` when set, else
            the cluster), or too little of a ``job.resources_per_worker`` resource (names it).
    """
    from tessera.train.job.trainer import uses_gpu, worker_resources

    p = recipe.parallel
    world = p.pp * p.dp
    resources = worker_resources(recipe, dict(cluster))
    cpus_per_worker = recipe.job.cpus_per_worker
    gpus = float(cluster.get("GPU", 0.0))
    if uses_gpu(recipe) and gpus < world:
        raise TesseraConfigError(
            "hardware.preset", recipe.hardware.preset,
            f"trains on GPUs, one per worker: pp*dp = {p.pp}*{p.dp} = {world} GPUs needed, the cluster has {gpus:g}",
            "use hardware.preset=cpu to train on CPU workers, or run on a cluster with enough GPUs (--address)")
    extra = recipe.job.resources_per_worker or {}
    for name, per in resources.items():
        have = float(cluster.get(name, 0.0))
        if name in extra and per * world > have + 1e-9:
            raise TesseraConfigError(
                f"job.resources_per_worker.{name}", extra[name],
                f"{world} workers (pp*dp = {p.pp}*{p.dp}) x {per:g} {name} = {per * world:g} {name} exceed the "
                f"cluster's {have:g} {name} (Ray would wait for them forever)",
                f"run on a cluster whose nodes offer {name} (ray start --resources '{{\"{name}\": N}}', "
                "tessera train --address), or remove it from job.resources_per_worker")
        if per * world > have + 1e-9:
            field, value = (("job.cpus_per_worker", cpus_per_worker) if name == "CPU" and cpus_per_worker is not None
                            else ("cluster", f"{have:g} {name}"))
            raise TesseraConfigError(
                field, value, f"{world} workers (pp*dp = {p.pp}*{p.dp}) x {per:g} {name} = {per * world:g} {name} "
                f"exceed the cluster's {have:g} {name}",
                f"use job.cpus_per_worker <= {have / world:g} (--cpus-per-worker), add {name} to the cluster "
                "(ray start --num-cpus, tessera train --num-cpus) or lower parallel.pp / parallel.dp")
    return resources


MAX_THREADS_PER_CPU = 4
"""On CPU recipes, the most busy threads (``pp * dp`` workers x ``job.threads``, the torch threads
of each) per CPU of the cluster that pre-flight lets a job start with; beyond it every step waits
on the others' time slices (16 workers on 2 cores: about 40 s a step of the tiny recipe).
``job.oversubscribe=true`` (``--oversubscribe``) lifts the limit."""


def check_oversubscription(recipe, cluster: Mapping[str, float], resources: Mapping[str, float]) -> None:
    """On CPU recipes: ``pp * dp`` workers x threads per worker
    (:func:`tessera.train.job.trainer.worker_threads` of ``resources``) must not exceed
    :data:`MAX_THREADS_PER_CPU` per CPU of ``cluster`` (Ray's ``CPU``: the local Ray's cores or
    ``--num-cpus``, or the connected cluster's), unless ``job.oversubscribe``. Skipped on GPU
    recipes and when the cluster reports no CPUs.

    Raises:
        TesseraConfigError: too many busy threads per CPU (names ``parallel.dp``, or
            ``parallel.pp`` when dp is 1, or ``job.threads`` when more than one thread per worker
            is what tips it over).
    """
    from tessera.train.job.trainer import uses_gpu, worker_threads

    cpus = float(cluster.get("CPU", 0.0))
    if uses_gpu(recipe) or recipe.job.oversubscribe or cpus <= 0:
        return
    p = recipe.parallel
    world, threads = p.pp * p.dp, worker_threads(recipe, dict(resources))
    if world * threads <= MAX_THREADS_PER_CPU * cpus + 1e-9:
        return
    if threads > 1 and world <= MAX_THREADS_PER_CPU * cpus + 1e-9:
        field, value = "job.threads", threads
    else:
        field, value = ("parallel.dp", p.dp) if p.dp > 1 else ("parallel.pp", p.pp)
    most = int(MAX_THREADS_PER_CPU * cpus + 1e-9)
    raise TesseraConfigError(
        field, value,
        f"{world} CPU workers (pp*dp = {p.pp}*{p.dp}) x {threads} thread{'s' if threads > 1 else ''} on the "
        f"cluster's {cpus:g} CPUs are {world * threads / cpus:.3g} busy threads per CPU, more than "
        f"{MAX_THREADS_PER_CPU} (each step would wait on the others' time slices)",
        f"keep pp*dp x threads <= {most}: lower parallel.dp / parallel.pp (or job.threads), run on a cluster "
        "with more CPUs (--address), or set job.oversubscribe=true (--oversubscribe) to run it anyway")


WORKER_OVERHEAD_GB = 0.5
"""Host memory of one Ray Train worker process before its stages (torch, Ray; RAY-NOTES: about
0.5 GB RSS per worker on CPU)."""


def check_host_memory(recipe, memory_gb, cluster: Mapping[str, float]) -> None:
    """On CPU recipes every worker's stages live in host memory: ``dp * sum(memory_gb)`` plus
    :data:`WORKER_OVERHEAD_GB` per worker must fit the cluster's ``memory`` (bytes; Ray's
    resource of that name, or :func:`local_cluster`'s available memory). Skipped when the
    cluster reports no memory or the recipe trains on GPUs.

    Raises:
        TesseraConfigError: the workers need more host memory than the cluster has.
    """
    from tessera.train.job.trainer import uses_gpu

    have = float(cluster.get("memory", 0.0)) / 1e9
    if uses_gpu(recipe) or have <= 0:
        return
    p = recipe.parallel
    need = p.dp * sum(memory_gb) + p.pp * p.dp * WORKER_OVERHEAD_GB
    if need > have:
        raise TesseraConfigError(
            "hardware.preset", recipe.hardware.preset,
            f"CPU workers keep their stages in host memory: dp * (sum of the {p.pp} ranks' peaks) + "
            f"{WORKER_OVERHEAD_GB:g} GB per worker = {need:.1f} GB, the cluster has {have:.1f} GB",
            "train a smaller model on CPU (e.g. model.preset=tiny-qwen3-next, or model.num_layers=N), lower "
            "parallel.dp / parallel.seq_length / parallel.micro_batch_size, or run on GPUs")


@dataclass(frozen=True)
class Checked:
    """What :func:`preflight` found: the resolved recipe (:class:`tessera.flow.Resolved`),
    the corpus's number of sequences, the baseline's per-rank peak memory (GB) and, when the
    cluster was known, the per-worker Ray resources (else None)."""

    resolved: object
    num_sequences: int
    memory_gb: tuple[float, ...]
    resources: dict | None = None


def preflight(recipe, cluster: Mapping[str, float] | None = None,
              before_build: Callable[[], None] | None = None) -> Checked:
    """Every check of the module docstring, in order.

    Args:
        recipe: the job's :class:`~tessera.config.load.Recipe` (its ``job`` section gives the
            CPUs per worker).
        cluster: the cluster's resources (``{"CPU": n, "GPU": g}``), or None when not known yet.
        before_build: called after the checks of the recipe and the cluster, before the layer
            kinds are built (the one check that imports the model code: seconds); ``tessera
            train --address`` checks the address there, so it answers within a second or two.

    Raises:
        TesseraConfigError: the first broken rule (or what ``before_build`` raises).
    """
    from tessera.flow import resolve

    res = resolve(recipe)
    check_training_rules(recipe, res.model)
    sequences = check_data(recipe)
    check_storage(recipe)
    memory = check_memory(res)
    resources = None
    if cluster is not None:
        resources = check_cluster(recipe, cluster)
        check_host_memory(recipe, memory, cluster)  # before: a job that cannot fit says so, not that it is slow
        check_oversubscription(recipe, cluster, resources)
    if before_build is not None:
        before_build()
    check_buildable(res.model)  # last: it imports the model code, transformers and DeepSpeed (seconds)
    return Checked(res, sequences, memory, resources)
