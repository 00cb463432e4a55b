"""Every ```python block of README.md runs as written (one namespace each).

Blocks fenced as ```py are illustrations that would start real training runs; they
are not executed here (the CLI they stand for is tested in tests/train).
"""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# The wrap example is run, with assertions on its report, by tests/mxjax/nn/test_nn.py.
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
          if "mxjax.nn.wrap" not in b]


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})  # noqa: S102
