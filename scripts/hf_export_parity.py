"""Compare an HF directory written by ``python -m train export-hf`` with transformers.

Two halves, run in two environments (the project's venv has no torch)::

    # 1. the project's venv: our logits on a fixed text, tokenized with the export's tokenizer
    PYTHONPATH=. .venv/bin/python scripts/hf_export_parity.py ours hf/tiny /tmp/ours.npz
    # 2. a venv with torch + transformers (e.g. the one of scripts/make_hf_fixture.py)
    /tmp/torchvenv/bin/python scripts/hf_export_parity.py theirs hf/tiny /tmp/ours.npz

The second prints whether transformers' tokenizer gives the same ids, the largest
|logits difference| of ``LlamaForCausalLM`` (fp32, eager attention), and every warning
transformers logged while loading (none expected).
"""

from __future__ import annotations

import io
import logging
import sys

import numpy as np

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.")


def ours(hf_dir: str, npz: str) -> None:
    import jax.numpy as jnp

    from models import hf
    from train.data.tokenizer import load_hf as load_tokenizer

    model, layout = hf.load_hf(hf_dir)
    tok = load_tokenizer(f"{hf_dir}/tokenizer.json")
    ids = np.asarray(tok.tok.encode(TEXT, add_special_tokens=False).ids, np.int64)[None]
    logits = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    np.savez(npz, ids=ids, logits=logits)
    print(f"{layout}; {ids.shape[1]} tokens; logits {logits.shape} -> {npz}")


def theirs(hf_dir: str, npz: str) -> None:
    import torch
    import transformers

    buf = io.StringIO()
    transformers.logging.get_logger().addHandler(logging.StreamHandler(buf))
    transformers.logging.set_verbosity_warning()
    ref = np.load(npz)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager")
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"tokenizer ids equal: {ids == ref['ids'][0].tolist()} (eos {tok.eos_token!r})")
    with torch.no_grad():
        out = model(torch.tensor(ref["ids"])).logits.numpy()
    print(f"max |logits - ours| = {float(np.abs(out - ref['logits']).max()):.3g} "
          f"(max |logits| {float(np.abs(out).max()):.3g})")
    print(f"transformers warnings: {buf.getvalue().strip() or 'none'}")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("ours", "theirs"):
        sys.exit(__doc__)
    {"ours": ours, "theirs": theirs}[sys.argv[1]](sys.argv[2], sys.argv[3])
