"""The tests section: the -m gpu correctness tests, in a subprocess, before this process
touches the GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bench.device.harness import ROOT, STATE, log

GPU_TEST_FILES = ("tests/mxjax/kernels/test_kernels_gpu.py",
                  "tests/mxjax/emulation/test_fp8_units_gpu.py",
                  "tests/models/test_fused_attention.py",
                  "tests/mxjax/routes/test_xla_fp8_gpu.py",
                  "tests/mxjax/routes/test_xla_fp4_gpu.py")
# --quick-tests deselects these (node-id prefixes; a test added to the files still runs):
# the fused-quantize kernel tests, the second GEMM shape, the FP8
# tensor-core bound at K = 256 (K = 4096 stays).
_KERNELS, _FP8, _ATTN, _XLA_FP8, _FP4 = GPU_TEST_FILES
QUICK_TESTS_DESELECT = (
    f"{_KERNELS}::test_fused_quantize_bit_exact",
    f"{_KERNELS}::test_fused_quantize_stochastic",
    f"{_KERNELS}::test_gemm_backends_within_tolerance[shape1]",
    f"{_FP8}::test_tensor_core_gemm_is_within_the_device_bound[256-",
    _FP4,  # the B200 route (on Hopper XLA expands its block-scaled dot to f32)
)


def run_gpu_tests(quick: bool, timeout_s: float) -> tuple[bool, str]:
    """Runs the -m gpu tests in a subprocess (its output goes to ours): (passed, summary).

    Call before this process initializes the GPU: both processes would preallocate.
    """
    deselect = [a for d in QUICK_TESTS_DESELECT for a in ("--deselect", d)] if quick else []
    log(f"running GPU correctness tests ({'--quick-tests subset' if quick else 'all'}; "
        f"timeout {timeout_s:.0f} s): pytest -m gpu {' '.join(GPU_TEST_FILES)}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # --dump-autotune's file is this process's compiles only.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_gpu_dump_autotune_results_to"))
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rxs",
         "-s", "--durations=12", *deselect, *GPU_TEST_FILES],
        cwd=ROOT, env=env, start_new_session=True)
    STATE["child"] = proc
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False, f"FAILED: timed out after {timeout_s:.0f} s (killed)"
    finally:
        STATE["child"] = None
    took = time.perf_counter() - t
    which = "quick subset" if quick else "all"
    if rc != 0:
        return False, f"FAILED (pytest exit code {rc}, {which}, {took:.0f} s)"
    return True, f"passed ({which}, {took:.0f} s)"
