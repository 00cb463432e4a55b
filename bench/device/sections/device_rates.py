"""Copy bandwidth and launch overhead, as the measurement file records them.

* ``copy_bandwidth_gbs``: a large f32 array read and written once (``x + 1``), bytes read
  plus bytes written per second.
* ``launch_overhead_us``: the time each extra kernel adds to one program: a chain of tiny
  (256-element) multiply-adds kept apart by ``optimization_barrier`` so that XLA cannot
  fuse them, timed at two lengths; the difference over the difference of their kernel
  counts (from the compiled HLO, `bench.costmodel.hlo_kernels`). None, with the reason,
  where the longer chain did not compile to more kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.device.harness import Table, log, timeit

__all__ = ["copy_bandwidth_gbs", "device_rates_section", "launch_overhead_us"]

CHAIN = (1, 64)  # kernels in the short and the long chain asked for


def copy_bandwidth_gbs(elements: int) -> float:
    x = jnp.ones((elements,), jnp.float32)
    t = timeit(jax.jit(lambda v: v + 1.0), x)
    return 2 * 4 * elements / t / 1e9


def _chain(n: int):
    def f(x):
        for _ in range(n):
            x = jax.lax.optimization_barrier(x * 1.0001 + 0.5)
        return x

    return f


def launch_overhead_us() -> tuple[float | None, str]:
    """(microseconds per extra kernel or None, how it was measured or why not)."""
    from bench.costmodel import hlo_kernels as hk

    x = jnp.ones((256,), jnp.float32)
    times, counts = [], []
    for n in CHAIN:
        compiled = jax.jit(_chain(n)).lower(x).compile()
        counts.append(len(hk.kernels(compiled.as_text())))
        times.append(timeit(compiled, x, iters=50, warmup=5))
    if counts[1] <= counts[0]:
        return None, (f"not measured: the {CHAIN[1]}-step chain compiled to {counts[1]} "
                      f"kernels, the {CHAIN[0]}-step one to {counts[0]}")
    us = (times[1] - times[0]) / (counts[1] - counts[0]) * 1e6
    if us <= 0:
        return None, f"not measured: the longer chain ran no slower ({times} s)"
    return us, (f"({times[1] * 1e6:.1f} - {times[0] * 1e6:.1f}) us / ({counts[1]} - "
                f"{counts[0]}) kernels")


def device_rates_section(table: Table, *, copy_elements: int) -> tuple[float, float | None]:
    """(copy GB/s, launch us or None), also as rows of `table`."""
    rows = table.section("Copy bandwidth and launch overhead", ("what", "value", "how"))
    bw = copy_bandwidth_gbs(copy_elements)
    rows.append(("copy (read + write)", f"{bw:.0f} GB/s", f"{copy_elements} f32, x + 1"))
    launch, how = launch_overhead_us()
    rows.append(("launch overhead", f"{launch:.2f} us/kernel" if launch else "n/a", how))
    log(f"copy {bw:.0f} GB/s; launch {launch if launch is None else round(launch, 2)} us ({how})")
    return bw, launch
