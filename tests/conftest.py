"""Shared fixtures of the test suite, and how pytest-xdist hands its tests to the workers.

The suite runs on 2 xdist workers (pyproject ``addopts``: ``-n 2 --dist loadgroup
--no-loadscope-reorder``; ``-n 0`` runs it in one process). Modules that start or join a Ray
cluster carry ``pytestmark = pytest.mark.xdist_group("ray")``: they run one after another on one
worker (two Ray clusters at once on a 2-core machine make ``ray.init(address="auto")`` find
"multiple active Ray instances", and their jobs starve each other), and they run first, so the
longest unit of work starts at once while the other worker takes the rest. The tests of a module
that defines a module-scoped fixture stay on one worker, so an expensive fixture (a gloo launch,
a Ray job) is built once, not once per worker. Every other test goes to whichever worker is free.

:class:`_GroupScheduling` does that grouping in the controller. xdist's own ``loadgroup`` passes a
test's group as a ``@group`` suffix of its node id, which pytest 9.2 no longer lets a plugin set
(pytest-xdist issue 1386: the groups are silently ignored); the controller collects nothing, so
it reads each module's ``pytestmark`` and fixture scopes from the module's source instead.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

FIRST_GROUP = "ray"  # the long pole of the suite: about half of its serial time


def _mark_groups(item: pytest.Item) -> set[str]:
    return {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}


def pytest_collection_modifyitems(config, items):
    """The tests of group "ray" first (stable: otherwise collection order)."""
    items.sort(key=lambda item: FIRST_GROUP not in _mark_groups(item))


def _call_name(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else node
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


@functools.lru_cache(maxsize=None)
def module_group(path: Path) -> str | None:
    """The xdist group of every test of the module at ``path``: the name in its module-level
    ``pytestmark = pytest.mark.xdist_group(NAME)`` (or in a list of marks), else the module's path
    when it defines a fixture of scope module, package or session, else None (tests spread)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            for call in ast.walk(node.value):
                if isinstance(call, ast.Call) and _call_name(call) == "xdist_group" and call.args and \
                        isinstance(call.args[0], ast.Constant):
                    return str(call.args[0].value)
    for node in tree.body:
        for dec in getattr(node, "decorator_list", ()):
            if isinstance(dec, ast.Call) and _call_name(dec) == "fixture" and any(
                    k.arg == "scope" and getattr(k.value, "value", "function") != "function" for k in dec.keywords):
                return str(path)
    return None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: ignored without it
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class _GroupScheduling(LoadScopeScheduling):
        """loadscope with scope = the module's group (:func:`module_group`), else the test itself."""

        def _split_scope(self, nodeid: str) -> str:
            base = nodeid.split("::", 1)[0]
            return module_group(root / base) or nodeid

    return _GroupScheduling(config, log)


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny GEMMs: avoids OpenMP oversubscription on shared CPUs)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
