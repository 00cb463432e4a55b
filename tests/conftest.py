"""Shared pytest fixtures (keep this file small; helpers live in tests/reference.py)."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture
def np_rng(request) -> np.random.Generator:
    """A numpy Generator seeded from the test's node id (stable across runs and workers)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One data cache per test session (worker) for tests/train and tests/study: prepared
    corpora are keyed by their fingerprint, so tests with the same data settings tokenize it
    once, and runs of `tests.train.train_testutil.fast_sets` share the persistent compilation
    cache under it."""
    return tmp_path_factory.mktemp("data_cache")


# XLA's LLVM backend optimization level for the programs tests compile. Level 0 compiles
# CPU programs in about half the time; results are the same (no fast-math at any level,
# and XLA's HLO passes, which decide what a program computes, run as usual), and the
# default run's budget is mostly compilation. Applied only to runs that exclude the gpu
# marker (the default run: `make test`), never to -m gpu/accelerators/slow runs, nor when
# XLA_FLAGS already sets a level. Subprocesses inherit it through the environment.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def pytest_configure(config):
    markexpr = config.getoption("markexpr") or ""
    flags = os.environ.get("XLA_FLAGS", "")
    if "not gpu" in markexpr and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE_FLAG}".strip()


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` run first, so that pytest-xdist's workers finish together
    instead of one worker running a long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable sort
