"""Hugging Face ``config.json`` <-> :class:`models.llama.LlamaConfig`.

Both transformers v4 (``rope_scaling`` + ``rope_theta``) and v5
(``rope_parameters``) config styles are understood.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from models.llama import LlamaConfig, RopeScaling

__all__ = ["CONFIG_FILE", "config_from_hf", "config_to_hf", "read_hf_config", "read_json_object"]

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
    p = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    if not os.path.exists(p):
        raise FileNotFoundError(f"no {CONFIG_FILE} at {p}")
    return read_json_object(p)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_parameters")
    if params is None:  # transformers v4 style
        params = dict(hf.get("rope_scaling") or {})
        if "rope_theta" in hf:
            params.setdefault("rope_theta", hf["rope_theta"])
    params = dict(params)
    theta = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r} in config.json (only 'llama3' "
                         "and 'default' are Llama 3.x)")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling in config.json lacks {e.args[0]!r}") from None
    return theta, scaling


def config_from_hf(hf: Mapping[str, Any] | str, **overrides) -> LlamaConfig:
    """LlamaConfig from an HF ``config.json`` dict or checkpoint path.

    ``overrides`` (e.g. ``dtype='bfloat16'``, ``scan_layers=False``) replace
    fields. Raises ValueError for a non-Llama config or features this model
    does not have (biases, another activation, another RoPE type).
    """
    if isinstance(hf, str):
        hf = read_hf_config(hf)
    mt = hf.get("model_type")
    if mt != "llama":
        raise ValueError(f"config.json model_type is {mt!r}, expected 'llama'")
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in archs:
        raise ValueError(f"config.json architectures {archs} do not include LlamaForCausalLM")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf['hidden_act']!r} is not 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            raise ValueError(f"config.json sets {flag}=true; Llama 3.x has no biases")
    theta, scaling = _rope_from_hf(hf)
    try:
        n_heads = int(hf["num_attention_heads"])
        kw: dict[str, Any] = {
            "vocab_size": int(hf["vocab_size"]),
            "dim": int(hf["hidden_size"]),
            "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": n_heads,
            "n_kv_heads": int(hf.get("num_key_value_heads") or n_heads),
            "ffn_dim": int(hf["intermediate_size"]),
            "head_dim": int(hf["head_dim"]) if hf.get("head_dim") else None,
            "max_seq_len": int(hf.get("max_position_embeddings", 8192)),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None
    kw.update(overrides)
    return LlamaConfig(**kw)


def config_to_hf(config: LlamaConfig, *, torch_dtype: str = "float32") -> dict:
    """An HF ``config.json`` dict (transformers v4 style, as Meta's checkpoints ship)."""
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
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
    }
