"""Shared fixtures of the test suite."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny GEMMs: avoids OpenMP oversubscription on shared CPUs)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
