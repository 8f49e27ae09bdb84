"""``docs/`` holds only the docs: markdown pages and the images they embed, no run folders, logs
or JSON (measured runs live under ``results/``, indexed by ``results/README.md``). A doc says
what holds now, with the command that shows it: its text carries no dates or run times, no
commit hashes and no issue numbers; that history lives in git and in ``results/``.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
IMAGES = (".png", ".svg", ".jpg", ".jpeg", ".gif")

DATE = re.compile(r"\b(?:19|20)\d{2}-\d{2}-\d{2}\b|\bUTC\b|\b(?:January|February|March|April|May|June|July|"
                  r"August|September|October|November|December) (?:\d{1,2}, )?(?:19|20)\d{2}\b")
HASH = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
ISSUE = re.compile(r"(?<![\w/&])#\d+\b|\b[Ii]ssues? \d+\b|\b(?:PR|[Pp]ull request) \d+\b|\bs\d{2}\b")


def offences(text: str) -> list:
    """``(kind, match)`` for every date, commit hash or issue number in ``text``."""
    out = []
    for kind, rx in (("date", DATE), ("hash", HASH), ("issue", ISSUE)):
        out += [(kind, m.group(0)) for m in rx.finditer(text)]
    return out


def test_the_patterns_catch_what_they_should():
    bad = ("From the run of 2026-11-25 23:39 UTC", "the plugin at `2ed3462`", "after #37", "issue 44",
           "logs in gpu/h200/s37/", "fixed in 221f66a, which", "(November 2026)")
    assert all(offences(t) for t in bad), [t for t in bad if not offences(t)]
    good = ("1.37x the tokens/s of `ulysses+rc`", "fp32 grad <= 3.2e-06", "[x](#the-demo)", "1048576 bytes",
            "PP = 2 x p = 2, 28.5 MiB", "&#8203;", "megatron-core 0.16.1", "a decade of defaced beef")
    assert not any(offences(t) for t in good), [(t, offences(t)) for t in good if offences(t)]


def test_docs_holds_only_docs():
    pages = sorted(DOCS.glob("*.md"))
    assert len(pages) > 10
    embedded = set()
    for page in pages:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            embedded.add((page.parent / target.split("#")[0]).resolve())
    stray = []
    for path in sorted(DOCS.rglob("*")):
        if path.is_dir():
            stray.append(f"{path.relative_to(ROOT)}/ (a folder: runs go under results/)")
        elif path.suffix == ".md":
            continue
        elif path.suffix.lower() in IMAGES and path.resolve() in embedded:
            continue
        else:
            stray.append(f"{path.relative_to(ROOT)} (not a doc or an image a doc embeds: results/?)")
    assert not stray, "\n".join(stray)


def test_docs_state_what_holds_without_dates_hashes_or_issue_numbers():
    bad = []
    for page in sorted(DOCS.glob("*.md")):
        for n, line in enumerate(page.read_text().splitlines(), 1):
            bad += [f"{page.relative_to(ROOT)}:{n}: {kind} {hit!r}" for kind, hit in offences(line)]
    assert not bad, "\n".join(bad)
