"""Where the xla_fp8 layer's time goes on a GPU (a probe for the lent H200).

First the quantize passes alone on a [8192, 14336] bf16 operand (XLA's two-pass form into
FP8; unless --no-pallas, the Pallas fused_quantize row- and column-wise), and one
lax.cond; then the Llama 3.1-8B layer (seq 8192, fwd+bwd, fused attention) under
--policies (default: bf16, mxfp4_all_h16@xla_fp8, fp8, mxfp4_all_h16), compiled first,
timed in interleaved rounds (medians of 5 after 2 warm-ups), ratio to the first.

    PYTHONPATH=$PWD python3 bench/gpu_probe_xla_fp8.py 215 [--policies ...] [--no-pallas]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

import mxjax
from bench import programs
from mxjax import policies
from mxjax.kernels import QuantSpec, fused_quantize
from mxjax.kernels.fp8_operand import fp8_operand
from mxjax.routes import in_place, xla_fp8

T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def run(fn, args, n=1):
    out = fn(*args)
    jax.block_until_ready(out)
    return out


def timeit(fn, args, iters=5):
    run(fn, args)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        run(fn, args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def layer_rows(budget_s, policies_csv):
    """The layer's step time per policy (the Pallas-quantizer variant of 2026-12-04 was
    measured with the route's quantizer switched to the kernel: 120.7 ms)."""
    rows = {}
    specs = [(p, "passthrough" if p == "bf16" else p, False) for p in policies_csv.split(",")]
    compiled = {}
    args = None
    for name, pol, _ in specs:
        if time.perf_counter() - T0 > budget_s:
            log(f"skip {name} (budget)")
            continue
        fn, abstract = programs.program("layer_8b", pol, attention_impl="fused")
        if args is None:
            args = programs.concrete_args(abstract)
        t = time.perf_counter()
        try:
            compiled[name] = jax.jit(fn).lower(*args).compile()
        except Exception as e:  # noqa: BLE001
            log(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        log(f"{name} compiled in {time.perf_counter() - t:.1f} s")
    for _ in range(2):
        for name, c in compiled.items():
            run(c, args)
    times = {name: [] for name in compiled}
    for _ in range(5):
        for name, c in compiled.items():
            t = time.perf_counter()
            run(c, args)
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        rows[name] = statistics.median(ts)
    base = rows.get(policies_csv.split(",")[0])
    for name, t in rows.items():
        log(f"layer8b {name:18s} {t * 1e3:8.2f} ms  {t / base:5.2f}x bf16" if base else name)
    return rows


def quantize_rows(pallas: bool):
    x = (0.02 * jax.random.normal(jax.random.key(0), (8192, 14336))).astype(jnp.bfloat16)
    op = policies.get("mxfp4_all_h16").fprop.lhs
    signs = mxjax.fixed_signs(0, 16)
    spec = QuantSpec(recipe=op, hadamard=16)

    def xla_operand(v, axis, recompute=True):
        carrier = xla_fp8.LHS_CARRIER

        def finish(w, ab):
            t = xla_fp8.carrier_window(ab, op, carrier)[0]
            return xla_fp8.encode_exact(w, t, carrier), None

        return in_place.mx_operand_values(
            in_place.contraction_view(v, (), (axis,)), op, k_out=v.shape[axis],
            hadamard_size=16, signs=signs, key=None, recompute=recompute, finish=finish)[0]

    cases = {
        "pallas row": jax.jit(lambda v: fused_quantize(v, row=spec, row_signs=signs,
                                                       value_dtype=jnp.float32)[0].codes),
        "pallas col": jax.jit(lambda v: fused_quantize(v, col=spec, col_signs=signs,
                                                       value_dtype=jnp.float32)[1].codes),
        "pallas row 64x256": jax.jit(lambda v: fused_quantize(
            v, row=spec, row_signs=signs, value_dtype=jnp.float32, block_rows=64,
            block_cols=256)[0].codes),
        "pallas_operand row (+decode)": jax.jit(lambda v: fp8_operand(
            v, 1, op, hadamard_size=16, signs=signs, key=None,
            carrier=xla_fp8.LHS_CARRIER)[0]),
        "xla two-pass row (f8)": jax.jit(lambda v: xla_operand(v, 1)),
        # Without the recompute barrier (deviceless: 1.89 GB moved vs 1.66 GB with it).
        "xla two-pass row (f8, no barrier)": jax.jit(lambda v: xla_operand(v, 1, False)),
        "xla two-pass col (f8)": jax.jit(lambda v: xla_operand(v, 0)),
        "copy (x+1)": jax.jit(lambda v: v + 1),
    }
    for name, fn in cases.items():
        if not pallas and "pallas" in name:
            continue
        try:
            t = timeit(fn, (x,))
            log(f"quantize {name:30s} {t * 1e6:9.1f} us  {2 * x.size / t / 1e9:7.0f} GB/s of input")
        except Exception as e:  # noqa: BLE001
            log(f"quantize {name}: {type(e).__name__}: {str(e)[:200]}")


def cond_row():
    x = jnp.ones((1024,), jnp.float32)
    f = jax.jit(lambda v: jax.lax.cond(v[0] > 0, lambda u: u + 1, lambda u: u - 1, v))
    g = jax.jit(lambda v: v + 1)
    log(f"cond 1k: {timeit(f, (x,), 20) * 1e6:.1f} us vs plain {timeit(g, (x,), 20) * 1e6:.1f} us")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("budget_s", type=float, nargs="?", default=200.0,
                    help="no layer compile starts after this many seconds")
    ap.add_argument("--policies", default="bf16,mxfp4_all_h16@xla_fp8,fp8,mxfp4_all_h16",
                    help="the layer rows (the first is the baseline)")
    ap.add_argument("--no-pallas", action="store_true", help="skip the Pallas quantize rows")
    args = ap.parse_args()
    log(f"jax {jax.__version__} {jax.devices()}")
    quantize_rows(not args.no_pallas)
    cond_row()
    layer_rows(args.budget_s, args.policies)
