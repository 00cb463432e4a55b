"""Command line: ``python -m train.data prepare --config configs/tiny.yaml``, ``info DIR``, or
``tokenizer --source FILES --vocab-size N --out PATH/tokenizer.json`` (a BPE trained on your
text, for ``data.tokenizer``: `train.data.own_tokenizer`).

Exit codes: 0 done, 2 a configuration or data error, 6 a file could not be written or read
(a read-only or full cache directory), as for ``python -m train``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import train.data
from train import config as cfgmod
from train.config import ConfigError, DataSection
from train.data.cache import open_prepared, prepare
from train.data.own_tokenizer import write_tokenizer
from train.data.sources import DataError
from train.data.tokenizer import TokenizerError


def _spec_from_args(args: argparse.Namespace) -> DataSection:
    sets = list(args.set or [])
    flag_map = {"source": "sources", "val_source": "val_sources", "format": "format",
                "text_key": "text_key", "split": "split", "tokenizer": "tokenizer",
                "vocab_size": "vocab_size", "eos_token": "eos_token", "cache_dir": "cache_dir",
                "max_docs": "max_docs", "holdout_every": "holdout_every",
                "holdout_block": "holdout_block"}
    raw = cfgmod.read_yaml(args.config) if args.config else {}
    raw = cfgmod.apply_overrides(raw, sets)
    data = dict(raw.get("data") or {})
    for flag, key in flag_map.items():
        v = getattr(args, flag)
        if v is not None:
            data[key] = v
    if args.add_bos:
        data["add_bos"] = True
    raw["data"] = data
    return cfgmod.from_dict(raw).data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.data", description=train.data.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize sources into a cached prepared directory")
    p.add_argument("--config", help="take the data section from this training config")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="config override, e.g. data.vocab_size=4096 (repeatable)")
    p.add_argument("--source", action="append", help="training file or glob (repeatable)")
    p.add_argument("--val-source", action="append", help="validation file or glob (repeatable)")
    p.add_argument("--format", choices=["auto", "text", "jsonl"])
    p.add_argument("--text-key", help="JSON field with the text (default 'text')")
    p.add_argument("--split", choices=["paragraph", "file"], help="plain-text document split")
    p.add_argument("--tokenizer", help="'bpe' or a path to tokenizer.json")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size")
    p.add_argument("--eos-token", help="end-of-document token name")
    p.add_argument("--add-bos", action="store_true", help="put BOS before each document")
    p.add_argument("--cache-dir", help="cache directory (default data_cache)")
    p.add_argument("--max-docs", type=int, help="read at most this many documents")
    p.add_argument("--holdout-every", type=int)
    p.add_argument("--holdout-block", type=int)
    q = sub.add_parser("info", help="print a prepared directory's metadata and a sample")
    q.add_argument("dir")
    t = sub.add_parser("tokenizer", help="train a byte-level BPE on your text and write it as "
                       "a tokenizer.json (for data.tokenizer, e.g. under data.loader: grain)")
    t.add_argument("--source", action="append", required=True,
                   help="text, JSON lines or parquet file, or a glob (repeatable)")
    t.add_argument("--out", required=True, help="the tokenizer.json to write")
    t.add_argument("--vocab-size", type=int, required=True,
                   help="ids in all (>= 257: 256 bytes and <|endoftext|>)")
    t.add_argument("--format", choices=["auto", "text", "jsonl"], default="auto")
    t.add_argument("--text-key", default="text", help="JSON/parquet field with the text")
    t.add_argument("--split", choices=["paragraph", "file"], default="paragraph",
                   help="plain text: one document per paragraph or per file")
    t.add_argument("--max-docs", type=int, help="train on at most this many documents")
    t.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            prep = prepare(_spec_from_args(args))
            print(prep.path)
        elif args.cmd == "tokenizer":
            made = write_tokenizer(args.source, args.out, vocab_size=args.vocab_size,
                                   fmt=args.format, text_key=args.text_key, split=args.split,
                                   max_docs=args.max_docs, force=args.force)
            print(f"wrote {made.path}: {made.vocab_size} ids, trained on {made.documents} "
                  f"documents of {made.files} file(s); end of document {made.eos_token!r}. "
                  f"Use it: --set data.tokenizer={made.path}")
        else:
            prep = open_prepared(args.dir)
            meta = {k: v for k, v in prep.meta.items() if k != "fingerprint"}
            print(json.dumps(meta, indent=1))
            toks = prep.tokens("train")
            print("sample:", repr(prep.tokenizer().decode(toks[:64])))
    except (ConfigError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only or full cache, a failing disk: the message names the file
        print(f"I/O error: {e}", file=sys.stderr)
        return 6
    return 0


if __name__ == "__main__":
    sys.exit(main())
