"""Shared pytest fixtures (keep this file small; helpers live in tests/reference.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture
def np_rng(request) -> np.random.Generator:
    """A numpy Generator seeded from the test's node id (stable across runs and workers)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
