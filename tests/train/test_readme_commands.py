"""The README's shell commands, run in order on a fresh run directory, as a newcomer runs
them: parsed from README.md's ``bash`` blocks (``make train`` is the Makefile's recipe), so
the README cannot drift from what works.

Each ``python -m train`` command runs in-process from an empty working directory (holding
only ``configs/``), made small: the tiny test model and a few steps (`fast_sets`, placed
before the command's own arguments so that those still apply, and ``train.steps`` after
them). Every command must succeed, except the 8B ``--check`` on a machine without C4,
which prints the memory estimate for 8 H100s and then names the missing data (exit 2).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.train.train_testutil import ROOT, fast_sets
from train.__main__ import main
from train.data.__main__ import main as data_main

STEPS = "train.steps=4"
MLPERF_CHECK = "--check --config configs/llama3_8b_mlperf.yaml --devices 8 --chip h100"


def _make_train(root: Path) -> list[str]:
    """The Makefile's ``train`` recipe as shell commands (``make train``, no TRAIN_ARGS)."""
    text = (root / "Makefile").read_text()
    recipe = re.search(r"^train:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert recipe, "Makefile: no train target"
    return [re.sub(r"\s+", " ", ln.replace("$(PY)", "python").replace("$(TRAIN_ARGS)", "")
                   ).strip() for ln in recipe.group(1).splitlines() if "-m train" in ln]


def readme_commands(root: Path = ROOT) -> list[str]:
    """The ``make train`` and ``python -m train`` / ``python -m train.data`` lines of
    README.md's bash blocks, in order, comments dropped; ``make train`` as the Makefile runs
    it."""
    out, in_bash = [], False
    for line in (root / "README.md").read_text().splitlines():
        if line.startswith("```"):
            in_bash = not in_bash and line.strip() in ("```bash", "```sh")
            continue
        if not in_bash:
            continue
        cmd = line.split("#", 1)[0].strip()
        if cmd == "make train":
            out.extend(_make_train(root))
        elif re.match(r"python -m train(\.data)?( |$)", cmd):
            out.append(cmd)
    return out


def test_the_readme_lists_the_commands_a_newcomer_runs():
    cmds = readme_commands()
    assert cmds[:2] == ["python -m train.data prepare --config configs/tiny.yaml",  # make train
                        "python -m train --config configs/tiny.yaml"]
    assert f"python -m train {MLPERF_CHECK}" in cmds
    assert any(c.startswith("python -m train export-hf ") for c in cmds)
    assert any("--policy fp8" in c for c in cmds)


def _small(argv: list[str], cache) -> list[str]:
    """A training command made small: the tiny test model, data slice and schedule after its
    --config, the step count at the end."""
    sets = [s for s in fast_sets(ROOT, cache, "optim.decay_steps=12")
            if not s.startswith("out_dir=")]
    small = [a for s in sets for a in ("--set", s)]
    i = argv.index("--config") + 2 if "--config" in argv else 0
    if argv[0] == "prepare":  # python -m train.data prepare: the data settings only
        small = [a for s in sets if s.startswith("data.") for a in ("--set", s)]
        return [*argv[:i], *small, *argv[i:]]
    return [*argv[:i], *small, *argv[i:], "--set", STEPS]


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path, data_cache, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    cmds = readme_commands()
    # "Run it again and it resumes": make train's training command twice
    cmds.insert(2, cmds[1])
    for n, cmd in enumerate(cmds):
        module, argv = shlex.split(cmd)[2], shlex.split(cmd)[3:]
        training = bool(argv) and argv[0] not in ("export-hf", "mlperf-check") and not any(
            a in argv for a in ("--check", "--help", "--list-policies"))
        if training:
            argv = _small(argv, data_cache)
        try:
            code = (data_main if module == "train.data" else main)(argv)
        except SystemExit as e:  # --help
            code = e.code
        cap = capsys.readouterr()
        where = f"README command {n}: {cmd}\n{cap.err[-2000:]}"
        if cmd.endswith(MLPERF_CHECK):
            report = json.loads(cap.out)
            assert code == 2, where
            assert report["devices"]["chip"] == "h100" and report["mesh"]["fsdp"] == 8, where
            assert report["memory_per_device"]["total_gib"] > 0 and report["fits"], where
            assert cap.err.startswith("config error: data.sources: no file matches"), where
            continue
        assert code == 0, where
        if n == 2:
            assert "run already complete; nothing to do" in cap.out, where
    assert (tmp_path / "runs/tiny/summary.json").is_file()
    assert (tmp_path / "hf/tiny/model.safetensors").is_file()
    summary = json.loads((tmp_path / "runs/from_hf/summary.json").read_text())
    assert summary["status"] == "completed"


@pytest.mark.parametrize("cmd", ["make train", "python -m train --help  # every config key"])
def test_commands_are_read_from_bash_blocks_only(tmp_path, cmd):
    """A command in prose or in a non-shell block is not one to run."""
    page = tmp_path / "README.md"
    page.write_text(f"Run `{cmd}`.\n\n```text\n{cmd}\n```\n\n```bash\n{cmd}\n```\n")
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    expected = (["python -m train.data prepare --config configs/tiny.yaml",
                 "python -m train --config configs/tiny.yaml"] if cmd == "make train"
                else ["python -m train --help"])
    assert readme_commands(tmp_path) == expected
