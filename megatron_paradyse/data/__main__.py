"""``python -m megatron_paradyse.data {preprocess,corpus,stats}``.

* ``preprocess --input DIR|FILE.jsonl|FILE --output-prefix PREFIX [--tokenizer byte|DIR]``:
  text -> megatron-core ``PREFIX.bin`` / ``PREFIX.idx`` (+ ``.meta.json``, ``.lengths.png``).
* ``corpus``: build (first use) the default corpus, the standard library's ``.py`` files,
  and print its prefix.
* ``stats PREFIX [--seq-length N]``: documents, tokens, length percentiles, samples after splitting.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .. import logs
from ..errors import ArgumentParser, UserError, command
from .corpus import stdlib_corpus
from .datasets import DocumentDataset
from .preprocess import preprocess


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_paradyse.data", allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("preprocess", help="text files or JSONL -> megatron-core .bin/.idx")
    pp.add_argument("--input", required=True,
                    help="a folder (recursive, sorted; files matching --pattern), a .jsonl file "
                         "(one document per line) or one text file")
    pp.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, "
                    "PREFIX.meta.json and PREFIX.lengths.png")
    pp.add_argument("--tokenizer", default="byte",
                    help="'byte' (default: UTF-8 bytes, EOD 256, vocab 258) or a megatron-core "
                         "tokenizer directory (MegatronTokenizer.from_pretrained)")
    pp.add_argument("--pattern", action="append", default=None,
                    help="file-name glob for folder input (repeatable; default *.txt)")
    pp.add_argument("--exclude-dir", action="append", default=[], help="folder names to skip (repeatable)")
    pp.add_argument("--json-key", default="text", help="the JSONL field holding the text")
    pp.add_argument("--no-append-eod", action="store_true", help="do not end documents with EOD")
    pp.add_argument("--no-histogram", action="store_true", help="skip PREFIX.lengths.png")
    pc = sub.add_parser("corpus", help="build (first use) the stdlib corpus and print its prefix")
    pc.add_argument("--cache-dir", default=None)
    ps = sub.add_parser("stats", help="length statistics of a preprocessed dataset")
    ps.add_argument("prefix")
    ps.add_argument("--seq-length", type=int, default=None)
    return p


@command("python -m megatron_paradyse.data")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(stream="stderr" if args.cmd == "corpus" else "stdout")  # corpus: stdout is the prefix
    try:
        if args.cmd == "preprocess":
            preprocess(args.input, args.output_prefix, tokenizer=args.tokenizer,
                       patterns=tuple(args.pattern or ("*.txt",)), exclude_dirs=tuple(args.exclude_dir),
                       json_key=args.json_key, append_eod=not args.no_append_eod,
                       histogram=not args.no_histogram)
        elif args.cmd == "corpus":
            print(stdlib_corpus(args.cache_dir))
        elif args.cmd == "stats":
            ds = DocumentDataset(args.prefix, 1 << 62, shuffle=False, long_docs="split")
            docs = np.asarray(ds.sample_lengths()) + 1
            print(f"{args.prefix}: {ds.num_documents} documents, {int(docs.sum()):,} tokens")
            for q in (0, 10, 50, 90, 99, 100):
                print(f"  p{q:<3d} {np.percentile(docs, q):12,.0f} tokens")
            if args.seq_length:
                lens = DocumentDataset(args.prefix, args.seq_length, shuffle=False,
                                       long_docs="split").sample_lengths()
                print(f"  split at --seq-length {args.seq_length}: {len(lens)} samples, "
                      f"{int((lens == args.seq_length).sum())} of full length")
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
