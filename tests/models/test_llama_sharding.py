"""Logical-axis sharding rules, and a sharded forward on 8 fake CPU devices.

The 8-device check runs in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, because this pytest process
has already initialised JAX with one CPU device.
"""

from __future__ import annotations

import textwrap
from typing import ClassVar

import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from llama_test_utils import run_on_8_fake_devices

from models import sharding as shd
from models.llama import Llama, LlamaConfig


class _FakeMesh:
    """Just enough of a Mesh for logical_to_pspec (axis names and sizes)."""

    axis_names = shd.MESH_AXES
    shape: ClassVar[dict[str, int]] = {"data": 2, "fsdp": 2, "tensor": 2}


def test_logical_to_pspec_rules():
    m = _FakeMesh()
    assert shd.logical_to_pspec(("layers", "embed", "mlp"), mesh=m) == P(None, "fsdp", "tensor")
    assert shd.logical_to_pspec(("vocab", "embed"), mesh=m) == P("tensor", "fsdp")
    assert shd.logical_to_pspec(("batch", "seq", "act_embed"), mesh=m) == \
        P(("data", "fsdp"), None, None)
    # a mesh axis is used once per array: batch took fsdp, so embed gets nothing
    assert shd.logical_to_pspec(("batch", "embed"), mesh=m) == P(("data", "fsdp"), None)
    # mesh axes missing from the mesh are skipped
    class NoTensor(_FakeMesh):
        axis_names = ("data", "fsdp")
    assert shd.logical_to_pspec(("embed", "mlp"), mesh=NoTensor()) == P("fsdp", None)
    with pytest.raises(ValueError, match="no sharding rule for logical axis 'bogus'"):
        shd.logical_to_pspec(("bogus",))
    with pytest.raises(ValueError, match="not divisible"):
        shd.logical_to_pspec(("embed", "mlp"), mesh=m, shape=(64, 33))


def test_every_param_has_a_rule_and_8b_specs():
    cfg = LlamaConfig.llama3_8b()
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    mesh = _FakeMesh()
    specs = {".".join(p): s for p, s in shd.param_partition_specs(abstract, mesh).items()}
    assert specs == {
        "embed_tokens.embedding": P("tensor", "fsdp"),
        "layers.q_proj.kernel": P(None, "fsdp", "tensor"),
        "layers.k_proj.kernel": P(None, "fsdp", "tensor"),
        "layers.v_proj.kernel": P(None, "fsdp", "tensor"),
        "layers.o_proj.kernel": P(None, "tensor", "fsdp"),
        "layers.gate_proj.kernel": P(None, "fsdp", "tensor"),
        "layers.up_proj.kernel": P(None, "fsdp", "tensor"),
        "layers.down_proj.kernel": P(None, "tensor", "fsdp"),
        "layers.input_layernorm.scale": P(None, None),
        "layers.post_attention_layernorm.scale": P(None, None),
        "norm.scale": P(None),
        "lm_head.kernel": P("fsdp", "tensor"),
    }


_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from models import sharding as shd
    from models.llama import Llama, LlamaConfig

    assert jax.device_count() == 8, jax.devices()
    cfg = LlamaConfig.tiny(vocab_size=256, n_layers=2)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size)
    fwd = lambda m, t: m(t)
    ref = np.asarray(nnx.jit(fwd)(model, tokens))

    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    shd.shard_model(model, mesh)
    tokens_s = jax.device_put(tokens, jax.sharding.NamedSharding(
        mesh, shd.logical_to_pspec(("batch", "seq"), mesh=mesh)))
    with shd.use_mesh(mesh):
        out = nnx.jit(fwd)(model, tokens_s)
    res = {"max_diff": float(np.max(np.abs(np.asarray(out) - ref))),
           "logits_spec": [list(a) if isinstance(a, tuple) else a for a in out.sharding.spec],
           "params": {}}
    want = shd.param_partition_specs(model, mesh)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v = var.get_value()
        name = ".".join(map(str, path))
        res["params"][name] = {
            "spec": [a for a in v.sharding.spec],
            "want": [a for a in want[path]],
            "shape": list(v.shape),
            "shard_shape": list(v.addressable_shards[0].data.shape),
            "n_devices": len(v.sharding.device_set),
        }
    direct = shd.sharded_init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), mesh)
    same = []
    for (p1, v1), (p2, v2) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                  nnx.to_flat_state(nnx.state(direct, nnx.Param))):
        a, b = v1.get_value(), v2.get_value()
        same.append(p1 == p2 and a.sharding.is_equivalent_to(b.sharding, a.ndim)
                    and bool(np.array_equal(np.asarray(a), np.asarray(b))))
    res["sharded_init_same"] = same
    print("RESULT" + json.dumps(res))
""")


def _pad(spec, n):
    spec = list(spec) + [None] * (n - len(spec))
    return [tuple(a) if isinstance(a, list) else a for a in spec]


@pytest.mark.slow
def test_sharded_forward_on_8_fake_devices_matches_single_device():
    res = run_on_8_fake_devices(_SCRIPT)
    print(f"max |sharded - single-device logits| = {res['max_diff']:.3g}")
    assert res["max_diff"] <= 1e-5, res["max_diff"]
    assert len(res["sharded_init_same"]) == 12 and all(res["sharded_init_same"])
    assert _pad(res["logits_spec"], 3) == [("data", "fsdp"), None, "tensor"]
    params = res["params"]
    assert len(params) == 12
    for name, p in params.items():
        n = len(p["shape"])
        assert _pad(p["spec"], n) == _pad(p["want"], n), name
        assert p["n_devices"] == 8, name
    q = params["layers.q_proj.kernel"]
    assert q["shape"] == [2, 256, 256] and q["shard_shape"] == [2, 128, 128]
    emb = params["embed_tokens.embedding"]
    assert emb["shard_shape"] == [128, 128]  # vocab over tensor, embed over fsdp
    down = params["layers.down_proj.kernel"]
    assert down["shard_shape"] == [2, 448, 128]
    norm = params["norm.scale"]
    assert norm["shard_shape"] == norm["shape"]  # replicated
