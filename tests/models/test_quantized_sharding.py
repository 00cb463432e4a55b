"""Sharding under a quantized policy, on 8 fake CPU devices (in a subprocess).

* The compiled train step (loss and grads) of a sharded one-layer tiny Llama has
  the same collectives (kind and count) under ``mxfp4_all_h16`` as under ``bf16``:
  the emulation adds no communication and keeps the layout. (The token count per
  shard is a multiple of the 32-element block: otherwise the wgrad operands are
  zero-padded along the sharded token axis, which costs halo exchanges.)
* ``out_sharding`` reaches quantized GEMMs: on an explicit mesh the result of
  ``mxjax.dot_general(..., out_sharding=...)`` has the requested sharding, as
  ``lax.dot_general``'s does.
"""

from __future__ import annotations

import textwrap

import pytest
from llama_test_utils import run_on_8_fake_devices

_SCRIPT = textwrap.dedent("""
    import collections, json, re
    import jax, jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import mxjax
    from models import sharding as shd
    from models.llama import Llama, LlamaConfig

    assert jax.device_count() == 8, jax.devices()
    cfg = LlamaConfig.tiny(vocab_size=256, n_layers=1, dtype="bfloat16")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    shd.shard_model(model, mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(1), (4, 65), 0, cfg.vocab_size),
        NamedSharding(mesh, shd.logical_to_pspec(("batch", "seq"), mesh=mesh)))
    pattern = re.compile(r"\\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\\(")

    def collectives(policy_name):
        policy = mxjax.policies.get(policy_name)

        def loss(p, t):
            logits = nnx.merge(graphdef, p)(t[:, :-1], policy=policy)
            return jnp.mean(jnp.square(logits.astype(jnp.float32)))

        with shd.use_mesh(mesh):
            hlo = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile().as_text()
        return dict(collections.Counter(pattern.findall(hlo)))

    res = {"bf16": collectives("bf16"), "mxfp4_all_h16": collectives("mxfp4_all_h16")}

    emesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((64, 96), jnp.bfloat16), NamedSharding(emesh, P("data", None)))
    w = jax.device_put(jnp.ones((96, 32), jnp.bfloat16), NamedSharding(emesh, P(None, "tensor")))
    dims = (((1,), (0,)), ((), ()))
    specs = {}
    with jax.set_mesh(emesh):
        for want in (P("data", None), P(None, "tensor"), P("data", "tensor")):
            ref = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims, out_sharding=want))(x, w)
            got = jax.jit(lambda a, b: mxjax.dot_general(
                a, b, dims, policy="mxfp4_all", out_sharding=want))(x, w)
            specs[str(want)] = [str(ref.sharding.spec), str(got.sharding.spec)]
    res["out_sharding"] = specs
    print("RESULT" + json.dumps(res))
""")


@pytest.mark.slow
def test_quantized_policy_keeps_collectives_and_out_sharding():
    """(make test-slow: ~28 CPU-s.) The default run keeps both properties at the GEMM
    level (tests/mxjax/test_explicit_sharding.py: lax.dot_general's collectives and no
    all-gather under mxfp4_all_h16, out_sharding as lax.dot_general's) and the sharded
    model's numerics (tests/train/test_train_multidevice.py)."""
    res = run_on_8_fake_devices(_SCRIPT)
    print(res)
    assert res["bf16"], "the sharded step has no collectives: the mesh is not in use"
    assert res["mxfp4_all_h16"] == res["bf16"]
    for want, (ref, got) in res["out_sharding"].items():
        assert got == ref, (want, ref, got)
