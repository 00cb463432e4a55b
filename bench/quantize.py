"""MXFP4 quantize throughput, measured side by side in one process.

For a 4096x4096 f32 array and a bf16 one, times (jit'ed, block_until_ready):
  memcpy      numpy copy of the same array (bandwidth floor: read + write once)
  jax         jax's own MXFP4 quantizer, the one `jax.nn.scaled_dot_general` calls
              with get_scaled_dot_general_config('mxfp4') (shape_normalization +
              quantize from jax._src.cudnn.scaled_matmul_stablehlo)
  q/fq ...    mxjax.quantize (packed codes + scales) and mxjax.fake_quantize, for
              RNE+FLOOR, RNE+EVEN, and hadamard(16) fused with RNE+EVEN quantize
Candidates run interleaved (round-robin, one call each per round) after a warm-up;
the table shows medians over the rounds, M elements/s, and speed relative to jax's
quantizer (>1 is faster), plus the targets:
  fake_quantize >= 2x jax's, packed quantize >= 1.5x jax's,
  H16+quantize time <= 1.3x plain quantize (same rule).

Usage: python bench/quantize.py [--n 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import mxjax


def _jax_mxfp4_quantizer():
    """jax's MXFP4 quantizer as scaled_dot_general runs it on a (M, K) operand, K contracted."""
    try:
        from jax._src.cudnn.scaled_matmul_stablehlo import quantize, shape_normalization
    except ImportError as e:  # no silent fallback: the comparison is the point
        raise ImportError(
            f"bench/quantize.py: jax {jax.__version__} has no "
            "jax._src.cudnn.scaled_matmul_stablehlo.quantize to compare against") from e
    config = jax.nn.get_scaled_dot_general_config("mxfp4")

    def run(x):
        # scaled_dot_impl: lhs_3d = shape_normalization(lhs, (contracting, batch))
        x3 = shape_normalization(x, ((x.ndim - 1,), ()))
        return quantize(x3, config)

    return jax.jit(run)


def _candidates(x: jax.Array, x_np: np.ndarray):
    even, floor = mxjax.ScaleRule.EVEN, mxjax.ScaleRule.FLOOR
    fmt = mxjax.MXFP4
    dst = np.empty_like(x_np)

    def memcpy():
        np.copyto(dst, x_np)
        return dst

    jq = _jax_mxfp4_quantizer()
    fns = {
        "memcpy (numpy)": memcpy,
        "jax mxfp4 quantize": lambda: jq(x),
        "q RNE+FLOOR": jax.jit(lambda a: mxjax.quantize(a, fmt, scale_rule=floor)),
        "q RNE+EVEN": jax.jit(lambda a: mxjax.quantize(a, fmt, scale_rule=even)),
        "q H16+RNE+EVEN": jax.jit(
            lambda a: mxjax.quantize(mxjax.hadamard(a, 16), fmt, scale_rule=even)),
        "fq RNE+FLOOR": jax.jit(lambda a: mxjax.fake_quantize(a, fmt, scale_rule=floor)),
        "fq RNE+EVEN": jax.jit(lambda a: mxjax.fake_quantize(a, fmt, scale_rule=even)),
        "fq H16+RNE+EVEN": jax.jit(
            lambda a: mxjax.fake_quantize(mxjax.hadamard(a, 16), fmt, scale_rule=even)),
    }
    out = {}
    for name, f in fns.items():
        if name.startswith(("q ", "fq ")):
            out[name] = (lambda f=f: f(x))
        else:
            out[name] = f
    return out


def _measure(cands: dict, rounds: int, warmup: int = 1) -> dict[str, float]:
    for f in cands.values():
        for _ in range(warmup):
            jax.block_until_ready(f())
    times = {name: [] for name in cands}
    for _ in range(rounds):  # interleaved: one call of each candidate per round
        for name, f in cands.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _table(dtype_name: str, n_elem: int, med: dict[str, float]) -> list[str]:
    t_jax = med["jax mxfp4 quantize"]
    rows = [f"\n{dtype_name}: {n_elem / 1e6:.1f} M elements, median of rounds",
            f"{'candidate':<22}{'median ms':>11}{'M elem/s':>11}{'vs jax':>9}  target"]
    for name, t in med.items():
        target = ""
        if name.startswith("fq ") and "H16" not in name:
            target = f">= 2.00x jax: {'MET' if t_jax / t >= 2 else 'MISSED'}"
        elif name.startswith("q ") and "H16" not in name:
            target = f">= 1.50x jax: {'MET' if t_jax / t >= 1.5 else 'MISSED'}"
        elif "H16" in name:
            plain = med[name.replace("H16+", "")]
            r = t / plain
            target = f"H16 cost {r:.2f}x plain (<= 1.30x): {'MET' if r <= 1.3 else 'MISSED'}"
        rows.append(f"{name:<22}{t * 1e3:>11.2f}{n_elem / t / 1e6:>11.1f}{t_jax / t:>8.2f}x  "
                    f"{target}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096, help="array is n x n (default 4096)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    print(f"mxjax bench/quantize.py: jax {jax.__version__}, backend {dev.platform} "
          f"({dev.device_kind}), {os.cpu_count()} CPUs, {platform.processor() or 'cpu'}")
    rng = np.random.default_rng(0)
    base = rng.standard_normal((args.n, args.n), dtype=np.float32)
    lines = []
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.device_put(jnp.asarray(base, dtype))
        x_np = np.asarray(x)  # same values, host copy for the memcpy floor
        med = _measure(_candidates(x, x_np), args.rounds)
        lines += _table(jnp.dtype(dtype).name, base.size, med)
        print("\n".join(lines[-(len(med) + 2):]), flush=True)


if __name__ == "__main__":
    main()
