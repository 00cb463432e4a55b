"""Fixtures shared by tests/train."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One data cache per test session (worker): prepared corpora are keyed by their
    fingerprint, so tests with the same data settings tokenize it once, and runs of
    `train_testutil.fast_sets` share the persistent compilation cache under it."""
    return tmp_path_factory.mktemp("data_cache")
