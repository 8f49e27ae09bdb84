"""The manifest: every file's size and crc32, written last into a checkpoint and checked on
load (each rank a share of the files)."""
from __future__ import annotations

import json
import os
import zlib

import torch.distributed as dist

from .atomic import fsync_dir, write_file_atomically

MANIFEST = "paradyse_manifest.json"
_CHUNK = 16 << 20


def file_digest(path: str, fsync: bool = False) -> dict:
    """``{"size": bytes, "crc32": int}`` of a file (read in 16 MiB chunks)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
        if fsync:
            os.fsync(f.fileno())
    return {"size": size, "crc32": crc}


def _own_files(folder: str, rank: int) -> list:
    """The shard files this rank wrote (torch_dist names them ``__{rank}_{n}.distcp``)."""
    prefix = f"__{rank}_"
    return sorted(n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".distcp"))


def digest_own_files(folder: str) -> tuple:
    """(entries, error): digests of this rank's shards, each fsynced by its writer."""
    try:
        return {n: file_digest(os.path.join(folder, n), fsync=True)
                for n in _own_files(folder, dist.get_rank())}, None
    except Exception as e:  # noqa: BLE001 - agreed on collectively
        return {}, f"{type(e).__name__}: {e}"


def write_manifest(folder: str, iteration: int, digests: list) -> None:
    """Rank 0: ``MANIFEST`` in ``folder``, every file's size and crc32 (the ranks' ``digests`` of
    their shards, read back by them; the rest here), written atomically and fsynced."""
    files, errors = {}, []
    for r, (entries, error) in enumerate(digests):
        if error:
            errors.append(f"rank {r}: {error}")
        files.update(entries)
    if errors:
        raise OSError("reading back the written shards failed: " + "; ".join(errors))
    for dirpath, _, names in os.walk(folder):  # common.pt, metadata.json, .metadata, anything else
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if rel not in files and rel != MANIFEST:
                files[rel] = file_digest(os.path.join(dirpath, name), fsync=True)
    write_file_atomically(os.path.join(folder, MANIFEST),
                          json.dumps({"format": 1, "iteration": int(iteration), "files": files},
                                     indent=1, sort_keys=True))
    fsync_dir(folder)


def read_manifest(folder: str) -> dict | None:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        manifest = json.load(f)
    if not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path}: not a ParaDySe checkpoint manifest")
    return manifest


def check_files(folder: str, manifest: dict, names=None) -> list:
    """Problems (one line each, naming the file) of ``names`` (default: all) against the manifest."""
    problems = []
    for name in sorted(manifest["files"]) if names is None else names:
        want = manifest["files"][name]
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing (the manifest lists {want['size']} bytes)")
            continue
        size = os.path.getsize(path)
        if size != want["size"]:
            problems.append(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)")
            continue
        if file_digest(path)["crc32"] != want["crc32"]:
            problems.append(f"{path}: checksum mismatch (crc32 differs from the manifest; corrupted)")
    return problems
