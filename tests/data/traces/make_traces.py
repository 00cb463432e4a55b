"""Writes the trace fixtures of tests/test_device_trace.py (see README.md here).

    PYTHONPATH=. python tests/data/traces/make_traces.py

* ``cpu_step.trace.json.gz`` and ``cpu_step.hlo.txt``: a real profile, recorded on this
  CPU with ``jax.profiler.trace`` (3 calls of a jitted bf16 GEMM + tanh + transpose
  after a warm-up), and the program's optimized HLO (``compiled.as_text()``).
* ``gpu_step.trace.json.gz``: a GPU-shaped trace built here event by event in the form
  jax writes on a GPU (bench/device/trace.py's docstring): processes ``/host:CPU`` and
  ``/device:GPU:0``, stream threads with one event per kernel (``args.hlo_op``,
  ``args.hlo_module``) and the derived ``XLA Ops``/``XLA Modules`` lines repeating
  their time, which a parser must not count twice. Its kernels and durations are made
  up (cuBLASLt, cuDNN and fusion kernel names of the kinds an H100 runs), so the totals
  the test expects are known exactly.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def record_cpu() -> None:
    import jax
    import jax.numpy as jnp

    def step(a, b):
        return jnp.tanh(jnp.dot(a, b, preferred_element_type=jnp.float32)).T + 1.0

    a = jnp.ones((64, 128), jnp.bfloat16)
    b = jnp.ones((128, 32), jnp.bfloat16)
    compiled = jax.jit(step).lower(a, b).compile()
    compiled(a, b).block_until_ready()
    log_dir = Path(tempfile.mkdtemp())
    try:
        with jax.profiler.trace(str(log_dir)):
            for _ in range(3):
                compiled(a, b).block_until_ready()
        (found,) = log_dir.glob("plugins/profile/*/*.trace.json.gz")
        shutil.copyfile(found, HERE / "cpu_step.trace.json.gz")
    finally:
        shutil.rmtree(log_dir)
    (HERE / "cpu_step.hlo.txt").write_text(compiled.as_text())


# (stream, kernel name, hlo_op, durations in us of each of the 2 steps)
GPU_KERNELS = [
    (20, "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "custom-call.3", (410.0, 414.0)),
    (20, "sm90_xmma_gemm_e4m3e4m3_f32_tn_n_tilesize128x256x128", "custom-call.7", (205.5, 204.5)),
    (20, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "custom-call.9", (300.0, 302.0)),
    (20, "loop_convert_fusion_2", "loop_convert_fusion.2", (20.25, 19.75)),
    (20, "input_reduce_fusion", "input_reduce_fusion", (11.0, 13.0)),
    (21, "MemcpyD2D", "copy-start.1", (7.5, 8.5)),
]


def build_gpu() -> None:
    host, gpu = 701, 1001
    events = [
        {"ph": "M", "pid": host, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": host, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": gpu, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": gpu, "tid": 20, "name": "thread_name",
         "args": {"name": "Stream #20(Compute)"}},
        {"ph": "M", "pid": gpu, "tid": 21, "name": "thread_name",
         "args": {"name": "Stream #21(MemcpyD2D)"}},
        {"ph": "M", "pid": gpu, "tid": 2, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": gpu, "tid": 3, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    t = 100.0
    for step in range(2):
        start = t
        events.append({"ph": "X", "pid": host, "tid": 1, "ts": t - 50.0, "dur": 40.0,
                       "name": "PjitFunction(step)"})
        for stream, name, op, durs in GPU_KERNELS:
            args = {"hlo_module": "jit_step", "hlo_op": op, "correlation_id": str(step * 10)}
            events.append({"ph": "X", "pid": gpu, "tid": stream, "ts": t, "dur": durs[step],
                           "name": name, "args": args})
            events.append({"ph": "X", "pid": gpu, "tid": 3, "ts": t, "dur": durs[step],
                           "name": op, "args": {"long_name": f"%{op} = ..."}})
            t += durs[step] + 2.0
        events.append({"ph": "X", "pid": gpu, "tid": 2, "ts": start, "dur": t - start,
                       "name": "jit_step(1234)", "args": {}})
        t += 100.0
    # A kernel of another module (an argument's transfer) outside the step.
    events.append({"ph": "X", "pid": gpu, "tid": 20, "ts": t, "dur": 3.0,
                   "name": "MemcpyH2D", "args": {"hlo_module": "jit_init", "hlo_op": "copy"}})
    trace = {"displayTimeUnit": "ns", "metadata": {"highres-ticks": True},
             "traceEvents": events}
    with gzip.open(HERE / "gpu_step.trace.json.gz", "wt") as f:
        json.dump(trace, f)


if __name__ == "__main__":
    record_cpu()
    build_gpu()
