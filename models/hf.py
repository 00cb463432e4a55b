"""Hugging Face Llama 3.x checkpoints <-> :class:`models.llama.Llama`.

Reads ``config.json`` plus safetensors weights (``model.safetensors`` or shards
listed in ``model.safetensors.index.json``) and writes them back in the same
layout. Both transformers v4 (``rope_scaling`` + ``rope_theta``) and v5
(``rope_parameters``) config styles are understood.

Layout notes: HF ``nn.Linear`` weights are ``[out, in]``; the model's kernels
are ``[in, out]``, so they are transposed (exact). The model uses HF's
half-split ``rotate_half`` RoPE convention, so q/k rows load unpermuted.
Per-layer tensors are stacked along the model's leading ``layers`` axis.

    model, layout = load_hf("path/to/Llama-3.1-8B")          # fp32 params
    export_hf(model, "out_dir", layout=layout)                # same files/names/dtypes,
                                                              # config and generation config

A training run's checkpoint goes out with ``python -m train export-hf`` and HF
weights start a run with ``model.init_from`` (``train/hf.py``, docs/HF.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models import sharding as shd
from models.hf_config import (
    CONFIG_FILE,
    config_from_hf,
    config_to_hf,
    hf_max_position_embeddings,
    read_hf_config,
    read_json_object,
)
from models.hf_files import (
    check_resolves_inside,
    check_shard_name,
    discard,
    resolve_checkpoint_dir,
    write_staged,
)
from models.llama import Llama, LlamaConfig

__all__ = [
    "GENERATION_CONFIG_FILE",
    "HFLayout",
    "config_from_hf",
    "config_to_hf",
    "export_hf",
    "hf_max_position_embeddings",
    "hf_tensor_names",
    "load_hf",
    "load_hf_weights",
    "read_hf_config",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# (HF name template, model param path, transpose)
_LAYER_TENSORS = (
    ("model.layers.{i}.self_attn.q_proj.weight", ("layers", "q_proj", "kernel"), True),
    ("model.layers.{i}.self_attn.k_proj.weight", ("layers", "k_proj", "kernel"), True),
    ("model.layers.{i}.self_attn.v_proj.weight", ("layers", "v_proj", "kernel"), True),
    ("model.layers.{i}.self_attn.o_proj.weight", ("layers", "o_proj", "kernel"), True),
    ("model.layers.{i}.mlp.gate_proj.weight", ("layers", "gate_proj", "kernel"), True),
    ("model.layers.{i}.mlp.up_proj.weight", ("layers", "up_proj", "kernel"), True),
    ("model.layers.{i}.mlp.down_proj.weight", ("layers", "down_proj", "kernel"), True),
    ("model.layers.{i}.input_layernorm.weight", ("layers", "input_layernorm", "scale"), False),
    ("model.layers.{i}.post_attention_layernorm.weight",
     ("layers", "post_attention_layernorm", "scale"), False),
)
_GLOBAL_TENSORS = (
    ("model.embed_tokens.weight", ("embed_tokens", "embedding"), False),
    ("model.norm.weight", ("norm", "scale"), False),
)
_HEAD_TENSOR = ("lm_head.weight", ("lm_head", "kernel"), True)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class HFLayout:
    """How a checkpoint was laid out on disk, so :func:`export_hf` can reproduce it.

    ``weight_map``: tensor name -> file name (one file for unsharded checkpoints);
    ``dtypes``: tensor name -> numpy dtype name; ``index_metadata``: the index's
    ``metadata`` (None when unsharded); ``file_metadata``: file -> safetensors
    header metadata; ``hf_config``: the original ``config.json`` dict;
    ``generation_config``: the original ``generation_config.json`` dict (None
    when the checkpoint has none).

    Its ``repr`` is one line of counts (tensors, files, dtypes); the fields hold
    the details.
    """

    weight_map: Mapping[str, str]
    dtypes: Mapping[str, str]
    index_metadata: Mapping[str, Any] | None
    file_metadata: Mapping[str, Mapping[str, str] | None]
    hf_config: Mapping[str, Any]
    generation_config: Mapping[str, Any] | None = None

    @property
    def sharded(self) -> bool:
        return self.index_metadata is not None

    def __repr__(self) -> str:
        files = len(set(self.weight_map.values()))
        counts: dict[str, int] = {}
        for d in self.dtypes.values():
            counts[d] = counts.get(d, 0) + 1
        dtypes = ", ".join(f"{n} {d}" for d, n in sorted(counts.items()))
        return (f"HFLayout({len(self.weight_map)} tensors in {files} "
                f"{'shard' if self.sharded else 'file'}{'s' if files != 1 else ''}, {dtypes}; "
                f"model_type={self.hf_config.get('model_type')!r}, generation_config="
                f"{'yes' if self.generation_config is not None else 'no'})")


_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _check_float_tensor(name: str, dtype: Any, where: str) -> None:
    """Weights must be floating point: an int/bool tensor is a wrong file, not a cast."""
    dname = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dname not in _FLOAT_DTYPES:
        raise ValueError(f"tensor {name!r} in {where} has dtype {dname}; Llama weights must be "
                         f"one of {', '.join(_FLOAT_DTYPES)}")


def _check_finite_tensor(name: str, a: np.ndarray, where: str) -> None:
    """Weights must be finite: a NaN/Inf weight makes every step non-finite (each would be
    skipped), so it is refused on load, naming the tensor. Checked in slices of 2^24
    elements to bound the temporary memory."""
    flat = a.reshape(-1)
    step = 1 << 24
    bad = sum(int(np.count_nonzero(~np.isfinite(flat[i:i + step].astype(np.float32))))
              for i in range(0, flat.size, step))
    if bad:
        raise ValueError(f"tensor {name!r} in {where} holds {bad} non-finite value(s) (NaN or "
                         f"Inf) of {flat.size}; the checkpoint is damaged or was saved after "
                         "training diverged: use an earlier or repaired checkpoint")


# --------------------------------------------------------------------------- mapping


def _param_specs(config: LlamaConfig):
    """[(model path, [(hf name, transpose)], stacked)] in a fixed order."""
    out = []
    for name, path, tr in _GLOBAL_TENSORS[:1]:
        out.append((path, [(name, tr)], False))
    for tmpl, path, tr in _LAYER_TENSORS:
        out.append((path, [(tmpl.format(i=i), tr) for i in range(config.n_layers)], True))
    for name, path, tr in _GLOBAL_TENSORS[1:]:
        out.append((path, [(name, tr)], False))
    if not config.tie_embeddings:
        out.append((_HEAD_TENSOR[1], [(_HEAD_TENSOR[0], _HEAD_TENSOR[2])], False))
    return out


def hf_tensor_names(config: LlamaConfig) -> list[str]:
    """All HF tensor names a checkpoint of ``config`` holds."""
    return [n for _, names, _ in _param_specs(config) for n, _ in names]


def _get(tree: nnx.State, path: tuple) -> Any:
    node = tree
    for k in path:
        node = node[k]
    return node


# --------------------------------------------------------------------------- reading


class _Reader:
    """Opens a checkpoint directory: one safetensors file or an index + shards."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        single = os.path.join(path, SINGLE_FILE)
        if os.path.exists(index) and os.path.exists(single):
            # Which one is current cannot be told (transformers reads the single
            # file, an index-first reader the shards): refuse rather than guess.
            raise ValueError(f"{path} holds both {SINGLE_FILE} and {INDEX_FILE}, two "
                             "checkpoints of which one is stale; remove the stale one")
        if os.path.exists(index):
            idx = read_json_object(index)
            wm = idx.get("weight_map")
            if wm is None:
                raise ValueError(f"{index} has no 'weight_map'")
            if not isinstance(wm, dict) or not all(isinstance(k, str) for k in wm):
                raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
            meta = idx.get("metadata") or {}
            if not isinstance(meta, dict):
                raise ValueError(f"{index}: 'metadata' must be a JSON object")
            for fn in wm.values():
                check_shard_name(path, fn, index, reading=True)
            self.weight_map = dict(wm)
            self.index_metadata = dict(meta)
        elif os.path.exists(single):
            self.weight_map = None
            self.index_metadata = None
        else:
            raise FileNotFoundError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        files = sorted(set(self.weight_map.values())) if self.weight_map else [SINGLE_FILE]
        self.handles = {}
        self.file_metadata = {}
        name_to_file = {}
        for fn in files:
            check_shard_name(path, fn, index if self.weight_map is not None else path,
                             reading=True)
            fp = os.path.join(path, fn)
            if not os.path.exists(fp):
                raise FileNotFoundError(f"shard {fn} listed in {INDEX_FILE} is missing from {path}")
            try:
                h = safe_open(fp, framework="numpy")
                keys = list(h.keys())
                self.file_metadata[fn] = h.metadata()
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{fp} is not a readable safetensors file (truncated, empty "
                                 f"or not safetensors): {e}") from None
            self.handles[fn] = h
            for k in keys:
                if k in name_to_file:
                    raise ValueError(f"tensor {k} appears in both {name_to_file[k]} and {fn}")
                name_to_file[k] = fn
        if self.weight_map is not None:
            for k, fn in self.weight_map.items():
                if name_to_file.get(k) != fn:
                    raise ValueError(f"{INDEX_FILE} maps {k} to {fn} but that file does not "
                                     "hold it")
        self.name_to_file = name_to_file

    def names(self) -> set[str]:
        return set(self.name_to_file)

    def get(self, name: str) -> np.ndarray:
        fn = self.name_to_file.get(name)
        if fn is None:
            raise KeyError(f"tensor {name!r} is missing from checkpoint {self.path}")
        fp = os.path.join(self.path, fn)
        try:
            a = self.handles[fn].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read tensor {name!r} from {fp}: {e}") from None
        _check_float_tensor(name, a.dtype, fp)
        _check_finite_tensor(name, a, fp)
        return a


def load_hf_weights(model: Llama, path: str, *, mesh=None,
                    rules: shd.Rules = shd.DEFAULT_RULES) -> HFLayout:
    """Load the checkpoint at ``path`` into ``model`` in place; returns its layout.

    Checks every tensor's presence and shape; raises KeyError naming a missing
    tensor, ValueError for a shape mismatch or an unexpected tensor. With a
    ``mesh``, parameters are placed sharded per ``rules``. ``path`` may start
    with ``~`` and may be a hub cache snapshot or repository directory (see
    :func:`models.hf_files.resolve_checkpoint_dir`).
    """
    cfg = model.config
    path = resolve_checkpoint_dir(path)
    reader = _Reader(path)
    state = nnx.state(model, nnx.Param)
    specs = shd.param_partition_specs(model, mesh, rules) if mesh is not None else None
    seen: set[str] = set()
    dtypes: dict[str, str] = {}
    for mpath, names, stacked in _param_specs(cfg):
        var = _get(state, mpath)
        want = tuple(var.shape[1:]) if stacked else tuple(var.shape)
        arrays = []
        for name, tr in names:
            a = reader.get(name)
            hf_shape = want[::-1] if tr else want
            if tuple(a.shape) != hf_shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, expected "
                                 f"{hf_shape} for this config")
            dtypes[name] = a.dtype.name
            seen.add(name)
            arrays.append(np.ascontiguousarray(a.T) if tr else a)
        full = np.stack(arrays) if stacked else arrays[0]
        full = full.astype(cfg.param_dtype)
        if specs is not None:
            value = jax.device_put(full, jax.sharding.NamedSharding(mesh, specs[mpath]))
        else:
            value = jax.numpy.asarray(full)
        var.set_value(value)
        del arrays, full
    extra = sorted(n for n in reader.names() - seen if not n.endswith(_IGNORED_SUFFIXES))
    if cfg.tie_embeddings and _HEAD_TENSOR[0] in extra:
        head = reader.get(_HEAD_TENSOR[0])
        emb = reader.get(_GLOBAL_TENSORS[0][0])
        if head.shape != emb.shape or not np.array_equal(head, emb):
            raise ValueError("config ties embeddings but lm_head.weight differs from "
                             "model.embed_tokens.weight")
        extra.remove(_HEAD_TENSOR[0])
    if extra:
        raise ValueError(f"checkpoint {path} has tensors this Llama config does not use: "
                         f"{extra[:10]}{' ...' if len(extra) > 10 else ''}")
    nnx.update(model, state)
    wm = reader.weight_map or {n: SINGLE_FILE for n in seen}
    gen = os.path.join(path, GENERATION_CONFIG_FILE)
    return HFLayout(weight_map={n: wm[n] for n in sorted(seen)}, dtypes=dtypes,
                    index_metadata=reader.index_metadata,
                    file_metadata=reader.file_metadata, hf_config=read_hf_config(path),
                    generation_config=read_json_object(gen) if os.path.isfile(gen) else None)


def load_hf(path: str, *, mesh=None, rules: shd.Rules = shd.DEFAULT_RULES,
            **config_overrides) -> tuple[Llama, HFLayout]:
    """Build a :class:`Llama` from an HF checkpoint directory.

    ``path``: a checkpoint directory (``~`` expanded), or a Hugging Face hub
    cache snapshot (``.../models--org--name/snapshots/<rev>``, whose files
    link into ``../../blobs/``) or repository directory (``refs/main``'s
    snapshot). ``config_overrides`` go to :func:`config_from_hf` (e.g.
    ``dtype='bfloat16'``). Parameters are allocated only once, from the
    checkpoint (the model is built abstractly first). Returns ``(model, layout)``.
    """
    path = resolve_checkpoint_dir(path)
    cfg = config_from_hf(path, **config_overrides)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    layout = load_hf_weights(model, path, mesh=mesh, rules=rules)
    return model, layout


# --------------------------------------------------------------------------- writing


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def export_hf(model: Llama, out_dir: str, *, layout: HFLayout | None = None,
              dtype: str | None = None, max_shard_bytes: int = 5 * 2**30,
              generation_config: Mapping[str, Any] | None = None,
              hf_config_extra: Mapping[str, Any] | None = None) -> list[str]:
    """Write ``model`` as an HF checkpoint into ``out_dir``; returns the files written.

    With ``layout`` (from :func:`load_hf`): the same file names, tensor-to-file
    assignment, dtypes, index/file metadata, config.json and generation_config.json.
    Otherwise tensors are written in ``dtype`` (default: the param dtype), sharded
    into files of at most ``max_shard_bytes`` (one ``model.safetensors`` when it
    all fits), with the config.json of :func:`config_to_hf`.

    ``generation_config``: the ``generation_config.json`` to write (default: the
    layout's, if any; none without a layout, which leaves a file of that name in
    ``out_dir`` as it is, like the tokenizer's files). ``hf_config_extra``: further
    config.json fields, e.g. ``{"bos_token_id": 1, "eos_token_id": 2}``; a field
    that describes the architecture (one :func:`config_to_hf` writes) is refused.

    A checkpoint already in ``out_dir`` is replaced, not mixed with: its
    ``model.safetensors`` / index go first, then config.json and the new
    weights are written (each file to a temporary name, then renamed), the
    index (or the single file) last, and the old index's shards the new
    checkpoint does not use are removed. An interrupted export therefore
    leaves a directory :func:`load_hf` refuses, never one it reads stale or
    mixed weights from. An OSError (disk full, read-only) names the file.
    """
    out_dir = os.path.expanduser(os.fspath(out_dir))
    cfg = model.config
    names = hf_tensor_names(cfg)
    if layout is not None:
        missing = sorted(set(names) - set(layout.weight_map))
        if missing or len(layout.weight_map) != len(names):
            raise ValueError(f"layout does not match this model's tensors (missing {missing[:5]})")
    if hf_config_extra:
        clash = sorted(set(hf_config_extra) & set(config_to_hf(cfg)))
        if clash:
            raise ValueError(f"hf_config_extra sets {clash}, which the model's own config "
                             "decides; pass only fields such as bos_token_id/eos_token_id")
    if generation_config is None and layout is not None:
        generation_config = layout.generation_config
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(f"export_hf dtype={dtype!r}; expected one of {', '.join(_FLOAT_DTYPES)}")
    if layout is not None:
        for name in names:
            _check_float_tensor(name, layout.dtypes[name], "the layout's dtypes")
        for fn in layout.weight_map.values():
            check_shard_name(out_dir, fn, "the layout's weight_map")
    old_shards = _existing_shards(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    tensors: dict[str, np.ndarray] = {}
    for mpath, hf_names, stacked in _param_specs(cfg):
        full = np.asarray(jax.device_get(_get(state, mpath).get_value()))
        for i, (name, tr) in enumerate(hf_names):
            a = full[i] if stacked else full
            a = a.T if tr else a
            target = layout.dtypes[name] if layout is not None else (dtype or cfg.param_dtype.name)
            tensors[name] = np.ascontiguousarray(a.astype(_np_dtype(target)))

    if layout is not None:
        weight_map = dict(layout.weight_map)
        sharded = layout.sharded
        index_meta = dict(layout.index_metadata or {})
        file_meta = dict(layout.file_metadata)
        hf_config = dict(layout.hf_config)
    else:
        weight_map: dict[str, str] = {}
        files: list[list[str]] = [[]]
        size = 0
        for n in names:
            nb = tensors[n].nbytes
            if files[-1] and size + nb > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append(n)
            size += nb
        sharded = len(files) > 1
        for k, group in enumerate(files):
            fn = (f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" if sharded
                  else SINGLE_FILE)
            for n in group:
                weight_map[n] = fn
        index_meta = {"total_size": int(sum(t.nbytes for t in tensors.values()))}
        file_meta = {fn: {"format": "pt"} for fn in set(weight_map.values())}
        hf_config = config_to_hf(cfg, torch_dtype=dtype or cfg.param_dtype.name)
    hf_config.update(hf_config_extra or {})

    by_file: dict[str, dict[str, np.ndarray]] = {}
    for n, fn in weight_map.items():
        by_file.setdefault(fn, {})[n] = tensors[n]
    extra_files = (GENERATION_CONFIG_FILE,) if generation_config is not None else ()
    for fn in (*by_file, *((INDEX_FILE,) if sharded else ()), CONFIG_FILE, *extra_files):
        check_resolves_inside(out_dir, fn, f"export target {fn!r}")
    # Every new file is staged under a temporary name first: a failed write (disk
    # full) leaves the old checkpoint as it was.
    to_write = [(CONFIG_FILE, functools.partial(_dump_json, hf_config))]
    if generation_config is not None:
        to_write.append((GENERATION_CONFIG_FILE,
                         functools.partial(_dump_json, dict(generation_config))))
    to_write += [(fn, functools.partial(_save_safetensors, group, file_meta.get(fn)))
              for fn, group in sorted(by_file.items())]
    if sharded:
        index = {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}
        to_write.append((INDEX_FILE, functools.partial(_dump_json, index)))
    staged: list[str] = []
    try:
        for fn, write in to_write:
            staged.append(write_staged(os.path.join(out_dir, fn), write))
    except BaseException:
        discard(staged)
        raise
    # Commit: the old checkpoint stops being loadable, then the new one's files
    # land with its index (or single file) last.
    for marker in (INDEX_FILE, SINGLE_FILE):
        if os.path.lexists(os.path.join(out_dir, marker)):
            os.remove(os.path.join(out_dir, marker))
    written = []
    for (fn, _), tmp in zip(to_write, staged, strict=True):
        os.replace(tmp, os.path.join(out_dir, fn))
        written.append(os.path.join(out_dir, fn))
    for fn in sorted(old_shards - set(by_file)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, fn))
    return written


def _existing_shards(out_dir: str) -> set[str]:
    """Shard files the index already in ``out_dir`` lists (validated names), for removal.

    An index that cannot be read is refused rather than half replaced.
    """
    index = os.path.join(out_dir, INDEX_FILE)
    if not os.path.isfile(index):
        return set()
    what = (f"export_hf would replace the checkpoint in {out_dir}, but its {INDEX_FILE} "
            "cannot be read ({}); remove it or export elsewhere")
    try:
        wm = read_json_object(index).get("weight_map")
    except (OSError, ValueError) as e:
        raise ValueError(what.format(e)) from None
    if not isinstance(wm, dict):
        raise ValueError(what.format("no 'weight_map' object"))  # noqa: TRY004
    return {check_shard_name(out_dir, fn, index) for fn in set(wm.values())}


def _save_safetensors(group: dict[str, np.ndarray], metadata, path: str) -> None:
    try:
        save_file(group, path, metadata=metadata)
    except SafetensorError as e:  # safetensors reports write errors (ENOSPC, EFBIG) this way
        raise OSError(str(e)) from e


def _dump_json(obj: Any, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
