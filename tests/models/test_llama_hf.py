"""HF checkpoint import/export and logits parity against transformers' LlamaForCausalLM.

The fixture in tests/models/data/hf_tiny_llama was made by scripts/make_hf_fixture.py
(torch + transformers in a separate venv): a random 2-layer GQA Llama with llama3
RoPE scaling, saved as sharded safetensors, with its fp32 logits and layer-0 output.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from llama_test_utils import max_abs
from safetensors import safe_open
from safetensors.numpy import save_file

from models import hf
from models.llama import Llama, LlamaConfig, RopeScaling

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "hf_tiny_llama")


@pytest.fixture(scope="module")
def ref():
    with np.load(os.path.join(FIXTURE, "reference.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def loaded():
    return hf.load_hf(FIXTURE)


def _read_all(path):
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(path, fn), framework="numpy") as f:
                for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    out[k] = (fn, f.get_tensor(k))
    return out


def test_config_from_hf_fixture(loaded):
    model, layout = loaded
    c = model.config
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
            c.ffn_dim) == (128, 64, 2, 4, 2, 16, 160)
    assert c.rope_theta == 10000.0 and c.norm_eps == 1e-5 and not c.tie_embeddings
    assert c.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=64)
    assert layout.sharded and len(set(layout.weight_map.values())) == 3


def test_logits_parity_fp32(loaded, ref):
    model, _ = loaded
    logits = model(jnp.asarray(ref["input_ids"]))
    diff = max_abs(logits, ref["logits"])
    print(f"max |logits - HF logits| = {diff:.3g}")
    assert diff <= 1e-4
    # also under jit, unrolled
    unrolled, _ = hf.load_hf(FIXTURE, scan_layers=False)
    jl = nnx.jit(lambda m, t: m(t))(unrolled, jnp.asarray(ref["input_ids"]))
    assert max_abs(jl, ref["logits"]) <= 1e-4


def test_embedding_and_layer0_output_parity(loaded, ref):
    model, _ = loaded
    ids = jnp.asarray(ref["input_ids"])
    assert max_abs(model.embed(ids), ref["hidden_0"]) == 0.0
    cos, sin = model.rope(ids.shape[1])
    out = model.layer(0)(jnp.asarray(ref["hidden_0"]), 0, cos, sin)
    diff = max_abs(out, ref["layer_0_out"])
    print(f"max |layer0 out - HF| = {diff:.3g}")
    assert diff <= 1e-5


def test_round_trip_same_layout_identical_tensors(loaded, tmp_path):
    model, layout = loaded
    hf.export_hf(model, str(tmp_path), layout=layout)
    src, dst = _read_all(FIXTURE), _read_all(str(tmp_path))
    assert sorted(src) == sorted(dst)
    for k, (fn, a) in src.items():
        fn2, b = dst[k]
        assert fn == fn2, k
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert a.tobytes() == b.tobytes(), k
    with open(os.path.join(FIXTURE, hf.INDEX_FILE)) as f1, \
            open(os.path.join(tmp_path, hf.INDEX_FILE)) as f2:
        assert json.load(f1) == json.load(f2)
    assert hf.read_hf_config(str(tmp_path)) == hf.read_hf_config(FIXTURE)


def test_export_single_file_bf16_and_reload(loaded, ref, tmp_path):
    model, _ = loaded
    files = hf.export_hf(model, str(tmp_path / "f32"))
    assert sorted(os.path.basename(f) for f in files) == ["config.json", "model.safetensors"]
    again, layout = hf.load_hf(str(tmp_path / "f32"))
    assert not layout.sharded
    assert max_abs(again(jnp.asarray(ref["input_ids"])), ref["logits"]) <= 1e-4
    # bf16 on disk, sharded by size
    files = hf.export_hf(model, str(tmp_path / "b16"), dtype="bfloat16", max_shard_bytes=60_000)
    assert hf.INDEX_FILE in {os.path.basename(f) for f in files}
    t = _read_all(str(tmp_path / "b16"))
    assert {a.dtype.name for _, a in t.values()} == {"bfloat16"}
    m16, lay16 = hf.load_hf(str(tmp_path / "b16"))
    assert set(lay16.dtypes.values()) == {"bfloat16"}
    assert 0 < max_abs(m16(jnp.asarray(ref["input_ids"])), ref["logits"]) < 0.05
    hf.export_hf(m16, str(tmp_path / "b16b"), layout=lay16)  # bf16 -> f32 -> bf16 is exact
    t2 = _read_all(str(tmp_path / "b16b"))
    assert all(t[k][1].tobytes() == t2[k][1].tobytes() for k in t)


def test_tied_embeddings_round_trip(tmp_path):
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48,
                      tie_embeddings=True, rope_scaling=None)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    assert not hasattr(model, "lm_head")
    hf.export_hf(model, str(tmp_path))
    names = set(_read_all(str(tmp_path)))
    assert "lm_head.weight" not in names and names == set(hf.hf_tensor_names(cfg))
    again, _ = hf.load_hf(str(tmp_path))
    assert again.config == cfg
    toks = jnp.arange(10, dtype=jnp.int32)[None]
    fwd = nnx.jit(lambda m, t: m(t))
    assert max_abs(fwd(model, toks), fwd(again, toks)) == 0.0


def _copy_fixture(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    return d


def _rewrite_tensor(d, name, fn_new):
    with open(d / hf.INDEX_FILE) as f:
        fn = json.load(f)["weight_map"][name]
    with safe_open(str(d / fn), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    fn_new(tensors)
    save_file(tensors, str(d / fn), metadata=meta)
    return fn


def test_missing_tensor_error_names_it(tmp_path):
    d = _copy_fixture(tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_tensor(d, name, lambda t: t.pop(name))
    with open(d / hf.INDEX_FILE) as f:
        idx = json.load(f)
    del idx["weight_map"][name]
    with open(d / hf.INDEX_FILE, "w") as f:
        json.dump(idx, f)
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        hf.load_hf(str(d))


def test_shape_mismatch_error_names_tensor_and_shapes(tmp_path):
    d = _copy_fixture(tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(t):
        t[name] = t[name][:16]
    _rewrite_tensor(d, name, shrink)
    with pytest.raises(ValueError, match=r"k_proj.weight.*\(16, 64\).*\(32, 64\)"):
        hf.load_hf(str(d))


def test_unexpected_tensor_and_index_errors(tmp_path):
    d = _copy_fixture(tmp_path)
    _rewrite_tensor(d, "model.norm.weight",
                    lambda t: t.__setitem__("model.layers.2.mlp.up_proj.weight",
                                            np.zeros((160, 64), np.float32)))
    with pytest.raises(ValueError, match="does not use.*layers.2"):
        hf.load_hf(str(d))
    os.remove(d / "model-00002-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003"):
        hf.load_hf(str(d))


def test_non_llama_and_unsupported_configs_raise():
    base = hf.read_hf_config(FIXTURE)
    with pytest.raises(ValueError, match="model_type is 'mistral'"):
        hf.config_from_hf({**base, "model_type": "mistral"})
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        hf.config_from_hf({**base, "architectures": ["LlamaForSequenceClassification"]})
    with pytest.raises(ValueError, match="attention_bias"):
        hf.config_from_hf({**base, "attention_bias": True})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        hf.config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                       "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="hidden_size"):
        hf.config_from_hf({k: v for k, v in base.items() if k != "hidden_size"})


def test_config_v4_style_and_to_hf_round_trip():
    base = hf.read_hf_config(FIXTURE)
    v4 = {k: v for k, v in base.items() if k != "rope_parameters"}
    v4["rope_theta"] = 10000.0
    v4["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert hf.config_from_hf(v4) == hf.config_from_hf(base)
    for cfg in (LlamaConfig.llama3_8b(), LlamaConfig.llama3_1b(), LlamaConfig.tiny()):
        # max_seq_len comes back as the max_position_embeddings the HF config states (above
        # the llama3 scaling's original context; see test_llama3_scaling_below_...)
        want = cfg.replace(max_seq_len=hf.hf_max_position_embeddings(cfg))
        assert hf.config_from_hf(hf.config_to_hf(cfg)) == want
    fixture_cfg = hf.config_from_hf(base)  # max_seq_len 256 > original 64: kept as it is
    assert hf.config_from_hf(hf.config_to_hf(fixture_cfg)) == fixture_cfg
    assert hf.config_from_hf(base, dtype="bfloat16").dtype == jnp.bfloat16


def test_load_into_mesh_places_shards(loaded):
    """load_hf with a (1-device) mesh puts arrays on it with the rule's specs."""
    from models import sharding as shd
    mesh = shd.make_mesh()
    model, _ = hf.load_hf(FIXTURE, mesh=mesh)
    q = model.layers.q_proj.kernel.get_value()
    assert isinstance(q.sharding, jax.sharding.NamedSharding)
    assert tuple(q.sharding.spec) == (None, "fsdp", "tensor")


def test_layout_repr_is_one_short_line(loaded):
    """The repr is short: not the whole weight map and metadata (kilobytes)."""
    _, layout = loaded
    r = repr(layout)
    assert "\n" not in r and len(r) < 160, r
    assert r == ("HFLayout(21 tensors in 3 shards, 21 float32; model_type='llama', "
                 "generation_config=yes)")
    assert len(layout.weight_map) == 21  # the details stay in the fields


def test_generation_config_kept_on_re_export(loaded, tmp_path):
    """import -> export keeps generation_config.json beside config.json."""
    model, layout = loaded
    with open(os.path.join(FIXTURE, hf.GENERATION_CONFIG_FILE)) as f:
        want = json.load(f)
    assert layout.generation_config == want
    hf.export_hf(model, str(tmp_path), layout=layout)
    with open(tmp_path / hf.GENERATION_CONFIG_FILE) as f:
        assert json.load(f) == want
    _, again = hf.load_hf(str(tmp_path))
    assert again.generation_config == want
    # one given replaces it; config.json fields beside the architecture's go in too
    hf.export_hf(model, str(tmp_path), generation_config={"eos_token_id": 2},
                 hf_config_extra={"eos_token_id": 2})
    assert json.loads((tmp_path / hf.GENERATION_CONFIG_FILE).read_text()) == {"eos_token_id": 2}
    assert hf.read_hf_config(str(tmp_path))["eos_token_id"] == 2
    with pytest.raises(ValueError, match="hidden_size"):
        hf.export_hf(model, str(tmp_path), hf_config_extra={"hidden_size": 8})


@pytest.mark.parametrize("preset, kw", [("tiny", {"max_seq_len": 256}), ("tiny", {}),
                                        ("llama3_8b", {}), ("llama3_1b", {})])
def test_llama3_scaling_below_original_context_exports_coherently(preset, kw):
    """The tiny preset (llama3 scaling, original 8192) with max_seq_len 256
    exported max_position_embeddings 256 < 8192, which transformers warns about (it does for
    original >= max_position_embeddings: the 8B preset's 8192 = 8192 too). The exported config
    now states the context the scaling extends to; the RoPE frequencies, which transformers
    computes from the scaling fields alone, are unchanged."""
    cfg = getattr(LlamaConfig, preset)(**kw)
    d = hf.config_to_hf(cfg)
    orig = d["rope_scaling"]["original_max_position_embeddings"]
    assert orig == 8192 and d["max_position_embeddings"] > orig
    assert d["max_position_embeddings"] == int(d["rope_scaling"]["factor"] * orig)
    assert d["max_position_embeddings"] >= cfg.max_seq_len
    back = hf.config_from_hf(d)
    assert back.replace(max_seq_len=cfg.max_seq_len) == cfg


def test_llama3_export_logits_unchanged_and_transformers_quiet(tmp_path):
    """The tiny preset at max_seq_len 64 exported and imported back: bitwise-equal logits.
    Where transformers is importable, its config of the export raises no RoPE warning."""
    cfg = LlamaConfig.tiny(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                           ffn_dim=48, max_seq_len=64)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    hf.export_hf(model, str(tmp_path))
    again, _ = hf.load_hf(str(tmp_path))
    assert again.config.rope_scaling == cfg.rope_scaling and again.config.max_seq_len == 65536
    toks = jnp.arange(48, dtype=jnp.int32)[None] % 64
    fwd = nnx.jit(lambda m, t: m(t))
    assert np.asarray(fwd(model, toks)).tobytes() == np.asarray(fwd(again, toks)).tobytes()
    transformers = pytest.importorskip("transformers")
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    logger = transformers.logging.get_logger()
    logger.addHandler(handler)
    try:
        transformers.LlamaConfig.from_pretrained(str(tmp_path))
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "original_max_position_embeddings" in m], seen
