"""train.memory's estimate against XLA's memory_analysis of the train step compiled for 8
H100s (one host, ``mesh.fsdp=8``), without a device: the 8B config scaled to one layer, as
configs/llama3_8b_mlperf.yaml trains it (fused attention, remat) and in the explicit form
without remat, which keeps the 32 x 8192 x 8192 scores of each sequence.

The full 32-layer rows (8 and 16 H100s, with and without remat and fused attention) are in
docs/RELIABILITY.md ("Memory"); bench/memory_estimate.py prints them.
"""

from __future__ import annotations

import pytest

from bench.costmodel.train_memory import compare
from models.llama import LlamaConfig
from tests.accelerators.conftest import require

pytestmark = pytest.mark.accelerators

# estimate / XLA stays within this factor either way (one layer on 8 H100s measured 1.13
# fused with remat, 0.87 explicit without; the 32-layer model 0.69 to 1.17).
FACTOR = 1.5


@pytest.mark.parametrize(("attention", "remat"), [("fused", True), ("explicit", False)])
def test_estimate_is_within_a_factor_of_xla_on_8_h100s(attention, remat):
    require("h100")
    mc = LlamaConfig.llama3_8b(n_layers=1, max_seq_len=8192, attention_impl=attention,
                               remat=remat, dtype="bfloat16", param_dtype="float32")
    row = compare(mc, seq_len=8192, micro_batch=16, mesh_shape=(1, 8, 1), target_name="h100")
    assert 1 / FACTOR <= row.ratio <= FACTOR, row
    # the attention form is what tells the two apart: 24 GiB of scores kept without fusion
    if attention == "explicit":
        assert row.temp > 40 * 2**30, row
