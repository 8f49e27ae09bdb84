"""The embedded default corpus: the Python standard library's own ``.py`` source files.

Every machine that runs this package has them, so the demo and the benchmark train on real,
long-tailed text with no download: code files from a few hundred bytes to a few hundred
kilobytes (Python 3.11: 674 files, 11.4 MB; median 7.8 KB; the longest is
``pydoc_data/topics.py``, 757 KB), like the GitHub code the paper trains on.

Files are taken from ``sysconfig.get_paths()["stdlib"]`` in sorted path order, without the
``test``/``tests`` folders, ``site-packages`` and ``idlelib`` (tests are half the standard
library and repetitive). They are preprocessed on first use with the byte-level tokenizer
into ``<checkout>/.cache/stdlib_corpus/`` (gitignored; ``$PARADYSE_CACHE`` overrides the
folder); a manifest of the file list and sizes decides whether the cache is current.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig

from .preprocess import preprocess

log = logging.getLogger(__name__)

EXCLUDE_DIRS = ("test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__")
NAME = "stdlib_py"


def default_cache_dir() -> str:
    env = os.environ.get("PARADYSE_CACHE")
    if env:
        return os.path.join(env, "stdlib_corpus")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, ".cache", "stdlib_corpus")


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list:
    """Sorted ``(relative path, size)`` of the corpus's files."""
    root = root or stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDE_DIRS)
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                if os.path.isfile(p):
                    out.append((os.path.relpath(p, root), os.path.getsize(p)))
    return out


def _manifest(root: str) -> dict:
    files = stdlib_files(root)
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]
    return {"root": root, "python": sys.version.split()[0], "files": len(files),
            "bytes": sum(s for _, s in files), "digest": digest, "tokenizer": "byte"}


def stdlib_corpus(cache_dir: str | None = None) -> str:
    """The corpus's ``IndexedDataset`` prefix, preprocessing it first if the cache is missing or stale."""
    cache_dir = cache_dir or default_cache_dir()
    root = stdlib_root()
    prefix = os.path.join(cache_dir, NAME)
    manifest = _manifest(root)
    mpath = os.path.join(cache_dir, "manifest.json")
    try:
        with open(mpath) as fh:
            current = json.load(fh) == manifest
    except (OSError, ValueError):
        current = False
    if current and all(os.path.exists(prefix + s) for s in (".bin", ".idx")):
        return prefix
    if manifest["files"] == 0:
        raise ValueError(f"no .py files under the standard library {root}; give --data-path")
    os.makedirs(cache_dir, exist_ok=True)
    log.info(f"> building the default corpus (the standard library's .py files under {root}) "
             f"into {cache_dir}")
    preprocess(root, prefix, tokenizer="byte", patterns=("*.py",), exclude_dirs=EXCLUDE_DIRS)
    with open(mpath + ".tmp", "w") as fh:
        json.dump(manifest, fh)
    os.replace(mpath + ".tmp", mpath)
    return prefix
