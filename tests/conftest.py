"""Shared pytest fixtures (keep this file small; helpers live in tests/reference.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture
def np_rng(request) -> np.random.Generator:
    """A numpy Generator seeded from the test's node id (stable across runs and workers)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` run first, so that pytest-xdist's workers finish together
    instead of one worker running a long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable sort
