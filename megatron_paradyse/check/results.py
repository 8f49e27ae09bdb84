"""One line of the check's report, the table that prints them, and the JSON that keeps them."""
from __future__ import annotations

import dataclasses
import json

PASS, FAIL, SKIP, INFO = "PASS", "FAIL", "SKIP", "INFO"


@dataclasses.dataclass
class Line:
    """``section``/``name``: what was checked; ``status``: PASS, FAIL, SKIP (with why) or INFO;
    ``detail``: the numbers in words; ``data``: the numbers for the JSON file."""

    section: str
    name: str
    status: str
    detail: str = ""
    data: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def verdict(cls, section, name, ok: bool, detail="", **data) -> "Line":
        return cls(section, name, PASS if ok else FAIL, detail, data)


def table(lines: list) -> str:
    """The lines as a fixed-width table, then a one-line count."""
    w_sec = max([7] + [len(x.section) for x in lines])
    w_name = max([4] + [len(x.name) for x in lines])
    out = [f"{'section':<{w_sec}}  {'check':<{w_name}}  result  detail", "-" * (w_sec + w_name + 24)]
    for x in lines:
        out.append(f"{x.section:<{w_sec}}  {x.name:<{w_name}}  {x.status:<6}  {x.detail}")
    counts = {s: sum(x.status == s for x in lines) for s in (PASS, FAIL, SKIP)}
    out.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    return "\n".join(out)


def failed(lines: list) -> bool:
    return any(x.status == FAIL for x in lines)


def to_json(lines: list, header: dict) -> str:
    return json.dumps({"header": header, "lines": [dataclasses.asdict(x) for x in lines]}, indent=1,
                      default=str)


def from_json(text: str) -> tuple:
    d = json.loads(text)
    return d.get("header", {}), [Line(**x) for x in d.get("lines", [])]
