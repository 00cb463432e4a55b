"""Quantized GEMMs under data/FSDP sharding: each device quantizes its own shard.

On 8 fake CPU devices (a subprocess: the devices must be set before jax starts), a small
layer ``y = x @ w`` with x ``[batch, seq, embed]`` sharded along the batch and w ``[embed,
mlp]`` along its rows (the model's FSDP rules) gets the same bits sharded as unsharded, in
the value and both gradients (the three GEMMs the interceptor runs: fprop, dgrad, wgrad):

* through `mxjax.dot_general` under the 'xla' backend (XLA:CPU's form), with ``jax.vjp``;
* for the emulation's GPU form (`mxjax.emulation.in_place.mx_gemm`, form 'gpu'), whose
  operand values are partitioned per shard (`in_place.sharded_operand_values`), and whose
  program gathers no activation (only what the GEMMs need: the operands' partial products
  are all-reduced);
* for the 'xla_fp4' route with its one-pass Pallas operand kernel forced on, in the Pallas
  interpreter (`xla_fp4.mx_gemm_fp4(kernel=True, interpret=True)`): the kernel runs per
  shard (`xla_fp4_kernel.run_codec_sharded`) and its window statistics are one max over
  the devices.

The fallbacks are checked too: a shard that would split a block gathers that axis first
(`xla_fp4_kernel.shard_spec`, `in_place.values_spec`).
"""

from __future__ import annotations

import textwrap
import types

import pytest

from tests.models.llama_test_utils import run_on_8_fake_devices

_SCRIPT = textwrap.dedent("""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import mxjax
    from mxjax.dimensions import Dims, backward_dimension_numbers
    from mxjax.emulation import in_place
    from mxjax.operands import rotation_signs
    from mxjax.routes import xla_fp4

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    policy = mxjax.policies.get("mxfp4_all_h16")
    # 128 tokens and 32 rows of w per device: whole 32-blocks (and H16 blocks) per shard;
    # more tokens than w has rows, as in training (XLA then gathers w, not activations).
    b, t, e, m = 8, 128, 256, 96
    # Small integers (times 2^-6 for w): the quantized products then sum exactly in f32
    # whatever the order, so the sharded GEMMs' partial sums (over the sharded tokens of
    # wgrad, the sharded rows of w) cannot hide or fake a difference in the quantized bits.
    def ints(key, shape, scale=1.0):
        return jax.random.randint(jax.random.key(key), shape, -8, 9).astype(jnp.float32) * scale
    x = ints(0, (b, t, e)).astype(jnp.bfloat16)
    w = ints(1, (e, m), 2.0 ** -6)
    g = ints(2, (b, t, m)).astype(jnp.bfloat16)
    dims = Dims(((2,), (0,)), ((), ()))
    (d_dims, _), (w_dims, _) = backward_dimension_numbers(dims, 3, 2)
    res = {}

    def sharded(*arrays):
        specs = {3: P("fsdp"), 2: P("fsdp", None)}
        return [jax.device_put(a, NamedSharding(mesh, specs[a.ndim])) for a in arrays]

    def same(name, fn, *args):  # bits unsharded vs sharded; the sharded program's gathers
        want = jax.jit(fn)(*args)
        # As the trainer runs: sharded arguments, no mesh context (ag_bytes.py's compile
        # of the 8B layer runs under jax.set_mesh).
        sargs = sharded(*args)
        got = jax.jit(fn)(*sargs)
        text = jax.jit(fn).lower(*sargs).compile().as_text()
        jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)),
                     want, got)
        gathers = re.findall(r"= (\\S+) all-gather(?:-start)?\\(", text)
        res[name] = gathers

    # 1. mxjax.dot_general (backend 'xla'): the value and both cotangents (jax.vjp).
    def layer(x, w, g):
        y, vjp = jax.vjp(lambda x, w: mxjax.dot_general(
            x, w, dims.as_lax(), policy=policy, operand_dtype=jnp.bfloat16), x, w)
        return (y,) + vjp(g)
    if "emulation" in PARTS:
        same("dot_general", layer, x, w, g)

    # 2./3. The three GEMMs of the layer on the GPU form and on the xla_fp4 kernel route.
    def gemms(route):
        def fn(x, w, g):
            wb = w.astype(jnp.bfloat16)
            out = []
            for name, (a, bb, dn) in {"fprop": (x, wb, dims), "dgrad": (g, wb, d_dims),
                                      "wgrad": (g, x, w_dims)}.items():
                r = getattr(policy, name)
                signs = None if r.hadamard is None else rotation_signs(r.hadamard, None)
                out.append(route(a, bb, dn, r, signs))
            return out
        return fn

    if "emulation" in PARTS:
        gpu = gemms(lambda a, b, dn, r, s: in_place.mx_gemm(a, b, dn, r, None, None, s,
                                                            form="gpu"))
        same("gpu_form", gpu, x, w, g)
    if "xla_fp4" in PARTS:
        fp4 = gemms(lambda a, b, dn, r, s: xla_fp4.mx_gemm_fp4(
            a, b, dn, r, None, None, s, kernel=True, interpret=True))
        same("xla_fp4_kernel", fp4, x, w, g)
    print("RESULT" + json.dumps(res))
""")


def _check(res):
    for name, gathers in res.items():
        # Only w may be gathered (in bf16 or f32, or as codes and scales), as bf16's FSDP
        # program gathers it: never a token-sharded activation or gradient (1024 tokens:
        # 512 bytes of FP4 codes, 64 scales).
        for shape in gathers:
            dims = shape.split("[")[1].split("]")[0].split(",")
            assert not {"1024", "512", "64"} & set(dims), (name, gathers)


@pytest.mark.slow
def test_sharded_layer_is_the_unsharded_bits_emulation():
    """The essential check (~11 s on 2 cores): mxjax.dot_general on XLA:CPU and the
    emulation's GPU form."""
    _check(run_on_8_fake_devices(_SCRIPT.replace("PARTS", "('emulation',)")))


@pytest.mark.slow
def test_sharded_layer_is_the_unsharded_bits_xla_fp4_kernel():
    """(make test-slow: ~75 s on 2 cores, the Pallas interpreter.) The 'xla_fp4' route with its
    operand kernel forced on."""
    _check(run_on_8_fake_devices(_SCRIPT.replace("PARTS", "('xla_fp4',)")))


_SR_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import mxjax
    from mxjax.routes import xla_nvfp4_kernel as K

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    sr = mxjax.policies.get("nvfp4").wgrad.lhs  # dY: NVFP4, stochastic rounding
    signs = mxjax.fixed_signs(0, 16)
    # dY [tokens, features], the tokens sharded: 64 per device
    dy = jax.random.normal(jax.random.key(1), (512, 96), jnp.float32).astype(jnp.bfloat16)
    key = jax.random.key(5)
    res = {}
    # axis 1: dgrad's blocks along the features, the sharded tokens its free axis;
    # axis 0: wgrad's, H16 along the sharded tokens (its contraction)
    for axis, h in ((1, None), (0, 16)):
        fn = jax.jit(lambda x, k: K.nvfp4_operand(x, axis, sr, hadamard_size=h,
                                                  signs=None if h is None else signs,
                                                  key=k, interpret=True))
        want = fn(dy, key)
        got = fn(jax.device_put(dy, NamedSharding(mesh, P("fsdp", None))), key)
        same = all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(want, got))
        res[f"axis{axis}"] = same
        text = fn.lower(jax.device_put(dy, NamedSharding(mesh, P("fsdp", None))),
                        key).compile().as_text()
        res[f"axis{axis}_gathers"] = text.count(" all-gather")
    # The MXFP8 kernel's pair on the same sharded operand: per shard too.
    from mxjax.routes import xla_mxfp8_kernel as K8
    op8 = mxjax.policies.get("mxfp8").fprop.lhs
    fn = jax.jit(lambda x: K8.mxfp8_operand_pair(x, op8, hadamard_size=None, signs=None,
                                                 interpret=True))
    sharded = jax.device_put(dy, NamedSharding(mesh, P("fsdp", None)))
    res["mxfp8"] = all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in
                       zip(jax.tree.leaves(fn(dy)), jax.tree.leaves(fn(sharded))))
    res["mxfp8_gathers"] = fn.lower(sharded).compile().as_text().count(" all-gather")
    print("RESULT" + json.dumps(res))
""")


@pytest.mark.slow
def test_stochastic_rounding_of_a_sharded_operand_draws_at_whole_operand_positions():
    """(make test-slow: the Pallas interpreter.) The NVFP4 kernel's in-kernel draws on a
    token-sharded dY, blocked along its free axis and along the sharded axis: each shard
    draws at its place in the whole operand, so the bits are the unsharded kernel's; and
    the MXFP8 pair kernel on it, per shard (no all-gather), the same bits."""
    res = run_on_8_fake_devices(_SR_SCRIPT)
    assert res["axis1"] and res["axis0"], res
    assert res["axis1_gathers"] == 0 and res["axis0_gathers"] == 0, res  # per shard
    assert res["mxfp8"] and res["mxfp8_gathers"] == 0, res  # the MXFP8 pair kernel too


def test_blocks_never_cross_a_shard_boundary():
    from mxjax.emulation import in_place
    from mxjax.routes import xla_fp4_kernel as kernel

    mesh = types.SimpleNamespace(shape={"a": 4, "b": 2})  # only its axis sizes are read
    # 64 rows over 4 devices: 16 per shard, not a whole 32-block: that axis is gathered
    # where a direction blocks along it, kept where it is a free axis.
    assert kernel.shard_spec(mesh, ("a", "b"), (64, 256), (1, 0), None) == (None, "b")
    assert kernel.shard_spec(mesh, ("a", "b"), (64, 256), (1,), None) == ("a", "b")
    assert kernel.shard_spec(mesh, ("a",), (256, 64), (0,), 32) == ("a", None)
    assert kernel.shard_spec(mesh, ("a",), (256, 64), (0,), 128) == (None, None)
    assert kernel.shard_spec(mesh, (("a", "b"),), (256, 64), (0,), 16) == (("a", "b"), None)
    # The emulation's values: the block axis only without padding and with whole blocks.
    assert in_place.values_spec(mesh, ("a", None, "b"), (8, 4, 64), 2, 32, True) == (
        "a", None, "b")
    assert in_place.values_spec(mesh, ("a", None, "b"), (8, 4, 64), 2, 64, True) == (
        "a", None, None)
    assert in_place.values_spec(mesh, ("a", None, "b"), (8, 4, 64), 2, 32, False) == (
        "a", None, None)
    assert in_place.values_spec(mesh, (None, "a"), (8, 6), 0, 32, True) == (None, None)


