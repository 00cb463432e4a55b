"""Make the tiny Hugging Face Llama fixture used by tests/models/test_hf_parity.py.

Runs in a SEPARATE environment with torch + transformers (never the project's
.venv), e.g.::

    python3.11 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/torchvenv/bin/python scripts/make_hf_fixture.py [--out tests/models/data/hf_tiny_llama]

It builds a random ``LlamaForCausalLM`` (GQA, llama3 RoPE scaling chosen so all
three frequency bands -- kept, interpolated, divided by the factor -- occur),
saves it with ``save_pretrained`` as sharded safetensors (two shards plus
``model.safetensors.index.json``) with its ``config.json``, and writes
``reference.npz`` with:

* ``input_ids``   int32[2, 24]  fixed token ids
* ``logits``      f32[2, 24, vocab] fp32 eager-attention logits
* ``hidden_0``    f32[2, 24, dim]   embedding output (input to layer 0)
* ``layer_0_out`` f32[2, 24, dim]   output of decoder layer 0 (before any final norm)

All files together stay well under 1 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 1234
BATCH, SEQ = 2, 24

HF_CONFIG = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.05,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "models", "data",
                                                  "hf_tiny_llama"))
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.remove(os.path.join(out, f))

    torch.manual_seed(SEED)
    cfg = LlamaConfig(rope_parameters=dict(ROPE), **HF_CONFIG)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    # RMSNorm weights are initialised to ones; randomise them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))

    gen = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    with torch.no_grad():
        res = model(input_ids=ids, output_hidden_states=True)
    logits = res.logits.float().numpy()
    hidden = [h.float().numpy() for h in res.hidden_states]
    if len(hidden) != cfg.num_hidden_layers + 1:
        raise RuntimeError(f"expected {cfg.num_hidden_layers + 1} hidden states, got {len(hidden)}")

    model.save_pretrained(out, safe_serialization=True, max_shard_size="200KB")
    if not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        raise RuntimeError("save_pretrained did not shard the checkpoint; lower max_shard_size")
    np.savez_compressed(
        os.path.join(out, "reference.npz"),
        input_ids=ids.numpy().astype(np.int32),
        logits=logits.astype(np.float32),
        hidden_0=hidden[0].astype(np.float32),
        layer_0_out=hidden[1].astype(np.float32),
    )
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__,
                   "python": sys.version.split()[0]}, f, indent=1)
    total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {sorted(os.listdir(out))} to {out} ({total / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
