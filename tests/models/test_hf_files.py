"""HF checkpoint files: an export replaces the checkpoint already in
its directory (never leaving stale shards that load_hf would read), a failed write leaves the
old checkpoint intact, and the Hugging Face hub cache layout loads while real escapes are
still refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from models import hf
from tests.file_faults import file_size_limit

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "hf_tiny_llama")


@pytest.fixture(scope="module")
def loaded():
    return hf.load_hf(FIXTURE)


@pytest.fixture(scope="module")
def doubled(loaded):
    """The fixture model with every parameter doubled: weights that differ from the files'."""
    model, _ = loaded
    other, _ = hf.load_hf(FIXTURE)
    nnx.update(other, jax.tree.map(lambda x: x * 2, nnx.state(model, nnx.Param)))
    return other


def _params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _same_params(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_params(a), _params(b), strict=True))


def _copy_fixture(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    return d


# --------------------------------------------------------------------------- item 5


def test_single_file_export_over_sharded_checkpoint_replaces_it(tmp_path, loaded, doubled):
    d = _copy_fixture(tmp_path)
    hf.export_hf(doubled, str(d))
    assert not (d / hf.INDEX_FILE).exists()
    assert not list(d.glob("model-*-of-*.safetensors"))
    reloaded, layout = hf.load_hf(str(d))
    assert not layout.sharded
    assert _same_params(reloaded, doubled)
    assert not _same_params(reloaded, loaded[0])
    assert (d / "generation_config.json").exists()  # files that are not weights stay
    assert not list(d.glob(".*partial"))


def test_sharded_export_over_single_file_and_fewer_shards(tmp_path, loaded, doubled):
    model, layout = loaded
    d = tmp_path / "out"
    hf.export_hf(doubled, str(d))  # single file
    hf.export_hf(model, str(d), layout=layout)  # three shards over it
    assert not (d / hf.SINGLE_FILE).exists()
    assert _same_params(hf.load_hf(str(d))[0], model)
    # Two shards over three: the third (which the old index listed) goes.
    shard_bytes = max(os.path.getsize(p) for p in d.glob("model-*.safetensors"))
    written = hf.export_hf(doubled, str(d), max_shard_bytes=2 * shard_bytes)
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert shards == [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    assert sorted(os.path.basename(p) for p in written) == sorted(
        [*shards, hf.INDEX_FILE, hf.CONFIG_FILE])
    assert _same_params(hf.load_hf(str(d))[0], doubled)


def test_load_refuses_a_directory_with_both_layouts(tmp_path, loaded):
    d = _copy_fixture(tmp_path)
    src = tmp_path / "single"
    hf.export_hf(loaded[0], str(src))
    shutil.copy(src / hf.SINGLE_FILE, d / hf.SINGLE_FILE)  # what an old export_hf left
    with pytest.raises(ValueError, match=r"both model\.safetensors and model\.safetensors\.index"
                                         r"\.json.*stale"):
        hf.load_hf(str(d))


def test_export_refuses_to_replace_an_unreadable_index(tmp_path, doubled):
    d = _copy_fixture(tmp_path)
    (d / hf.INDEX_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=r"replace the checkpoint.*index\.json cannot be read"):
        hf.export_hf(doubled, str(d))
    assert (d / "model-00001-of-00003.safetensors").exists()


def test_export_never_deletes_outside_out_dir_from_a_hostile_index(tmp_path, doubled):
    d = _copy_fixture(tmp_path)
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    idx = json.loads((d / hf.INDEX_FILE).read_text())
    idx["weight_map"]["model.norm.weight"] = "../victim.safetensors"
    (d / hf.INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(ValueError, match="names shard file"):
        hf.export_hf(doubled, str(d))
    assert victim.read_bytes() == b"precious"


def test_failed_write_keeps_the_old_checkpoint(tmp_path, loaded, doubled):
    model, layout = loaded
    d = _copy_fixture(tmp_path)
    before = sorted(os.listdir(d))
    with file_size_limit(4096), pytest.raises(
            OSError, match=r"could not write .*ckpt/model-00001-of-00003\.safetensors.*too large"):
        hf.export_hf(doubled, str(d), layout=layout)
    assert sorted(os.listdir(d)) == before  # no temporaries, nothing removed
    assert _same_params(hf.load_hf(str(d))[0], model)


def test_export_expands_user(tmp_path, monkeypatch, doubled):
    monkeypatch.setenv("HOME", str(tmp_path))
    hf.export_hf(doubled, "~/exported")
    assert (tmp_path / "exported" / hf.SINGLE_FILE).exists()
    assert not os.path.exists("~")
    assert _same_params(hf.load_hf("~/exported")[0], doubled)


# --------------------------------------------------------------------------- item 6


def _hub_repo(tmp_path, rev="0123abcd", name="models--org--tiny"):
    """The hub cache layout: blobs/<sha256> and snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    repo = tmp_path / "hub" / name
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for fn in sorted(os.listdir(FIXTURE)):
        with open(os.path.join(FIXTURE, fn), "rb") as f:
            data = f.read()
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        os.symlink(f"../../blobs/{sha}", snap / fn)
    return repo, snap


def test_hub_cache_snapshot_and_repo_dir_load(tmp_path, monkeypatch, loaded):
    repo, snap = _hub_repo(tmp_path)
    model, _ = hf.load_hf(str(snap))
    assert _same_params(model, loaded[0])
    assert _same_params(hf.load_hf(str(repo))[0], loaded[0])  # refs/main's snapshot
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf.config_from_hf("~/hub/models--org--tiny/snapshots/0123abcd") == model.config


def test_hub_repo_with_several_snapshots_and_no_ref(tmp_path):
    repo, snap = _hub_repo(tmp_path)
    os.remove(repo / "refs" / "main")
    shutil.copytree(snap, repo / "snapshots" / "ffff", symlinks=True)
    with pytest.raises(FileNotFoundError, match=r"2 snapshots \(0123abcd, ffff\).*refs/main"):
        hf.load_hf(str(repo))


@pytest.mark.parametrize("target", ["outside", "other_repo", "blob_of_non_snapshot"])
def test_hub_like_links_that_escape_are_refused(tmp_path, target):
    repo, snap = _hub_repo(tmp_path)
    shard = "model-00002-of-00003.safetensors"
    real = os.path.realpath(snap / shard)
    if target == "outside":  # a link out of the repository
        dest = tmp_path / "elsewhere.safetensors"
        shutil.copy(real, dest)
        os.remove(snap / shard)
        os.symlink(os.path.relpath(dest, snap), snap / shard)
    elif target == "other_repo":  # a link into another repository's blobs
        other, _ = _hub_repo(tmp_path, name="models--org--other")
        os.remove(snap / shard)
        os.symlink(f"../../../models--org--other/blobs/{os.path.basename(real)}", snap / shard)
        assert os.path.exists(snap / shard) and other.exists()
    else:  # a plain directory beside a blobs/ folder is no hub snapshot
        d = repo / "notsnapshots" / "x"
        shutil.copytree(snap, d, symlinks=True)
        snap = d
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        hf.load_hf(str(snap))


def test_export_into_hub_snapshot_refused_and_blobs_untouched(tmp_path, loaded, doubled):
    _, layout = loaded
    repo, snap = _hub_repo(tmp_path)
    blobs = {p.name: p.read_bytes() for p in (repo / "blobs").iterdir()}
    with pytest.raises(ValueError, match="hub cache"):
        hf.export_hf(doubled, str(snap), layout=layout)
    assert {p.name: p.read_bytes() for p in (repo / "blobs").iterdir()} == blobs
