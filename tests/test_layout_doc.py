"""docs/LAYOUT.md is true: every room it names exists, and every room that exists (each
module of the packages, each bench script, each script and config) is named in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "LAYOUT.md"
# Folders whose rooms the page lists one by one: (folder, pattern, with subfolders).
ROOMS = (("mxjax", "*.py", False), ("models", "*.py", False), ("train", "*.py", True),
         ("study", "*.py", True), ("bench", "*.py", True), ("scripts", "*.py", False),
         ("configs", "*.yaml", False))
_TICKED = re.compile(r"`([^`]+)`")


def _rooms() -> list[str]:
    """Every room, as a path relative to the root: modules (not private ones), packages
    of mxjax (a subpackage is one room there), scripts, configs."""
    out = []
    for folder, pattern, deep in ROOMS:
        base = ROOT / folder
        paths = base.rglob(pattern) if deep else base.glob(pattern)
        for p in paths:
            if "__pycache__" in p.parts or (p.name.startswith("_") and p.name != "__main__.py"):
                continue
            out.append(p.relative_to(ROOT).as_posix())
        if folder == "mxjax":
            out += [p.relative_to(ROOT).as_posix() + "/" for p in base.iterdir()
                    if p.is_dir() and any(p.glob("*.py"))]  # namespace packages too
    return sorted(out)


def _prose_lines() -> list[str]:
    """The page's lines outside code blocks, without ```` ``` ```` spans."""
    out, fenced = [], False
    for line in LAYOUT.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"````.*?````", "", line))
    return out


def _ticked() -> list[str]:
    return [t for line in _prose_lines() for t in _TICKED.findall(line)]


def _rows() -> list[list[str]]:
    """The backticked tokens of each table row of the page."""
    return [_TICKED.findall(line) for line in _prose_lines()
            if line.startswith("|") and not line.startswith("|---")]


def _row_base(tokens: list[str]) -> str | None:
    """The folder a row's bare names are relative to: that of its first path
    (`train/optimizer.py` -> train, `train/data/` -> train/data) or dotted module
    (`mxjax.routes` -> mxjax/routes)."""
    for t in tokens:
        if "/" in t:
            return t.rstrip("/") if t.endswith("/") else t.rsplit("/", 1)[0]
        if re.fullmatch(r"mxjax(\.\w+)+", t):
            return t.replace(".", "/")
    return None


def _named() -> set[str]:
    """What the page names, as root-relative paths (a folder ends with '/')."""
    named = set()
    for t in _ticked():
        if "/" in t and not t.startswith(("http", "../")):
            named.add(t.split()[0])
        elif re.fullmatch(r"mxjax(\.\w+)+", t):
            parts = t.split(".")
            named |= {"/".join(parts) + ".py", "/".join(parts) + "/"}
    for tokens in _rows():
        base = _row_base(tokens)
        if base is None:
            continue
        for t in tokens:
            if re.fullmatch(r"[\w.]+", t) and "." not in t.removesuffix(".py").removesuffix(
                    ".yaml"):
                named |= {f"{base}/{t}", f"{base}/{t}.py", f"{base}/{t}/"}
    return named


def test_every_room_is_named():
    named = _named()
    missing = [r for r in _rooms() if r not in named]
    assert not missing, (
        f"docs/LAYOUT.md does not name {missing}: add each to the table of its folder "
        "(a path, or a bare name in the row of its folder)")


def test_every_named_path_exists():
    absent = []
    for t in _ticked():
        first = t.split("/")[0]
        if "/" in t and (ROOT / first).is_dir() and not (ROOT / t.split()[0]).exists():
            absent.append(t)
    for tokens in _rows():
        base = _row_base(tokens)
        for t in tokens:
            if base and re.fullmatch(r"\w+\.(py|yaml)", t) and not (ROOT / base / t).exists():
                absent.append(f"{base}/{t}")
        first = tokens[0] if tokens else ""
        if re.fullmatch(r"mxjax(\.\w+)+", first):
            path = ROOT / first.replace(".", "/")
            if not (path.with_suffix(".py").exists() or any(path.glob("*.py"))):
                absent.append(first)
    assert not absent, f"docs/LAYOUT.md names rooms that do not exist: {absent}"


def test_the_tree_lists_every_top_level_entry():
    block = LAYOUT.read_text().split("```")[1]
    listed = set()
    for i, line in enumerate(block.strip("\n").splitlines()):
        words = line.split()
        listed |= set(words) if i == 0 else {words[0]}
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the tracked top-level entries are unknown")
    top = {p.split("/")[0] + ("/" if "/" in p else "") for p in tracked}
    assert top == listed, (f"docs/LAYOUT.md's tree: missing {sorted(top - listed)}, "
                           f"not in the repository {sorted(listed - top)}")
