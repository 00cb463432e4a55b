"""HF import/export on untrusted files: shard names stay inside the directory, weights are
floating point, and every file error names the file."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from models import hf

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "hf_tiny_llama")
SHARD2 = "model-00002-of-00003.safetensors"


@pytest.fixture(scope="module")
def loaded():
    return hf.load_hf(FIXTURE)


def _copy_fixture(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    return d


def _edit_index(d, fn_edit):
    with open(d / hf.INDEX_FILE) as f:
        idx = json.load(f)
    fn_edit(idx)
    with open(d / hf.INDEX_FILE, "w") as f:
        json.dump(idx, f)


def _repoint_shard(d, old: str, new: str):
    _edit_index(d, lambda idx: idx["weight_map"].update(
        {k: new for k, v in idx["weight_map"].items() if v == old}))


@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_index_shard_outside_directory_is_refused(tmp_path, kind):
    d = _copy_fixture(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(str(d / SHARD2), str(outside / SHARD2))
    bad = str(outside / SHARD2) if kind == "absolute" else f"../elsewhere/{SHARD2}"
    _repoint_shard(d, SHARD2, bad)
    with pytest.raises(ValueError, match=r"index\.json names shard file .*elsewhere.*plain"):
        hf.load_hf(str(d))


@pytest.mark.parametrize("bad", ["sub/x.safetensors", "..", "", "config.json", 7])
def test_index_shard_names_must_be_plain_safetensors_names(tmp_path, bad):
    d = _copy_fixture(tmp_path)
    _repoint_shard(d, SHARD2, bad)
    with pytest.raises(ValueError, match="names shard file"):
        hf.load_hf(str(d))


def test_shard_symlink_leaving_directory_is_refused(tmp_path):
    d = _copy_fixture(tmp_path)
    outside = tmp_path / "victim.safetensors"
    shutil.move(str(d / SHARD2), str(outside))
    os.symlink(outside, d / SHARD2)
    with pytest.raises(ValueError, match=r"resolves to .*victim\.safetensors.*outside"):
        hf.load_hf(str(d))


def test_single_file_symlink_leaving_directory_is_refused(tmp_path, loaded):
    model, _ = loaded
    src = tmp_path / "src"
    hf.export_hf(model, str(src))
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(src / hf.CONFIG_FILE, d / hf.CONFIG_FILE)
    os.symlink(src / hf.SINGLE_FILE, d / hf.SINGLE_FILE)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        hf.load_hf(str(d))


def test_export_layout_cannot_write_outside_out_dir(tmp_path, loaded):
    model, layout = loaded
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    for bad in ("../victim.safetensors", str(victim)):
        wm = {k: (bad if v == SHARD2 else v) for k, v in layout.weight_map.items()}
        evil = hf.HFLayout(weight_map=wm, dtypes=layout.dtypes,
                           index_metadata=layout.index_metadata,
                           file_metadata=layout.file_metadata, hf_config=layout.hf_config)
        out = tmp_path / "out"
        with pytest.raises(ValueError, match="layout's weight_map names shard file"):
            hf.export_hf(model, str(out), layout=evil)
        assert victim.read_bytes() == b"precious"
        assert not out.exists()  # refused before anything was written


def test_export_refuses_symlink_in_out_dir(tmp_path, loaded):
    model, layout = loaded
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / SHARD2)
    with pytest.raises(ValueError, match="outside"):
        hf.export_hf(model, str(out), layout=layout)
    assert victim.read_bytes() == b"precious"
    os.remove(out / SHARD2)
    os.symlink(victim, out / hf.CONFIG_FILE)
    with pytest.raises(ValueError, match="config.json.*outside"):
        hf.export_hf(model, str(out), layout=layout)
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.uint8])
def test_non_float_tensor_is_refused_naming_it(tmp_path, dtype):
    d = _copy_fixture(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    with open(d / hf.INDEX_FILE) as f:
        fn = json.load(f)["weight_map"][name]
    with safe_open(str(d / fn), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    tensors[name] = np.ones(tensors[name].shape, dtype)
    save_file(tensors, str(d / fn), metadata=meta)
    with pytest.raises(ValueError, match=rf"{name}.*{fn}.*dtype {np.dtype(dtype).name}"):
        hf.load_hf(str(d))


def test_export_refuses_non_float_dtypes(tmp_path, loaded):
    model, layout = loaded
    with pytest.raises(ValueError, match="dtype='int8'"):
        hf.export_hf(model, str(tmp_path / "a"), dtype="int8")
    dtypes = {**layout.dtypes, "model.norm.weight": "int32"}
    bad = hf.HFLayout(weight_map=layout.weight_map, dtypes=dtypes,
                      index_metadata=layout.index_metadata,
                      file_metadata=layout.file_metadata, hf_config=layout.hf_config)
    with pytest.raises(ValueError, match="'model.norm.weight'.*int32"):
        hf.export_hf(model, str(tmp_path / "b"), layout=bad)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "", "\xff\xfe"])
def test_bad_config_json_names_the_file(tmp_path, text):
    d = _copy_fixture(tmp_path)
    (d / hf.CONFIG_FILE).write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=r"ckpt/config\.json"):
        hf.load_hf(str(d))


@pytest.mark.parametrize("text", ["{not json", '["a"]', '{"weight_map": [1]}',
                                  '{"weight_map": {}, "metadata": 3}'])
def test_bad_index_names_the_file(tmp_path, text):
    d = _copy_fixture(tmp_path)
    (d / hf.INDEX_FILE).write_text(text)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json"):
        hf.load_hf(str(d))


@pytest.mark.parametrize("cut", ["empty", "truncated", "garbage"])
def test_broken_safetensors_names_the_file(tmp_path, cut):
    d = _copy_fixture(tmp_path)
    p = d / SHARD2
    data = p.read_bytes()
    p.write_bytes({"empty": b"", "truncated": data[: len(data) // 2],
                   "garbage": b"\x00" * 64}[cut])
    with pytest.raises(ValueError, match=rf"ckpt/{SHARD2}"):
        hf.load_hf(str(d))


def test_missing_shard_names_the_file(tmp_path):
    d = _copy_fixture(tmp_path)
    os.remove(d / SHARD2)
    with pytest.raises(FileNotFoundError, match=SHARD2):
        hf.load_hf(str(d))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weight_is_refused_naming_it(tmp_path, value):
    """Issue 45 (UNCLEAR): a NaN/Inf weight would make every step non-finite (each skipped,
    the run 'completed'); loading names the tensor instead."""
    d = _copy_fixture(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    with open(d / hf.INDEX_FILE) as f:
        fn = json.load(f)["weight_map"][name]
    with safe_open(str(d / fn), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    tensors[name] = tensors[name].copy()
    tensors[name].flat[3] = value
    save_file(tensors, str(d / fn), metadata=meta)
    with pytest.raises(ValueError, match=rf"tensor '{name}' in .*{fn} holds 1 non-finite"):
        hf.load_hf(str(d))


def test_symlink_loop_and_dangling_link_say_so(tmp_path):
    """Issue 45 (UNCLEAR): a checkpoint path that is a symlink loop says so, not "does not
    exist"; a dangling link names its target."""
    from models.hf_files import resolve_checkpoint_dir

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match="is a symlink loop"):
        resolve_checkpoint_dir(str(tmp_path / "a"))
    with pytest.raises(ValueError, match="is a symlink loop"):
        hf.load_hf(str(tmp_path / "a" / "sub"))
    (tmp_path / "c").symlink_to(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match=f"is a symlink to {tmp_path / 'gone'}, which"):
        resolve_checkpoint_dir(str(tmp_path / "c"))


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_export_files_honour_the_umask(tmp_path, loaded, mask):
    # safetensors creates its files 0600; an export's files get 0666 less the umask, as
    # every other output does.
    model, layout = loaded
    old = os.umask(mask)
    try:
        written = hf.export_hf(model, str(tmp_path / "out"), layout=layout)
    finally:
        os.umask(old)
    assert any(p.endswith(".safetensors") for p in written)
    for p in written:
        assert oct(os.stat(p).st_mode & 0o777) == oct(0o666 & ~mask), p
