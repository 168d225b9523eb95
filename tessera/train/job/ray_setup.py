"""Connecting the launcher to Ray: address checks, a local Ray, and quiet logs.

* :func:`check_address`: before ``ray.init(address=...)``, a TCP connect (3 s) and, when
  ``RAY_AUTH_MODE`` is not set, a one-call GCS probe; an unreachable address or a cluster that
  needs token authentication gives a one-line :class:`~tessera.errors.TesseraConfigError` at
  once, instead of Ray's 20-40 s of retries and a ``ConnectionError`` traceback. Ray never sends
  the local token to an explicit address on its own (``ray.init`` enables token mode only for
  ``address="auto"``), and neither does this module: the fix names the variable to set.
* :func:`connect`: ``ray.init`` for the job (explicit address, or a new local Ray of the job's
  own, never a cluster Ray would find by itself; Ray's warning that it enabled token
  authentication for the local cluster, its default, is silenced).
* :func:`quiet_worker_logs`: drops the lines Ray forwards from its own actors that are harmless
  when the job is fine (listed in :data:`HARMLESS`), keeping everything else, including every
  line of our workers.
* Worker processes get ``TRANSFORMERS_VERBOSITY=error`` (:data:`WORKER_ENV`, set by
  :func:`tessera.train.job.trainer.worker_env`): transformers' notes that it uses its reference PyTorch kernels (``causal_conv1d``, ``flash-linear-attention``
  not installed) are expected on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from typing import Iterator

from tessera.errors import TesseraConfigError

AUTH_ENV = "RAY_AUTH_MODE"
TOKEN_FIX = (f"set {AUTH_ENV}=token in the shell that runs tessera train or ray job submit (the token is read from "
             "~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; ray get-auth-token prints it on the head)")

WORKER_ENV = {"TRANSFORMERS_VERBOSITY": "error"}
"""Environment added to every worker process."""

HARMLESS: tuple[tuple[str, re.Pattern], ...] = (
    # Ray Train v2's detached cleaner polls the State API; when the launcher shuts its local Ray
    # down at the end of a successful job, the poll raises inside the cleaner's monitor thread
    # ("Found multiple active Ray instances" when tests run several clusters on one machine).
    ("PlacementGroupCleaner", re.compile(r".")),
    # Ray Train's controller creates its PreemptionWatcher with max_restarts > 0 and logs at
    # error level that restarts would need its constructor arguments (ray issue 53727).
    ("", re.compile(r"'PreemptionWatcher'.*constructor arguments in the object store")),
)
"""``(actor or task name, line pattern)`` of forwarded lines to drop (empty name: any)."""


def _host_port(address: str) -> tuple[str, int] | None:
    m = re.fullmatch(r"(?:[a-z]+://)?\[?([^\]/]+?)\]?:(\d+)/?", address.strip())
    return (m.group(1), int(m.group(2))) if m else None


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    """Silence file descriptor 2 (Ray's C++ client logs each failed RPC there) for a block."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def check_address(address: str, env: dict | None = None) -> None:
    """Fail fast, in one line, when ``address`` (``--address`` / ``RAY_ADDRESS``) cannot work.

    ``auto``, ``local``, ``ray://`` (Ray Client) and ``http(s)://`` addresses are left to Ray.

    Raises:
        TesseraConfigError: nothing accepts a TCP connection at ``host:port`` within 3 s, or
            the cluster answers that a token is missing while ``RAY_AUTH_MODE`` is unset.
    """
    env = os.environ if env is None else env
    if address in ("auto", "local") or address.startswith(("ray://", "http://", "https://")):
        return
    hp = _host_port(address)
    if hp is None:
        raise TesseraConfigError("--address", address, "is not of the form HOST:PORT (the GCS address ray start "
                                 "printed)", "use e.g. --address 127.0.0.1:6379, or leave it out to start a local Ray")
    try:
        with socket.create_connection(hp, timeout=3):
            pass
    except OSError as e:
        raise TesseraConfigError("--address", address, f"nothing accepts connections there ({e.strerror or e})",
                                 "start the cluster (ray start --head) or give the address it printed") from None
    if env.get(AUTH_ENV):
        return
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # another Ray: leave the check to ray.init
        return
    try:
        with _stderr_to_devnull():
            GcsClient(address=f"{hp[0]}:{hp[1]}").internal_kv_get(b"tessera-probe", None, timeout=5)
    except AuthenticationError:
        raise TesseraConfigError("--address", address, f"the cluster requires token authentication and {AUTH_ENV} "
                                 "is not set", TOKEN_FIX) from None
    except Exception:  # noqa: BLE001 - any other answer: ray.init reports it in its own words
        return


def connect(address: str | None, num_cpus: float | None = None, temp_dir: str | None = None) -> bool:
    """``ray.init`` for the job; returns True when this call connected or started Ray (the
    caller then calls ``ray.shutdown``), False when this process was connected already.

    Raises:
        TesseraConfigError: ``ray.init`` cannot connect to ``address``.
    """
    import ray

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if ray.is_initialized():
        return False
    if address:
        check_address(address)
        try:
            ray.init(address=address, logging_level="WARNING")
        except ConnectionError as e:
            raise TesseraConfigError("--address", address, f"Ray cannot connect ({e})",
                                     f"check the address; if the cluster uses token authentication, {TOKEN_FIX}") from None
    else:
        # Ray enables token authentication for a new local cluster and warns that it did: the
        # default, nothing to act on
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        kwargs = {"num_cpus": num_cpus} if num_cpus else {}
        if temp_dir:
            kwargs["_temp_dir"] = os.path.abspath(temp_dir)
        # address="local": always a new cluster of this job's own, never one found through
        # /tmp/ray/ray_current_cluster (a running head would be joined, a stopped one retried forever)
        ray.init(address="local", logging_level="WARNING", **kwargs)  # its dashboard serves Ray Train's State API
    quiet_worker_logs()
    return True


def _harmless(data: dict, line: str) -> bool:
    who = f"{data.get('actor_name') or ''} {data.get('task_name') or ''}"
    return any((not name or name in who) and pat.search(line) for name, pat in HARMLESS)


def quiet_worker_logs() -> bool:
    """Filter the lines Ray forwards to this process through :data:`HARMLESS`; returns False
    (and changes nothing) when this Ray has no forwarding handler to wrap."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        for i, (name, handler) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and not getattr(handler, "tessera_filtered", False):
                def filtered(data, _inner=handler):
                    lines = [ln for ln in data.get("lines", []) if not _harmless(data, ln)]
                    if lines:
                        _inner(dict(data, lines=lines))
                filtered.tessera_filtered = True
                dispatcher.handlers[i] = (name, filtered)
                return True
    return False
