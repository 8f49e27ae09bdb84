"""The folder layout and its atomic steps: ``iter_N.tmp`` prepared, renamed to ``iter_N``, then
the tracker replaced through a temporary file; each step fsynced (rank 0's work)."""
from __future__ import annotations

import os
import shutil

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    """``ROOT/iter_NNNNNNN``, Megatron-LM's folder name."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The last complete iteration under ``root``, or None if there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("utf-8", "replace").strip()
    if text == "release":
        raise ValueError(f"{path}: 'release' checkpoints are not supported; give an iteration")
    if not text.isdigit():
        shown = repr(text[:20]) if text else "nothing (the file is empty)"
        raise ValueError(f"the tracker {path} should hold the last complete iteration, a number, "
                         f"but holds {shown}; give --ckpt-step N to load iter_N, or fix the file")
    return int(text)


def fsync_dir(path: str) -> None:
    """Make a folder's entries (a rename, a new file) durable; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare(root: str, tmp: str) -> None:
    """Rank 0: a fresh ``tmp`` folder, leftovers of interrupted saves removed."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # leftovers of interrupted saves
        if name.startswith("iter_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    os.makedirs(tmp)


def publish(root: str, tmp: str, final: str, iteration: int) -> None:
    """Rank 0: ``iter_N.tmp`` -> ``iter_N``, then the tracker (each step atomic)."""
    if os.path.exists(final):  # re-saving an iteration: swap the old one out
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    write_file_atomically(os.path.join(root, TRACKER), str(iteration))
    fsync_dir(root)


def write_file_atomically(path: str, text: str) -> None:
    """``path`` holds ``text`` whole or keeps its old content (a temporary file, fsync, ``os.replace``)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
