"""Where a job's outputs live: the run root on the node running the job, and the Ray job it came from.

Both the training job (:mod:`tessera.train.job.run`) and the profile job
(:mod:`tessera.train.job.profile`) read these; they sit in a module of their own so that neither
job imports the other.
"""

from __future__ import annotations

import json
import os


def submission_id(env: dict | None = None) -> str | None:
    """The Ray job submission id when this process is a ``ray job submit`` entrypoint (Ray's job
    supervisor sets ``RAY_JOB_CONFIG_JSON_ENV_VAR`` with it in the metadata), else None."""
    raw = (os.environ if env is None else env).get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        return json.loads(raw).get("metadata", {}).get("job_submission_id") or None
    except (ValueError, AttributeError):
        return None


JOB_OUT_BASE = os.path.join("~", "ray_results", "tessera")
"""Base of a relative ``logging.out_dir`` under ``ray job submit`` (Ray runs the entrypoint in a
temporary copy of the working dir, deleted with the cluster; Ray Train's own default storage is
``~/ray_results``)."""


def out_root(recipe, env: dict | None = None) -> str:
    """The absolute directory holding the job's run directories: ``logging.out_dir`` as given
    when absolute; relative to the working directory for ``tessera train``; under a Ray job,
    relative to :data:`JOB_OUT_BASE` on the node running the entrypoint. An object-store
    ``logging.out_dir`` (``s3://``, ``gs://``) is that URI, in its one spelling
    (:func:`tessera.config.storage_rules.normalize_uri`: ``s3://bucket/runs``)."""
    from tessera.config.storage_rules import is_object_uri, normalize_uri

    if is_object_uri(recipe.logging.out_dir):
        return normalize_uri(recipe.logging.out_dir)
    d = os.path.expanduser(recipe.logging.out_dir)
    if os.path.isabs(d):
        return os.path.normpath(d)
    if submission_id(env) is not None:
        return os.path.normpath(os.path.join(os.path.expanduser(JOB_OUT_BASE), d))
    return os.path.abspath(d)
