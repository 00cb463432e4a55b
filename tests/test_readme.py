"""Every Python block of README.md and docs/*.md runs as written (one namespace each).

A block is a fenced block whose language is ``python`` (or ``py``/``python3``). It is run
from the repository root, as the README tells users to run repository-level code
(``models``, ``train``). A block that only illustrates (it would start a training run,
needs a device, or shows an API another page tests) is preceded, on the line above its
fence, by a visible comment ``<!-- not-run: REASON -->``; it is compiled (so it stays
valid Python) but not run. Use it sparingly: MAX_NOT_RUN caps it.

Blocks assert what they show (``assert ...`` lines in the block itself), so a snippet
that runs but no longer does what its page says fails here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_FENCES = ("python", "py", "python3")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<reason>\S.*?)\s*-->$")
MAX_NOT_RUN = 4
README_MAX_LINES = 360  # a newcomer's guide of about 350 lines; details in docs/


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason, when marked not-run

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: pathlib.Path) -> list[Block]:
    """The fenced Python blocks of a Markdown page, with their not-run marks."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})\s*(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        ticks, lang = fence.group(1), fence.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise AssertionError(f"{page.name}:{i + 1}: code fence never closed")
        if lang in PYTHON_FENCES:
            mark = NOT_RUN.match(lines[i - 1].strip()) if i > 0 else None
            blocks.append(Block(page, i + 1, "\n".join(lines[i + 1:end]) + "\n",
                                mark.group("reason") if mark else None))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in python_blocks(page)]
RUN = [b for b in BLOCKS if b.not_run is None]


def test_pages_have_python_examples_and_few_not_run_blocks():
    assert sum(b.page.name == "README.md" for b in RUN) >= 4, "README.md: its examples are gone"
    not_run = [f"{b.name} ({b.not_run})" for b in BLOCKS if b.not_run is not None]
    assert len(not_run) <= MAX_NOT_RUN, f"too many not-run blocks: {not_run}"


def test_not_run_marks_stand_right_above_a_python_fence():
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("<!--") and "not-run" in line:
                assert NOT_RUN.match(line.strip()), f"{page.name}:{i + 1}: malformed {line!r}"
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                lang = re.match(r"^`{3,}\s*(\S*)", nxt)
                assert lang and lang.group(1).lower() in PYTHON_FENCES, (
                    f"{page.name}:{i + 1}: a not-run mark must be the line above a python fence")


def test_readme_is_a_short_guide_with_the_quickstart_commands():
    text = (ROOT / "README.md").read_text()
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}): move details to a docs/ page")
    assert "make test\n" in text and "make train\n" in text


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.not_run is not None],
                         ids=lambda b: b.name)
def test_not_run_block_is_valid_python(block):
    compile(block.code, block.name, "exec")


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_python_block_runs(block, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exec(compile(block.code, block.name, "exec"), {"__name__": "__readme__"})  # noqa: S102
