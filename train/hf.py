"""Runs <-> Hugging Face Llama checkpoints.

* `export_run(run_dir, out_dir, step=None)`: a run's checkpoint (the latest, or
  step N) as an HF Llama directory: ``config.json`` (the `LlamaConfig` rebuilt
  from the checkpoint's record, ``meta['compat']['model']``, RoPE scaling
  included), ``generation_config.json``, safetensors weights (+ index when
  sharded) and the run's tokenizer (``tokenizer.json`` from its prepared data,
  the trained byte-level BPE or the HF file it was given, with a
  ``tokenizer_config.json``). The key mapping and the file writing are
  `models.hf.export_hf`'s. ``python -m train export-hf RUN_DIR OUT_DIR``.
* ``model.init_from: PATH`` in a run's config: the run's fresh state takes its
  parameters from the HF checkpoint at PATH (continued pretraining).
  `check_init_from` compares the checkpoint's architecture with the run's model
  (at ``--check``, before anything compiles, when the run has no checkpoint of its
  own yet), naming every field that differs;
  `load_init_params` reads the weights into the run's fp32 master parameters
  (bf16/fp16 values convert exactly) with the run's shardings. The optimizer
  state is fresh (zero moments, step 0). A run resumed from its own checkpoint
  never reads the HF weights again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import hf as mhf
from models.hf_files import resolve_checkpoint_dir
from models.llama import Llama, LlamaConfig, RopeScaling
from train.checkpoint import Checkpointer, flatten, unflatten
from train.config import ConfigError
from train.jsonsafe import jsonable

__all__ = [
    "ARCHITECTURE_FIELDS",
    "ExportError",
    "ExportResult",
    "check_init_from",
    "export_run",
    "load_init_params",
    "model_config_from_meta",
]

# The LlamaConfig fields that decide what a set of weights computes. ``max_seq_len`` is
# not one: it bounds the sequence length (the run's own applies), it is no weight.
ARCHITECTURE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                       "head_dim", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_TOKENIZER_SIDE_FILES = (TOKENIZER_CONFIG_FILE, "special_tokens_map.json")


class ExportError(RuntimeError):
    """A run, step or output directory `export_run` cannot use (the message says why)."""


# --------------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportResult:
    """What `export_run` wrote: the checkpoint ``step``, the ``files`` and a line on
    the ``tokenizer`` (exported, or why not)."""

    step: int
    out_dir: Path
    files: tuple[str, ...]
    tokenizer: str


def model_config_from_meta(meta: Mapping[str, Any]) -> LlamaConfig:
    """The run's `LlamaConfig` from a checkpoint record (``meta['compat']['model']``)."""
    rec = (meta.get("compat") or {}).get("model")
    if not isinstance(rec, Mapping):
        raise ExportError("the checkpoint's record has no model config (compat.model)")
    kw = dict(rec)
    rs = kw.get("rope_scaling")
    try:
        kw["rope_scaling"] = RopeScaling(**rs) if rs else None
        return LlamaConfig(**kw)
    except (TypeError, ValueError) as e:
        raise ExportError(f"the checkpoint's model config cannot be rebuilt ({e}); was it "
                          "written by another version of train?") from None


def _find_prepared(meta: Mapping[str, Any]) -> Path | None:
    """The run's prepared data directory (holding its tokenizer.json), if still there.

    Found by the data fingerprint the checkpoint records, under the run's
    ``data.cache_dir`` (a relative one is read from the current directory).
    """
    want = ((meta.get("compat") or {}).get("data") or {}).get("fingerprint")
    cache = ((meta.get("config") or {}).get("data") or {}).get("cache_dir")
    if not isinstance(want, str) or not cache or not Path(cache).is_dir():
        return None
    for d in sorted(Path(cache).glob(f"*-{want[:12]}")):
        try:
            m = json.loads((d / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        if (m.get("fingerprint") or {}).get("hash") == want and (d / TOKENIZER_FILE).is_file():
            return d
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RunTokenizer:
    """The run's tokenizer file, where it was found, and its EOS/BOS."""

    path: Path
    source: str
    eos_token: str
    eos_id: int
    bos_token: str | None
    bos_id: int | None


def _run_tokenizer(meta: Mapping[str, Any]) -> _RunTokenizer | str:
    """The run's tokenizer: the copy in its prepared data (the exact file it used: the
    trained BPE, or its copy of an HF tokenizer.json), else the HF tokenizer.json its
    config names; a str saying why there is none."""
    from train.data.tokenizer import TokenizerError, load_hf

    data = (meta.get("config") or {}).get("data") or {}
    spec = data.get("tokenizer", "bpe")
    prepared = _find_prepared(meta)
    if prepared is not None:
        path, source = prepared / TOKENIZER_FILE, f"the run's prepared data {prepared}"
    elif spec != "bpe" and Path(spec).is_file():
        path, source = Path(spec), f"data.tokenizer {spec}"
    else:
        return ("not exported: the run's prepared data (its BPE tokenizer) is gone from "
                f"data.cache_dir {data.get('cache_dir')!r} (a relative path is read from the "
                "current directory); prepare it again (python -m train.data prepare --config "
                "RUN_DIR/config.yaml) and export again")
    try:
        tok = load_hf(path, eos_token=data.get("eos_token"), add_bos=bool(data.get("add_bos")))
    except TokenizerError as e:
        return f"not exported: {e}"
    bos = tok.tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
    return _RunTokenizer(path=path, source=source, eos_token=tok.eos_token, eos_id=tok.eos_id,
                         bos_token=bos, bos_id=tok.bos_id)


def _write_tokenizer(meta: Mapping[str, Any], tok: _RunTokenizer, out_dir: Path,
                     seq_len: int) -> list[str]:
    """Copy the run's tokenizer.json; add the HF tokenizer's own side files when the run
    used an HF tokenizer that has them, else write a tokenizer_config.json for
    ``transformers.PreTrainedTokenizerFast``."""
    written = []
    shutil.copyfile(tok.path, out_dir / TOKENIZER_FILE)
    written.append(str(out_dir / TOKENIZER_FILE))
    spec = ((meta.get("config") or {}).get("data") or {}).get("tokenizer", "bpe")
    side = [Path(spec).parent / f for f in _TOKENIZER_SIDE_FILES] if spec != "bpe" else []
    side = [p for p in side if p.is_file()]
    if any(p.name == TOKENIZER_CONFIG_FILE for p in side):
        for p in side:
            shutil.copyfile(p, out_dir / p.name)
            written.append(str(out_dir / p.name))
        return written
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token,
          "bos_token": tok.bos_token, "model_max_length": seq_len,
          "clean_up_tokenization_spaces": False}
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tc, indent=2))
    written.append(str(out_dir / TOKENIZER_CONFIG_FILE))
    return written


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
               step: int | None = None, force: bool = False,
               dtype: str = "float32") -> ExportResult:
    """Write the checkpoint of ``step`` (default: the latest) of the run in ``run_dir``
    as an HF Llama directory in ``out_dir`` (see the module docstring).

    The checkpoint is restored whole (parameters and optimizer moments, so about
    3x the parameters' memory on the host) and checked against its digests.
    ``dtype``: the weights' dtype on disk (the fp32 master weights by default;
    'bfloat16' halves the files, rounding to nearest even). ``out_dir`` must be
    absent or empty unless ``force``, which replaces the HF checkpoint files in it.

    Raises ExportError (no such run, step, or an occupied ``out_dir``),
    CheckpointError (a damaged checkpoint), OSError (a failed write).
    """
    run, out = Path(run_dir).expanduser(), Path(out_dir).expanduser()
    ckdir = run / "checkpoints"
    if not run.is_dir():
        raise ExportError(f"no run directory {run}")
    if not ckdir.is_dir() or not any(ckdir.iterdir()):
        raise ExportError(f"{run} holds no checkpoints ({ckdir} is missing or empty): not the "
                          "output directory of a `python -m train` run with checkpoints")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ExportError(f"dtype {dtype!r}: expected float32, bfloat16 or float16")
    if out.exists() and not out.is_dir():
        raise ExportError(f"OUT_DIR {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"OUT_DIR {out} exists and is not empty; choose a new directory, or "
                          "pass --force to replace the HF checkpoint in it")
    if out.resolve() == run.resolve() or ckdir.resolve() in (out.resolve(), *out.resolve().parents):
        raise ExportError(f"OUT_DIR {out} is the run directory or inside its checkpoints/; "
                          "export elsewhere")
    with Checkpointer(ckdir, keep=1, async_save=False, read_only=True) as ckpt:
        steps = ckpt.steps()
        if not steps:
            raise ExportError(f"{ckdir} holds no complete checkpoint")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ExportError(f"{ckdir} has no checkpoint of step {step}; it has steps "
                              f"{', '.join(map(str, steps))}")
        meta = ckpt.read_meta(step)
        mc = model_config_from_meta(meta)
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        like = {k: jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dt), sharding=dev)
                for k, (shape, dt) in meta.get("arrays", {}).items()}
        flat = ckpt.restore(step, like, meta)
    model = nnx.eval_shape(lambda: Llama(mc, rngs=nnx.Rngs(0)))
    pstate = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(pstate)
    keys, _ = flatten(pure)
    have = {k[len("params."):] for k in flat if k.startswith("params.")}
    if have != set(keys):
        raise ExportError(f"checkpoint step {step} holds other parameters than its model config "
                          f"builds (missing {sorted(set(keys) - have)[:3]}, unexpected "
                          f"{sorted(have - set(keys))[:3]})")
    nnx.replace_by_pure_dict(pstate, unflatten({k: flat[f"params.{k}"] for k in keys}, pure))
    nnx.update(model, pstate)
    del flat

    tok = _run_tokenizer(meta)
    seq_len = int(((meta.get("config") or {}).get("data") or {}).get("seq_len") or mc.max_seq_len)
    extra: dict[str, Any] = {}
    if not isinstance(tok, str):
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
        extra = {k: v for k, v in ids.items() if v is not None}
    gen = {"_from_model_config": True, **extra}
    out.mkdir(parents=True, exist_ok=True)
    files = mhf.export_hf(model, str(out), dtype=dtype, generation_config=gen,
                          hf_config_extra=extra)
    if isinstance(tok, str):
        note = f"tokenizer: {tok}"
    else:
        files += _write_tokenizer(meta, tok, out, seq_len)
        note = f"tokenizer: {TOKENIZER_FILE} from {tok.source}"
    return ExportResult(step=step, out_dir=out, files=tuple(files), tokenizer=note)


# --------------------------------------------------------------------------- init_from


def _hf_config(path: str) -> LlamaConfig:
    try:
        d = resolve_checkpoint_dir(path)
        cfg = mhf.config_from_hf(d)
    except FileNotFoundError as e:
        raise ConfigError(f"model.init_from: {e} (expected a Hugging Face Llama checkpoint "
                          "directory: config.json and safetensors weights)") from None
    except ValueError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    if not any(os.path.isfile(os.path.join(d, f)) for f in (mhf.SINGLE_FILE, mhf.INDEX_FILE)):
        raise ConfigError(f"model.init_from: {d} holds no {mhf.SINGLE_FILE} or "
                          f"{mhf.INDEX_FILE}")
    return cfg


def check_init_from(path: str, model_config: LlamaConfig) -> None:
    """ConfigError unless the HF checkpoint at ``path`` has ``model_config``'s architecture.

    Compares `ARCHITECTURE_FIELDS`; the message names every field that differs, with
    both values, and the ``model.overrides`` that would match the checkpoint.
    """
    hf_cfg = _hf_config(path)
    diffs = [(k, getattr(hf_cfg, k), getattr(model_config, k)) for k in ARCHITECTURE_FIELDS
             if getattr(hf_cfg, k) != getattr(model_config, k)]
    if not diffs:
        return
    lines = "\n".join(f"  {k}: checkpoint {jsonable(a)!r}, run {jsonable(b)!r}"
                      for k, a, b in diffs)
    fix = ", ".join(f"{k}: {json.dumps(jsonable(a))}" for k, a, _ in diffs)
    vocab = ("\n(vocab_size: the data must be tokenized with the checkpoint's tokenizer, e.g. "
             "data.tokenizer: <checkpoint>/tokenizer.json)"
             if any(k == "vocab_size" for k, _, _ in diffs) else "")
    raise ConfigError(f"model.init_from: the checkpoint at {path} has another architecture than "
                      f"this run's model (model.preset + model.overrides):\n{lines}\nto train it, "
                      f"set model.overrides to include {{{fix}}}{vocab}")


def load_init_params(path: str, model_config: LlamaConfig, mesh: jax.sharding.Mesh,
                     param_shardings: Any) -> Any:
    """The HF checkpoint's weights as the run's pure parameter dict (fp32 master weights,
    placed with ``param_shardings``). Errors are ConfigErrors naming model.init_from."""
    model = nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0)))
    try:
        mhf.load_hf_weights(model, path, mesh=mesh)
    except (KeyError, ValueError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"model.init_from: {msg}") from None
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.device_put(params, param_shardings)
