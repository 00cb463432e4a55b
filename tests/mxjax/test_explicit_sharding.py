"""Quantized GEMMs under JAX's explicit sharding mode, on 8 fake CPU devices.

``jax.make_mesh`` makes explicit axes by default in jax 0.12; under ``jax.set_mesh``
every array's type carries its sharding, and ``lax.dot_general`` decides the result's
sharding (or asks for ``out_sharding`` where that is ambiguous). mxjax's GEMMs must do
the same, forward and backward, for every preset: the same values as unsharded (up to
the f32 summation order of partitioned products), the shardings ``lax.dot_general`` and
its transpose rule give, and no communication beyond what ``lax.dot_general`` needs.
Each test runs one subprocess (the fake devices must be set before jax starts).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import mxjax

_SCRIPT = textwrap.dedent(
    """
    import re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import mxjax

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert all(t == AxisType.Explicit for t in mesh.axis_types), mesh.axis_types
    # argv: preset[:layout+layout],... (default: every layout), then "checks" or "-"
    presets = dict(a.split(":") if ":" in a else (a, "batch+tensor")
                   for a in sys.argv[1].split(","))
    checks = sys.argv[2] == "checks"
    dims = (((1,), (0,)), ((), ()))
    # M, K, N: every shard holds whole 32-blocks along each GEMM's contraction
    x = jax.random.normal(jax.random.key(0), (256, 128), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (128, 64), jnp.float32) * 0.1
    key = jax.random.key(2)

    def dot(p, **kw):
        return lambda x, w: mxjax.dot_general(x, w, dims, policy=p, key=key, **kw)

    def vg(p, **kw):  # jitted (x, w) -> ((loss, y), (dx, dw)), loss = sum(y**2)
        def loss(x, w):
            y = dot(p, **kw)(x, w)
            return jnp.sum(y ** 2), y
        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))

    def spec(a):
        s = jax.typeof(a).sharding.spec
        return tuple(s) + (None,) * (a.ndim - len(s))

    def close(got, want, tol=1e-5):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want)), \\
            float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

    def put(a, *s):
        return jax.device_put(a, NamedSharding(mesh, P(*s)))

    def collectives(compiled):  # (kind, result type) of each collective, sorted
        out = []
        for line in compiled.as_text().splitlines():
            m = re.search(r"= (.*?) ?(all-gather|all-reduce|reduce-scatter|all-to-all|"
                          r"collective-permute)(-start)?\\(", line)
            if m:
                out.append((m.group(2), re.sub(r"\\{[0-9,]*\\}", "", m.group(1))))
        return sorted(out)

    LAYOUTS = {"batch": ((("data", None)), (None, None)),      # data parallel
               "tensor": (("data", None), (None, "model"))}   # + tensor parallel W
    programs = {}  # (preset, layout) -> compiled program (the collectives check reads them)
    lax_dot = jax.jit(lambda a, b: lax.dot_general(a, b, dims))  # one compile per layout
    for p, layouts in list(presets.items()) + ([("bf16", "tensor")] if checks else []):
        (ref_loss, ref_y), (ref_dx, ref_dw) = vg(p)(x, w)
        for name in layouts.split("+"):
            xs, ws = LAYOUTS[name]
            with jax.set_mesh(mesh):
                xa, wa = put(x, *xs), put(w, *ws)
                programs[(p, name)] = vg(p).lower(xa, wa).compile()
                (loss, y), (dx, dw) = programs[(p, name)](xa, wa)
                want_y = lax_dot(xa, wa)
            where = (p, name)
            # lax.dot_general's result sharding; cotangents sharded as their primals
            assert spec(y) == spec(want_y), (where, spec(y), spec(want_y))
            assert spec(dx) == spec(xa) and spec(dw) == spec(wa), (where, spec(dx), spec(dw))
            # The same quantized operands: equal up to the f32 summation order of the
            # partitioned products (one operand element one grid step off is ~1e-2).
            close(y, ref_y, 2e-6)
            close(dx, ref_dx)
            close(dw, ref_dw)
            close(loss, ref_loss)
        print("PRESET_OK", p)

    if checks:
        p = "mxfp4_all"
        with jax.set_mesh(mesh):
            xa, wa = put(x, "data", None), put(w, None, "model")
            # out_sharding as lax.dot_general's: the result takes it
            y = jax.jit(dot(p, out_sharding=P("data", None)))(xa, wa)
            assert spec(y) == ("data", None), spec(y)
            y_ref = jax.jit(dot(p))(x, w)
            close(y, y_ref, 2e-6)
            # a sharded contraction: the same error as lax.dot_general without out_sharding,
            # the same sharding with it (partial sums: equal up to f32 summation order)
            xk, wk = put(x, None, "model"), put(w, "model", None)
            errs = []
            for f in (lambda a, b: lax.dot_general(a, b, dims), dot(p)):
                try:
                    jax.jit(f)(xk, wk)
                    errs.append(None)
                except Exception as e:
                    errs.append((type(e).__name__, str(e).splitlines()[0]))
            assert errs[0] is not None and errs[0] == errs[1], errs
            assert "Contracting dimensions are sharded" in errs[1][1], errs
            (_, y), (dx, dw) = vg(p, out_sharding=P("data", None))(xk, wk)
            assert spec(y) == ("data", None)
            assert spec(dx) == (None, "model") and spec(dw) == ("model", None)
            close(y, y_ref, 1e-6)
            close(dx, vg(p)(x, w)[1][0])

            # Communication: the partitioned programs (compiled for the 8 CPU devices) have
            # lax.dot_general's collectives and no all-gather; per-tensor scales add only
            # scalar u32 all-reduces (the tensor amax).
            plain = collectives(programs[("bf16", "tensor")])
            assert plain and not any(k == "all-gather" for k, _ in plain), plain
            assert collectives(programs[("mxfp4_all_h16", "tensor")]) == plain
            extra = list(collectives(programs[("fp8", "tensor")]))
            for c in plain:
                extra.remove(c)
            assert extra and all(k == "all-reduce" and re.fullmatch(r"\\(?(u32\\[\\],? ?)+\\)?", t)
                                 for k, t in extra), extra
            # The accelerator program: jax.export for CUDA lowers under the explicit mesh and
            # keeps every 2-D intermediate sharded (no constraint replicating one).
            sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.typeof(a).sharding)
                   for a in (xa, wa)]
            exp = jax.export.export(vg("mxfp4_all_h16"), platforms=["cuda"])(*sds)
            mod = exp.mlir_module()
            constraints = [ln for ln in mod.splitlines() if "sdy.sharding_constraint" in ln]
            assert constraints
            assert not [ln for ln in constraints if "[{}, {}]" in ln], constraints
        print("CHECKS_OK")
    """
)


def _xla_flags_with_8_devices() -> str:
    """The session's XLA_FLAGS (tests/conftest.py's compile level) plus 8 CPU devices."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()


def _run(presets, checks: bool):
    env = dict(os.environ, XLA_FLAGS=_xla_flags_with_8_devices(),
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, ",".join(presets),
                        "checks" if checks else "-"], env=env, capture_output=True, text=True,
                       timeout=1800, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for p in presets:
        assert f"PRESET_OK {p.split(':')[0]}" in r.stdout, r.stdout
    assert ("CHECKS_OK" in r.stdout) == checks


@pytest.mark.slow
def test_explicit_sharding_hadamard_and_per_tensor_presets():
    """The two failures seen (the rotation's reshape, the backward's sharded contraction),
    out_sharding and sharded contracting dims as lax.dot_general, the collectives.
    fp8 in the tensor-parallel layout only (its data-parallel layout, a subset: x sharded
    the same way, w replicated, runs in test_explicit_sharding_every_preset, slow); the
    Hadamard preset in both."""
    _run(["mxfp4_all_h16", "fp8:tensor"], checks=True)


@pytest.mark.slow  # every preset: ~3 compiles each
def test_explicit_sharding_every_preset():
    _run([p for p in mxjax.policies.names()
          if p not in ("mxfp4_all_h16", "mxfp4_all_h16_wgrad")], checks=False)
