"""Tokenizers: any Hugging Face ``tokenizer.json``, or a byte-level BPE trained here.

Both are `tokenizers.Tokenizer` objects wrapped in `TextTokenizer`, which knows
the end-of-document (EOS) id and, optionally, a BOS id.

The trained BPE is deterministic (tested across processes): documents are fed
in file order, the byte alphabet is fixed, there is no continuing-subword prefix
(the part of the HF trainer known to depend on hash-map order), and the only
special token is ``<|endoftext|>`` (id 0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BPE_EOS = "<|endoftext|>"
KNOWN_EOS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "<|eot_id|>")
KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>")


class TokenizerError(ValueError):
    """A tokenizer file or token name problem."""


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus its EOS/BOS ids.

    Attributes:
      vocab_size: int, number of ids (max id + 1, specials included).
      eos_id: int, appended after every document.
      bos_id: int | None, put before every document when `add_bos`.
    """

    def __init__(self, tok: Tokenizer, *, eos_token: str | None = None, add_bos: bool = False):
        self.tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.eos_token, self.eos_id = _find_special(tok, eos_token, KNOWN_EOS, "EOS", "eos_token")
        self.bos_id: int | None = None
        if add_bos:
            _, self.bos_id = _find_special(tok, None, KNOWN_BOS, "BOS", "add_bos")

    def encode_documents(self, docs: Sequence[str]) -> list[np.ndarray]:
        """Encode documents (no special tokens added by the tokenizer), each followed by EOS.

        Returns a list of uint32 arrays, one per document.
        """
        encs = self.tok.encode_batch(list(docs), add_special_tokens=False)
        out = []
        for e in encs:
            ids = e.ids
            parts = ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]
            out.append(np.asarray(parts, dtype=np.uint32))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def sha256(self) -> str:
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()


def _find_special(tok: Tokenizer, name: str | None, known: Sequence[str], what: str,
                  arg: str) -> tuple[str, int]:
    vocab = tok.get_vocab(with_added_tokens=True)
    if name is not None:
        if name not in vocab:
            raise TokenizerError(f"{arg}: token {name!r} is not in the tokenizer's vocabulary")
        return name, int(vocab[name])
    for cand in known:
        if cand in vocab:
            return cand, int(vocab[cand])
    raise TokenizerError(
        f"cannot find a {what} token in the tokenizer (tried {', '.join(known)}); "
        f"set data.{arg if arg != 'add_bos' else 'add_bos: false'}"
        + (" to the token to use" if arg == "eos_token" else ""))


def load_hf(path: str | Path, *, eos_token: str | None = None,
            add_bos: bool = False) -> TextTokenizer:
    """Load a Hugging Face ``tokenizer.json`` (e.g. the Llama 3.1 tokenizer)."""
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"tokenizer file not found: {p}")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 (tokenizers raises bare Exception)
        raise TokenizerError(f"{p}: not a valid tokenizer.json ({e})") from None
    return TextTokenizer(tok, eos_token=eos_token, add_bos=add_bos)


def train_bpe(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on `docs` (in the given order).

    Args:
      docs: document texts.
      vocab_size: total vocabulary size including the 256 byte symbols and the
        single special token ``<|endoftext|>`` (id 0).
    Returns:
      a `tokenizers.Tokenizer` with a ByteLevel pre-tokenizer and decoder.
    """
    if vocab_size < 257:
        raise TokenizerError(f"vocab_size must be >= 257 for a byte-level BPE, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok
