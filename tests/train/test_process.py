"""train.process: --distributed without a cluster, or with a peer that never comes, ends with a
message saying what was awaited and exit code 8, not a ValueError or a C++ abort after 300 s."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.train.train_testutil import ROOT

# One subprocess: both cases need a process whose JAX backends are not initialized yet.
_SCRIPT = """
from train.__main__ import main
from train.config import MeshSection
from train.process import init_distributed
print("NO_CLUSTER_RC", main(["--distributed", "--check", "--quiet"]), flush=True)
init_distributed(MeshSection(distributed=True, coordinator_address="127.0.0.1:{port}",
                             num_processes=2, process_id=0, init_timeout_s=2))
print("NOT REACHED", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_no_cluster_and_missing_peer_exit_8_with_a_message():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR"))}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", _SCRIPT.format(port=_free_port())], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    wall = time.time() - t0
    out = p.stdout + p.stderr
    assert "NO_CLUSTER_RC 8" in p.stdout, out
    assert "No cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) was detected" in p.stderr
    assert "mesh.coordinator_address=host:port" in p.stderr
    assert p.returncode == 8, out
    assert "NOT REACHED" not in p.stdout
    assert ("process 0 of 2: waiting up to 2s (mesh.init_timeout_s) for every process of the "
            "run to join the coordinator at 127.0.0.1:") in p.stderr
    assert "not every process joined within 2s" in p.stderr
    assert "Check failure stack trace" not in p.stderr and "Traceback" not in p.stderr, out
    assert wall < 60  # the configured 2 s, not JAX's 300 s default
