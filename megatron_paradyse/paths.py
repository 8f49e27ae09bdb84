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
