"""Text -> megatron-core ``IndexedDataset`` (``PREFIX.bin`` / ``PREFIX.idx``), one document per sample.

Inputs: a folder of text files (recursive, sorted, filtered by glob patterns), a JSONL file
(one document per line, the text under ``--json-key``), or a single text file (one document).
Each document is tokenized (byte-level by default, see :mod:`.tokenizers`), an end-of-document
token is appended (``--no-append-eod`` to skip), and it is written as one sequence and one
document of megatron-core's format, readable by Megatron-LM's ``GPTDataset`` and by
:class:`~megatron_paradyse.data.DocumentDataset`. Beside the pair:

* ``PREFIX.meta.json``: the tokenizer (name, vocab size, EOD, PAD), the source, each
  document's name (file path or JSONL line) and length: warnings about documents name them;
* ``PREFIX.lengths.png``: a histogram of the document lengths (log x), when matplotlib is there.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import time

import numpy as np
import torch

from .tokenizers import build_tokenizer

log = logging.getLogger(__name__)

META_SUFFIX = ".meta.json"
HIST_SUFFIX = ".lengths.png"


def _iter_folder(root: str, patterns, exclude_dirs):
    """``(name, bytes)`` of every file under ``root`` matching a pattern, in sorted path order."""
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in exclude_dirs)
        for f in sorted(files):
            if any(fnmatch.fnmatch(f, p) for p in patterns):
                path = os.path.join(d, f)
                if os.path.isfile(path):
                    with open(path, "rb") as fh:
                        yield os.path.relpath(path, root), fh.read()


def _iter_jsonl(path: str, key: str):
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
            if not isinstance(obj, dict) or key not in obj:
                raise ValueError(f"{path}:{n}: no {key!r} field (give --json-key)")
            text = obj[key]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{n}: field {key!r} is {type(text).__name__}, not a string")
            yield f"{os.path.basename(path)}:{n}", text.encode("utf-8")


def iter_documents(source: str, patterns=("*.txt",), exclude_dirs=(), json_key: str = "text"):
    """``(name, raw bytes)`` of each document of ``source`` (folder, ``.jsonl`` file or text file)."""
    if os.path.isdir(source):
        yield from _iter_folder(source, tuple(patterns), set(exclude_dirs))
    elif os.path.isfile(source):
        if source.endswith((".jsonl", ".json", ".jsonl.txt")):
            yield from _iter_jsonl(source, json_key)
        else:
            with open(source, "rb") as fh:
                yield os.path.basename(source), fh.read()
    else:
        raise FileNotFoundError(f"{source}: no such file or folder")


def preprocess(source: str, output_prefix: str, tokenizer: str = "byte", patterns=("*.txt",),
               exclude_dirs=(), json_key: str = "text", append_eod: bool = True,
               histogram: bool = True, documents=None) -> dict:
    """Tokenize ``source`` into ``output_prefix.bin`` / ``.idx`` (+ ``.meta.json``, ``.lengths.png``).

    ``documents`` (an iterable of ``(name, bytes)``) replaces reading ``source``. Returns the
    metadata written to ``.meta.json``. Raises ``ValueError`` if no non-empty document is found.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    t0 = time.perf_counter()
    tok = build_tokenizer(tokenizer)
    if documents is None:
        documents = iter_documents(source, patterns, exclude_dirs, json_key)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=DType.optimal_dtype(tok.vocab_size))
    names, lengths, empty = [], [], 0
    for name, raw in documents:
        ids = tok.tokenize_bytes(raw)
        if len(ids) == 0:
            empty += 1
            continue
        if append_eod and tok.eod is not None:
            ids = np.concatenate([ids, [tok.eod]])
        builder.add_item(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)))
        builder.end_document()
        names.append(name)
        lengths.append(int(len(ids)))
    if not lengths:
        builder.finalize(get_idx_path(tmp_prefix))
        for suffix in (".bin", ".idx"):
            if os.path.exists(tmp_prefix + suffix):
                os.remove(tmp_prefix + suffix)
        raise ValueError(f"{source}: no non-empty document found (patterns {list(patterns)}, "
                         f"{empty} empty); nothing to preprocess")
    builder.finalize(get_idx_path(tmp_prefix))
    for suffix in (".bin", ".idx"):  # atomic: a reader never sees a half-written pair
        os.replace(tmp_prefix + suffix, output_prefix + suffix)
    lens = np.asarray(lengths)
    meta = dict(tok.describe(), source=os.path.abspath(source) if source else None,
                append_eod=bool(append_eod), num_documents=len(lengths), num_tokens=int(lens.sum()),
                skipped_empty=empty, min_length=int(lens.min()), median_length=float(np.median(lens)),
                max_length=int(lens.max()), documents=names, lengths=lengths)
    with open(f"{tmp_prefix}{META_SUFFIX}", "w") as fh:
        json.dump(meta, fh)
    os.replace(f"{tmp_prefix}{META_SUFFIX}", output_prefix + META_SUFFIX)
    if histogram:
        plot_length_histogram(lens, output_prefix + HIST_SUFFIX,
                              f"{os.path.basename(output_prefix)}: {len(lens)} documents, "
                              f"{int(lens.sum()):,} tokens ({tok.name})")
    log.info(f"> preprocessed {len(lengths)} documents ({int(lens.sum()):,} tokens, lengths "
             f"{int(lens.min())} .. median {int(np.median(lens))} .. {int(lens.max())}) from {source} "
             f"into {output_prefix}.bin/.idx in {time.perf_counter() - t0:.1f} s")
    return meta


def read_meta(prefix: str) -> dict | None:
    """``PREFIX.meta.json`` if preprocessing wrote one."""
    path = prefix + META_SUFFIX
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def plot_length_histogram(lengths, path: str, title: str = "") -> str | None:
    """A histogram of ``lengths`` (log-spaced bins, log x) saved as ``path``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info(f"  (matplotlib is not installed: no histogram {path})")
        return None
    lens = np.asarray(lengths, dtype=np.float64)
    lens = lens[lens > 0]
    lo, hi = max(1.0, lens.min()), max(2.0, lens.max())
    bins = np.logspace(np.log10(lo), np.log10(hi * 1.0001), 40)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lens, bins=bins, color="#4477aa", edgecolor="white")
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    for q, style in ((50, "--"), (90, ":"), (99, "-.")):
        v = np.percentile(lens, q)
        ax.axvline(v, color="k", linestyle=style, linewidth=1, label=f"p{q} = {v:,.0f}")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
