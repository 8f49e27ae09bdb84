"""Fit the analytic model's transient coefficients to the tracker:
``python -m megatron_paradyse.costmodel.transient -o configs/transient.json``.

A layer's transient (its peak above its saved bytes, one tracker over forward and backward)
mixes gathered weights, communication slots, recomputed activations and the gradients made
while the saved tensors are being freed, so the analytic model does not derive it: per
strategy it is the larger of (at most) two phases, each a non-negative sum of the memory basis
(``analytic.basis``): which part of the layer peaks (score rows, the MLP, gathered weights)
changes with the shape and length. The coefficients are fitted here by alternating
non-negative least squares to the live-bytes tracker's measurement of one
layer, over six shapes (MHA / GQA, GELU / SwiGLU, bias or not; the last is the small GQA
shape of ``tests/test_costmodel_analytic.py``, which measures it at s = 96, not sampled here),
p = 2 and 4, s = 128, 256, 512 and b = 1, 2. Each sample is weighted by the 4-layer stack's peak (4 x saved + transient),
the quantity a memory budget sees. Score-row terms (quadratic in s) are offered to
``colossal`` only.

One spawned world of 4 gloo ranks measures p = 4, then p = 2 as two TP groups; the largest
rank's bytes are fitted. Cost: about six minutes on two CPU cores. ``--measurements F``
keeps the measurements (and ``--refit`` fits them again without measuring).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from ..errors import UserError
from .. import logs
from . import analytic
from . import measure as M
from .fit import _nnls
from .ranks import run_ranks
from .shape import ModelShape

STRATS = ("tp_sp", "ulysses", "ring", "colossal", "metp")
SEQS = (128, 256, 512)
BATCHES = (1, 2)
ROW_TERMS = ("rows", "rows32")
SKIP_TERMS = ("t*h*nobias",)


def shapes(p):
    base = dict(num_layers=1, vocab=512, dtype="fp32")
    return [
        dict(base, hidden=128, heads=8, query_groups=8, ffn=512, swiglu=False, bias=True),
        dict(base, hidden=128, heads=8, query_groups=p, ffn=352, swiglu=True, bias=False),
        dict(base, hidden=256, heads=8, query_groups=8, ffn=1024, swiglu=False, bias=True),
        dict(base, hidden=64, heads=4, query_groups=p, ffn=256, swiglu=True, bias=True),
        dict(base, hidden=192, heads=12, query_groups=4, ffn=512, swiglu=False, bias=False),
        dict(base, hidden=64, heads=4, query_groups=p, ffn=160, swiglu=True, bias=False),
    ]


def _world(rank, world):
    out = []
    for p in (4, 2):
        for i, sd in enumerate(shapes(p)):
            shape = ModelShape(**sd, p=p)
            _, model = M.build(shape, num_layers=1, max_seq=max(SEQS))
            runner = M.LayerRunner(model, shape)
            for st in STRATS:
                M.set_strategy(model, st)
                for s in SEQS:
                    for b in BATCHES:
                        out.append({"p": p, "shape": i, "strategy": st, "s": s, "b": b,
                                    "layer": runner.memory("layer", s, b)})
    return out


def measure(timeout=900):
    per_rank = run_ranks(_world, 4, timeout=timeout)
    rows = []
    for i, row in enumerate(per_rank[0]):
        m = dict(row)
        m["layer"] = [max(r[i]["layer"][k] for r in per_rank) for k in (0, 1)]
        rows.append(m)
    return rows


def fit_phases(X, y, w, inits=(), iters=30):
    """Coefficients of ``max(X @ c1, X @ c2)`` (two phases, e.g. score rows vs the MLP) by
    alternating non-negative least squares: each sample goes to the phase that predicts it
    larger, each phase is refitted on its samples, from a few starting splits (``inits``: boolean masks;
    always the samples above the median of measured / one-phase prediction). Returns the phases
    and the weighted RSS; a single phase when a second does not help."""
    one = _nnls(X, y, w)
    best = ([one], float(np.sum(((X @ one - y) * w) ** 2)))
    ratio = y / np.maximum(X @ one, 1e-30)
    for assign in (ratio > np.median(ratio), *inits):
        for _ in range(iters):
            if assign.all() or not assign.any():
                break
            cs = [_nnls(X[~assign], y[~assign], w[~assign]), _nnls(X[assign], y[assign], w[assign])]
            pred = np.maximum(X @ cs[0], X @ cs[1])
            rss = float(np.sum(((pred - y) * w) ** 2))
            if rss < best[1] * (1 - 1e-9):
                best = (cs, rss)
            new = (X @ cs[1]) > (X @ cs[0])
            if (new == assign).all():
                break
            assign = new
    return best


def fit(rows) -> dict:
    """``{strategy: [phase, ...]}``, each phase ``{basis term: coefficient}``."""
    table = {}
    for st in STRATS:
        sel = [r for r in rows if r["strategy"] == st]
        bases, weights = [], []
        for r in sel:
            shape = ModelShape(**shapes(r["p"])[r["shape"]], p=r["p"])
            B = analytic.basis(shape, r["s"], r["b"])
            saved = sum(c * B[k] for k, c in analytic.SAVED[st].items())
            bases.append(B)
            weights.append(1.0 / (4 * saved + r["layer"][1]))
        terms = [k for k in bases[0] if k not in SKIP_TERMS and (st == "colossal" or k not in ROW_TERMS)]
        X = np.array([[B[k] for k in terms] for B in bases])
        y = np.array([r["layer"][1] for r in sel], float)
        s = np.array([r["s"] for r in sel])
        phases, _ = fit_phases(X, y, np.array(weights), inits=[s == s.max()])
        table[st] = [{k: round(float(v), 4) for k, v in zip(terms, c) if round(float(v), 4) > 0} for c in phases]
    return table


def check(rows, table) -> list:
    """Per strategy: the worst error of the 4-layer stack's peak and of the layer's transient."""
    out = []
    for st in STRATS:
        e_stack = e_trans = 0.0
        for r in (r for r in rows if r["strategy"] == st):
            shape = ModelShape(**shapes(r["p"])[r["shape"]], p=r["p"])
            B = analytic.basis(shape, r["s"], r["b"])
            pt = max(sum(c * B[k] for k, c in ph.items()) for ph in table[st])
            saved, trans = r["layer"]
            e_stack = max(e_stack, abs(4 * saved + pt - 4 * saved - trans) / (4 * saved + trans))
            e_trans = max(e_trans, abs(pt - trans) / trans if trans else 0.0)
        out.append((st, e_stack, e_trans))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m megatron_paradyse.costmodel.transient",
                                 description="Fit the analytic model's transient coefficients to the tracker.")
    ap.add_argument("-o", "--output", default=os.path.join(os.path.dirname(__file__), "configs", "transient.json"))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--measurements", default=None, help="write the measurements here (JSON)")
    ap.add_argument("--refit", action="store_true", help="fit the --measurements file again, measure nothing")
    args = ap.parse_args(argv)
    logs.setup(stream="stderr")  # the ranks' warnings; the results go to stdout
    if args.refit:
        if not args.measurements:
            raise UserError("--refit needs --measurements FILE")
        with open(args.measurements) as f:
            rows = json.load(f)
    else:
        rows = measure(args.timeout)
        if args.measurements:
            with open(args.measurements, "w") as f:
                json.dump(rows, f)
    table = fit(rows)
    for st, e_stack, e_trans in check(rows, table):
        print(f"{st:9s} worst 4-layer peak error {e_stack:6.2%}, worst layer transient error {e_trans:6.2%}")
    doc = {"about": "analytic transient coefficients per strategy and phase (bytes per basis term); "
                    "written by python -m megatron_paradyse.costmodel.transient",
           "samples": {"shapes": {p: shapes(p) for p in (2, 4)}, "s": list(SEQS), "b": list(BATCHES)},
           "transient": table}
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
