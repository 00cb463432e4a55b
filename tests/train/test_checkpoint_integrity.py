"""train.checkpoint: byte digests catch any changed value; bad checkpoints never evict
the last good one."""

from __future__ import annotations

import hashlib
import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from train.checkpoint import (
    Checkpointer,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    digests,
)


def _state(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.normal(size=(64, 64)).astype(np.float32)),
                       "b": jnp.asarray(rng.normal(size=(64,)).astype(ml_dtypes.bfloat16))},
            "step": jnp.asarray(3, jnp.int32)}


def _tampered_copy(tmp_path, change):
    """Checkpoint 1 holds the state; its array files are then replaced by those of
    `change(state)` (saved as checkpoint 2), its record left as it was."""
    state = _state()
    other = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
    change(other)
    with Checkpointer(tmp_path / "ck", keep=5, async_save=False) as ck:
        ck.save(1, state, {"note": "original"})
        ck.save(2, other, {"note": "changed"})
    shutil.rmtree(tmp_path / "ck" / "1" / "state")
    shutil.copytree(tmp_path / "ck" / "2" / "state", tmp_path / "ck" / "1" / "state")
    shutil.rmtree(tmp_path / "ck" / "2")
    return state


def _restore(tmp_path, step, like):
    with Checkpointer(tmp_path / "ck", keep=5) as ck:
        return ck.restore(step, like, ck.read_meta(step))


def test_roundtrip_and_digest_reference(tmp_path):
    state = _state()
    with Checkpointer(tmp_path / "ck", keep=2, async_save=False) as ck:
        ck.save(1, state, {})
        meta = ck.read_meta(1)
        back = ck.restore(1, state, meta)
    back_w = np.asarray(back["params"]["w"]).ravel()[:5]
    for a, b in zip(back_w, np.asarray(state["params"]["w"]).ravel()[:5]):
        assert a == b
    # independent reference: hashlib over the numpy bytes
    w = np.asarray(state["params"]["w"])
    h = hashlib.sha256(w.tobytes())
    assert meta["digests"]["params.w"] != h.hexdigest()  # the dtype/shape header is included
    h = hashlib.sha256()
    h.update(f"{w.dtype.str}{w.dtype.name}{list(w.shape)}".encode())
    h.update(w.tobytes())
    assert meta["digests"]["params.w"] == h.hexdigest()
    assert set(meta["digests"]) == {"params.w", "params.b", "step"}
    assert digests({"x": np.zeros(3, np.float32)}) != digests({"x": np.zeros(3, np.int32)})
    assert digests({"x": np.zeros((2, 3))}) != digests({"x": np.zeros((3, 2))})


def _swap(s):
    w = np.array(s["params"]["w"])
    w[0, 0], w[5, 7] = w[5, 7], w[0, 0]
    s["params"]["w"] = jnp.asarray(w)


def _nudge(s):
    w = np.array(s["params"]["w"])
    w[10, 3] += np.float32(0.01)
    s["params"]["w"] = jnp.asarray(w)


def _bf16_ulp(s):
    b = np.array(s["params"]["b"])
    b.view(np.uint16)[7] ^= 1  # one bit of one bf16 value
    s["params"]["b"] = jnp.asarray(b)


def _step(s):
    s["step"] = jnp.asarray(4, jnp.int32)


@pytest.mark.parametrize("change, name", [(_swap, "params.w"), (_nudge, "params.w"),
                                          (_bf16_ulp, "params.b"), (_step, "step")])
def test_any_changed_value_is_an_error_naming_array_and_step(tmp_path, change, name):
    state = _tampered_copy(tmp_path, change)
    with pytest.raises(CorruptCheckpointError,
                       match=rf"ck/1 \(step 1\): array {name} does not match its recorded digest"):
        _restore(tmp_path, 1, state)


def test_altered_record_digest_is_an_error(tmp_path):
    state = _state()
    with Checkpointer(tmp_path / "ck", keep=2, async_save=False) as ck:
        ck.save(1, state, {})
    f = tmp_path / "ck" / "1" / "meta" / "metadata"
    rec = json.loads(f.read_text())
    rec["digests"]["params.b"] = "0" * 64
    f.write_text(json.dumps(rec))
    with pytest.raises(CorruptCheckpointError, match=r"array params.b does not match"):
        _restore(tmp_path, 1, state)


def test_format_1_record_is_refused_clearly(tmp_path):
    state = _state()
    with Checkpointer(tmp_path / "ck", keep=2, async_save=False) as ck:
        ck.save(1, state, {})
    f = tmp_path / "ck" / "1" / "meta" / "metadata"
    rec = json.loads(f.read_text())
    rec["format_version"] = 1
    f.write_text(json.dumps(rec))
    with pytest.raises(IncompatibleCheckpointError, match=r"record format 1"):
        _restore(tmp_path, 1, state)


def test_bad_checkpoints_never_evict_the_last_good_one(tmp_path):
    state = _state()
    with Checkpointer(tmp_path / "ck", keep=2, async_save=False) as ck:
        for step, good in ((1, True), (2, True), (3, False), (4, False), (5, False)):
            ck.save(step, state, {}, good=good)
        assert ck.steps() == [2, 4, 5] and ck.last_good_step() == 2
        assert ck.read_meta(2)["good"] and not ck.read_meta(5)["good"]
    with Checkpointer(tmp_path / "ck", keep=2, async_save=False) as ck:  # a resumed run
        ck.save(6, state, {}, good=False)
        assert ck.steps() == [2, 5, 6]
        ck.save(7, state, {}, good=True)
        assert ck.steps() == [6, 7] and ck.last_good_step() == 7
