"""Paths as logs and recorded files show them: relative to the working directory when inside it
(runs start from the repository or the user's job folder), else as given, so that committed
logs and profile headers hold no absolute path of the machine that made them."""
from __future__ import annotations

import os


def shown(path) -> str:
    """``path`` relative to the working directory when it lies below it, else unchanged."""
    p = os.fspath(path)
    if not os.path.isabs(p):
        return p
    rel = os.path.relpath(p)
    return p if rel == ".." or rel.startswith(".." + os.sep) else rel


def recorded(path) -> str:
    """``path`` as a file records it: :func:`shown`, and a path outside the working directory as
    ``.../NAME`` (where it lay on the machine that ran is no one else's business)."""
    p = shown(path)
    return os.path.join("...", os.path.basename(p.rstrip(os.sep))) if os.path.isabs(p) else p


def shown_argv(argv) -> str:
    """A command line as a file records it: each absolute path argument :func:`recorded`
    (``--flag=/abs`` too)."""
    out = []
    for a in argv:
        flag, eq, value = a.partition("=") if a.startswith("--") else ("", "", a)
        out.append(f"{flag}={recorded(value)}" if eq and os.path.isabs(value)
                   else recorded(a) if os.path.isabs(a) else a)
    return " ".join(out)


def writable_dir(path, what: str) -> str:
    """Create the folder ``path`` (and its parents) and check that a file can be written in it,
    before any long work; a :class:`~megatron_paradyse.errors.UserError` naming ``what`` (the
    flag) otherwise."""
    from .errors import UserError

    p = os.fspath(path)
    try:
        os.makedirs(p, exist_ok=True)
        probe = os.path.join(p, f".paradyse_write_check.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(f"{what} {shown(p)}: cannot write there ({e.strerror or e})") from None
    return p


def writable_file(path, what: str) -> str:
    """The folder of the output file ``path`` created and checked (:func:`writable_dir`), and
    ``path`` not an existing folder."""
    from .errors import UserError

    p = os.fspath(path)
    if os.path.isdir(p):
        raise UserError(f"{what} {shown(p)} is a folder: give a file name")
    writable_dir(os.path.dirname(p) or ".", what)
    return p
