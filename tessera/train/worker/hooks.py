"""Worker hooks: code a job runs inside every worker's loop without the loop knowing it (test-only
fault injection is one: :mod:`tessera.testing.faults`).

A hook is named by a :class:`HookSpec`, an import path ``"module:factory"`` and the factory's
keyword arguments, plain values that Ray pickles to every worker inside
:class:`~tessera.train.worker.loop.WorkerConfig`. :func:`resolve_hook` imports the module and calls the
factory (with :mod:`importlib`, so ``tessera.train`` imports no hook module statically); the job
resolves every spec once in the launcher, before the driver starts, so a bad spec is one line and
exit code 2 at once, and each worker resolves them again. A hook is any object with the methods of
:class:`WorkerHooks` (structural: a hook module need not import this one).

The launcher's environment can add hooks (:data:`ENV_HOOKS`, :func:`hooks_from_env`): a variable
set there adds the hook ``factory(text=<its value>)``.
"""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from tessera.errors import TesseraConfigError

ENV_HOOKS: dict[str, str] = {
    "TESSERA_FAULT_AT": "tessera.testing.faults:kill_after_step",
    "TESSERA_FAULT_IN_CHECKPOINT": "tessera.testing.faults:kill_in_checkpoint",
    "TESSERA_SLOW_RANK": "tessera.testing.slow:slow_rank",
}
"""Environment variables of the launcher that add a worker hook -> its factory (called as
``factory(text=value)``): test-only fault and straggler injection (``docs/running.md``;
:mod:`tessera.testing.faults`, :mod:`tessera.testing.slow`)."""


class WorkerHooks(Protocol):
    """What a worker hook implements; ``loop`` is the rank's
    :class:`~tessera.train.worker.loop.WorkerLoop` (a hook may read ``loop.rank``, ``loop.world``,
    ``loop.run_name``, ``loop.recipe`` and call ``loop.claim_once(key)``)."""

    def after_step(self, loop, step: int) -> None:
        """Called on every rank after iteration ``step`` was reported, before its checkpoint."""

    def die_before_marker(self, loop, step: int) -> bool:
        """Called on every rank when iteration ``step`` writes a checkpoint; True: this rank's
        process kills itself while uploading its part, after the part's other files and before
        its completeness marker."""


@dataclass(frozen=True)
class HookSpec:
    """A worker hook to build: ``path`` ``"module:factory"`` and the factory's keyword arguments
    (plain, picklable values); ``origin`` names where the spec came from in error messages (an
    environment variable, or ``hook``)."""

    path: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    origin: str = "hook"

    def to_dict(self) -> dict:
        return {"path": self.path, "kwargs": dict(self.kwargs), "origin": self.origin}

    @staticmethod
    def from_dict(d: Mapping) -> "HookSpec":
        return HookSpec(str(d["path"]), dict(d.get("kwargs") or {}), str(d.get("origin", "hook")))


def resolve_hook(spec: HookSpec) -> WorkerHooks:
    """The hook ``spec`` names: ``factory(**spec.kwargs)`` of the module it names.

    Raises:
        TesseraConfigError: one line naming ``spec.origin`` and the spec: the path is not
            ``module:factory``, the module cannot be imported, it has no callable of that name,
            the factory rejects the arguments or raises ``ValueError``/``TypeError``, or what it
            returns lacks a :class:`WorkerHooks` method; a ``TesseraConfigError`` the factory
            raises (a bad argument value) is passed on as it is.
    """
    module, sep, name = spec.path.partition(":")
    if not sep or not module or not name.isidentifier():
        raise TesseraConfigError(spec.origin, spec.path, "must be an import path module:factory",
                                 "e.g. tessera.testing.faults:kill_after_step")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise TesseraConfigError(spec.origin, spec.path, f"module {module!r} cannot be imported ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())})", "give an installed module") from None
    factory = getattr(mod, name, None)
    if not callable(factory):
        known = [n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n))]
        close = difflib.get_close_matches(name, known, n=1)
        raise TesseraConfigError(spec.origin, spec.path, f"module {module!r} has no callable {name!r}",
                                 f"did you mean {module}:{close[0]}?" if close else f"give a factory of {module}")
    try:
        hook = factory(**dict(spec.kwargs))
    except TesseraConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise TesseraConfigError(spec.origin, spec.path, f"the factory failed with arguments {dict(spec.kwargs)} "
                                 f"({type(e).__name__}: {' '.join(str(e).split())})",
                                 "give the arguments the factory takes") from None
    missing = [m for m in ("after_step", "die_before_marker") if not callable(getattr(hook, m, None))]
    if missing:
        raise TesseraConfigError(spec.origin, spec.path, f"returned a {type(hook).__name__} without "
                                 f"{', '.join(missing)}", "return an object with after_step(loop, step) and "
                                 "die_before_marker(loop, step) (tessera.train.worker.hooks.WorkerHooks)")
    return hook


def resolve_hooks(specs) -> tuple[WorkerHooks, ...]:
    """:func:`resolve_hook` of every spec, in order (raises as it does)."""
    return tuple(resolve_hook(s) for s in specs)


def hooks_from_env(env: Mapping[str, str] | None = None) -> tuple[HookSpec, ...]:
    """The hooks the launcher's environment (``env``, default ``os.environ``) adds: one per
    variable of :data:`ENV_HOOKS` that is set and not empty, in the table's order."""
    env = os.environ if env is None else env
    return tuple(HookSpec(path, {"text": env[name]}, origin=name) for name, path in ENV_HOOKS.items() if env.get(name))
