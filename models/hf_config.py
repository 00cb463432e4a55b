"""Hugging Face ``config.json`` <-> :class:`models.llama.LlamaConfig`.

Both transformers v4 (``rope_scaling`` + ``rope_theta``) and v5
(``rope_parameters``) config styles are understood.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from models.llama import LlamaConfig, RopeScaling

__all__ = ["CONFIG_FILE", "config_from_hf", "config_to_hf", "hf_max_position_embeddings",
           "read_hf_config", "read_json_object"]

CONFIG_FILE = "config.json"


def read_json_object(p: str) -> dict:
    """A JSON file that must hold an object; every failure names the file."""
    try:
        with open(p, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{p} must hold a JSON object, got a {type(obj).__name__}")  # noqa: TRY004
    return obj


def read_hf_config(path: str) -> dict:
    """The ``config.json`` dict of a checkpoint directory (or a config.json path).

    Raises FileNotFoundError when it is absent and ValueError (naming the file)
    when it is not valid JSON or not a JSON object.
    """
    path = os.path.expanduser(os.fspath(path))
    p = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    if not os.path.exists(p):
        raise FileNotFoundError(f"no {CONFIG_FILE} at {p}")
    return read_json_object(p)


_MISSING = object()


class _Fields:
    """Typed reads of config.json fields; every error names the field and the file.

    JSON ``null`` counts as absent (HF writes ``"head_dim": null``). Integers
    must be JSON integers (or integral floats such as ``4096.0``), never
    strings or booleans; floats must be finite numbers; flags must be JSON
    booleans (``"false"`` as a string would otherwise read as true).
    """

    def __init__(self, obj: Mapping[str, Any], where: str):
        self.obj = obj
        self.where = where

    def _absent(self, key: str, default: Any) -> Any:
        if default is _MISSING:
            raise ValueError(f"{self.where} lacks required field {key!r}")
        return default

    def _bad(self, key: str, v: Any, want: str) -> ValueError:
        return ValueError(f"{self.where}: field {key!r} must be {want}, got {v!r} "
                          f"({type(v).__name__})")

    def positive_int(self, key: str, default: Any = _MISSING) -> Any:
        v = self.obj.get(key)
        if v is None:
            return self._absent(key, default)
        ok = (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, float) and math.isfinite(v) and v.is_integer())
        if not ok or v <= 0:
            raise self._bad(key, v, "a positive integer")
        return int(v)

    def positive_float(self, key: str, default: Any = _MISSING) -> Any:
        v = self.obj.get(key)
        if v is None:
            return self._absent(key, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or v <= 0:
            raise self._bad(key, v, "a finite number > 0")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        v = self.obj.get(key)
        if v is None:
            return self._absent(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, v, "true or false")
        return v

    def string(self, key: str, default: Any = _MISSING) -> Any:
        v = self.obj.get(key)
        if v is None:
            return self._absent(key, default)
        if not isinstance(v, str):
            raise self._bad(key, v, "a string")
        return v

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        v = self.obj.get(key)
        if v is not None and not isinstance(v, Mapping):
            raise self._bad(key, v, "a JSON object or null")
        return v


def _rope_from_hf(f: _Fields) -> tuple[float, RopeScaling | None]:
    hf = f.obj
    params = f.mapping("rope_parameters")
    if params is None:  # transformers v4 style
        params = dict(f.mapping("rope_scaling") or {})
        if hf.get("rope_theta") is not None:
            params.setdefault("rope_theta", f.positive_float("rope_theta"))
        key = "rope_scaling"
    else:
        key = "rope_parameters"
    p = _Fields(params, f"{f.where} ({key})")
    theta = p.positive_float("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r} in {f.where} (only 'llama3' "
                         "and 'default' are Llama 3.x)")
    kw = {k: p.positive_float(k) for k in ("factor", "low_freq_factor", "high_freq_factor")}
    kw["original_max_position_embeddings"] = p.positive_int("original_max_position_embeddings")
    try:
        return theta, RopeScaling(**kw)
    except ValueError as e:
        raise ValueError(f"{p.where}: {e}") from None


def config_from_hf(hf: Mapping[str, Any] | str, **overrides) -> LlamaConfig:
    """LlamaConfig from an HF ``config.json`` dict or checkpoint path.

    ``overrides`` (e.g. ``dtype='bfloat16'``, ``scan_layers=False``) replace
    fields. Raises ValueError for a non-Llama config, features this model
    does not have (biases, another activation, another RoPE type), and a
    missing field or one of the wrong type (naming the field and, when read
    from a path, the file).
    """
    where = CONFIG_FILE
    if isinstance(hf, str):
        path = os.path.expanduser(hf)
        where = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
        hf = read_hf_config(path)
    f = _Fields(hf, where)
    mt = hf.get("model_type")
    if mt != "llama":
        raise ValueError(f"{where}: model_type is {mt!r}, expected 'llama'")
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if not isinstance(archs, list) or "LlamaForCausalLM" not in archs:
        raise ValueError(f"{where}: architectures {archs} do not include LlamaForCausalLM")
    if f.string("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} is not 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if f.flag(flag, False):
            raise ValueError(f"{where} sets {flag}=true; Llama 3.x has no biases")
    theta, scaling = _rope_from_hf(f)
    n_heads = f.positive_int("num_attention_heads")
    kw: dict[str, Any] = {
        "vocab_size": f.positive_int("vocab_size"),
        "dim": f.positive_int("hidden_size"),
        "n_layers": f.positive_int("num_hidden_layers"),
        "n_heads": n_heads,
        "n_kv_heads": f.positive_int("num_key_value_heads", n_heads),
        "ffn_dim": f.positive_int("intermediate_size"),
        "head_dim": f.positive_int("head_dim", None),
        "max_seq_len": f.positive_int("max_position_embeddings", 8192),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": f.positive_float("rms_norm_eps", 1e-6),
        "tie_embeddings": f.flag("tie_word_embeddings", False),
    }
    kw.update(overrides)
    try:
        return LlamaConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{where} describes no valid Llama: {e}") from None


def hf_max_position_embeddings(config: LlamaConfig) -> int:
    """The ``max_position_embeddings`` an HF config of ``config`` states.

    ``config.max_seq_len`` (the longest sequence the model accepts), except when
    llama3 RoPE scaling is on and ``max_seq_len`` does not exceed the scaling's
    ``original_max_position_embeddings``: an HF llama3 config says "pretrained at
    ``original`` positions, extended beyond", and transformers warns about one
    whose ``original_max_position_embeddings >= max_position_embeddings``
    (the tiny preset's 8192 over ``max_seq_len`` 256, or the 8B preset's 8192
    over 8192). Then the context the scaling extends to, ``factor * original``
    (at least ``original + 1``), is stated. transformers computes llama3 RoPE
    frequencies from the scaling fields alone, so the exported model computes the
    same logits either way.
    """
    s = config.rope_scaling
    if s is None or config.max_seq_len > s.original_max_position_embeddings:
        return config.max_seq_len
    return max(s.original_max_position_embeddings + 1,
               math.ceil(s.factor * s.original_max_position_embeddings))


def config_to_hf(config: LlamaConfig, *, torch_dtype: str = "float32") -> dict:
    """An HF ``config.json`` dict (transformers v4 style, as Meta's checkpoints ship).

    ``max_position_embeddings`` is :func:`hf_max_position_embeddings` (above
    ``original_max_position_embeddings`` whenever llama3 RoPE scaling is on).
    """
    c = config
    rope_scaling = None
    if c.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": c.rope_scaling.factor,
            "low_freq_factor": c.rope_scaling.low_freq_factor,
            "high_freq_factor": c.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": c.rope_scaling.original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hf_max_position_embeddings(c),
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
    }
