"""HF config.json fields of the wrong type: a message naming the field and
the file, never `invalid literal for int()` or a silent misreading ("false" read as true)."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from models import hf

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "hf_tiny_llama")
BASE = hf.read_hf_config(FIXTURE)


@pytest.mark.parametrize(("key", "value", "want"), [
    ("hidden_size", "sixty-four", "a positive integer"),
    ("hidden_size", True, "a positive integer"),
    ("hidden_size", 64.5, "a positive integer"),
    ("num_hidden_layers", 0, "a positive integer"),
    ("num_key_value_heads", [2], "a positive integer"),
    ("vocab_size", "128", "a positive integer"),
    ("rms_norm_eps", math.nan, "a finite number > 0"),
    ("rms_norm_eps", "1e-5", "a finite number > 0"),
    ("tie_word_embeddings", "false", "true or false"),
    ("attention_bias", "false", "true or false"),
    ("hidden_act", 3, "a string"),
    ("rope_parameters", "llama3", "a JSON object or null"),
])
def test_wrong_field_type_names_field(key, value, want):
    with pytest.raises(ValueError, match=rf"config\.json: field '{key}' must be {want}, got "):
        hf.config_from_hf({**BASE, key: value})


@pytest.mark.parametrize(("key", "value"), [("factor", "8"), ("rope_theta", math.inf),
                                            ("original_max_position_embeddings", 64.5)])
def test_wrong_rope_field_type_names_field(key, value):
    rope = {**BASE["rope_parameters"], key: value}
    with pytest.raises(ValueError, match=rf"config\.json \(rope_parameters\): field '{key}'"):
        hf.config_from_hf({**BASE, "rope_parameters": rope})


def test_integral_floats_and_nulls_are_accepted():
    cfg = hf.config_from_hf({**BASE, "hidden_size": 64.0, "head_dim": None,
                             "num_key_value_heads": None})
    assert cfg == hf.config_from_hf({**BASE, "head_dim": 16, "num_key_value_heads": 4})
    assert isinstance(cfg.dim, int)


def test_load_hf_names_the_file(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    invalid = (r"ckpt/config\.json describes no valid Llama: "
               r".*n_heads \(4\) must be a multiple of n_kv_heads \(3\)")
    for key, value, match in [
            ("hidden_size", "sixty-four", r"ckpt/config\.json: field 'hidden_size'"),
            ("num_key_value_heads", 3, invalid)]:
        (d / hf.CONFIG_FILE).write_text(json.dumps({**BASE, key: value}))
        with pytest.raises(ValueError, match=match):
            hf.load_hf(str(d))
