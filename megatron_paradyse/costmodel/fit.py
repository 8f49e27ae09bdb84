"""Fit the cost model to a profile: ``python -m megatron_paradyse.costmodel fit PROFILE -o MODEL``.

Per strategy and target (layer seconds, saved bytes, transient bytes), see ``fitted.py`` for
how a prediction is made:

* time physics (default, ``--time-model rates``): the layer's analytic work on the busiest rank
  (``analytic.time_features``: GEMM FLOPs, attention FLOPs, collective wire bytes, one fixed
  cost per layer) times non-negative rates, one non-negative least squares over every
  strategy's profiled times weighted by 1/measured (:func:`fit_time_rates`): one attention rate
  per kernel class (the four flash strategies share one, colossal's score rows their own),
  the others per strategy. s**2 enters only through the attention FLOPs, so the curve's form
  is fixed by what each strategy does, not chosen by the noise. The flash rate is taken from
  the profile's kernel calibration where it has one (:func:`fit_kernel_rates`: the kernel
  alone, ``kernels.py``), the others fitted to what it leaves; ``--attention-rate joint`` fits
  it with them (the earlier way: on this CPU it swung 19-125 GFLOP/s between profiles fitted
  to 2048 tokens); ``--time-model poly`` is the earlier relative least squares on
  ``[1, b*s, b*s^2]`` with the degree chosen by AICc;
* memory physics: the analytic formula's order in s (linear; quadratic for colossal),
  coefficients of either sign fitted to the largest profiled lengths (2, or 3 for quadratic;
  non-negative least squares where that curve is not positive, :func:`fit_memory_physics`);
* time, with ``--xgb``: an XGBoost regressor (``reg:squarederror``, depth 2, 40 rounds,
  shrinkage 0.3) of the residual ratio ``measured / physics - 1`` on ``(s, b, b*s, b*s^2, log s)``. Why a residual:
  on a handful of lengths, trees alone interpolate as a staircase and extrapolate flat; the
  physics curve carries the shape, the trees its systematic wiggles (kernel switches, cache
  effects). No monotone constraint is set on the trees: on a residual ratio it has no
  meaning (the physics curve, non-negative in every coefficient, carries the rise in s).
  Default: off,
  the interpolated residual below instead (chosen on held-out data: on this noisy 2-core CPU
  the trees fit the timing noise of the profiled lengths, made the curve non-monotone in s
  and raised the interpolated held-out error, see docs/costmodel.md);
* time (default) and memory: the residual ratio interpolated piecewise-linearly in log s
  between the profiled lengths, so a prediction passes through the measured medians (for
  time, each inner length's residual is first replaced by the median of it and its two
  neighbours: one noisy length, e.g. tp_sp's 1024 at p = 4, 197 ms against 160 from its
  neighbours, made a planner pick a 63% slower plan there; trees
  turned memory into steps: 18% worst held-out error on ``ulysses``'s transient at p = 4,
  against 5% for the interpolation); beyond the largest length, for time, the correction
  (interpolated or trees) fades linearly in log2 s to none at twice that length
  (``fitted.fade``), for memory the physics curve continues from the measured value there.
"""
from __future__ import annotations

import json
import logging
import math
import os

import numpy as np
from scipy.optimize import nnls

from ..errors import ArgumentParser, UserError, command
from ..paths import writable_file
from . import analytic, kernels
from .fitted import FORMAT, TARGETS, XGB_FEATURES, rates_predict, sha256, time_features, xgb_features
from .profile import ProfileFileError, read_profile
from .shape import ModelShape

log = logging.getLogger(__name__)


def _nnls(X, y, w):
    Xw = X * w[:, None]
    scale = np.abs(Xw).max(axis=0)
    scale[scale == 0] = 1.0
    c, _ = nnls(Xw / scale, y * w)
    return c / scale


def fit_time_physics(s, b, y):
    """(degree, coef, aic per degree) by relative non-negative least squares + AICc."""
    w = 1.0 / y
    best, table = None, {}
    n = len(y)
    for deg in (1, 2):
        X = time_features(s, b, deg)
        if n <= X.shape[1]:
            continue
        c = _nnls(X, y, w)
        rss = float(np.sum(((X @ c - y) * w) ** 2))
        k = X.shape[1]
        aic = n * math.log(max(rss, 1e-300) / n) + 2 * k
        if n - k - 1 > 0:
            aic += 2 * k * (k + 1) / (n - k - 1)
        table[deg] = aic
        if best is None or aic < best[2]:
            best = (deg, c, aic)
    if best is None:  # too few points for any fit: a line through the mean rate
        c = np.array([0.0, float(np.mean(y / (b * s)))])
        return 1, c, {}
    return best[0], best[1], table


# the features with a fitted rate (analytic.time_features): the fixed cost (per strategy), GEMM
# FLOPs (one rate for all), attention FLOPs (per kernel class), collective bytes (per class)
COMM_FEATURES = tuple(f"comm:{c}" for c in dict.fromkeys(analytic.COMM_CLASS.values()))
RATE_FEATURES = ("layer", "gemm_flops", "attn_flops") + COMM_FEATURES


def rate_features(strategy: str, shape: ModelShape, s, b) -> dict:
    """The time model's features (:data:`RATE_FEATURES`) at each ``(s, b)``, as arrays."""
    rows = [analytic.time_features(strategy, shape, int(si), int(bi)) for si, bi in zip(s, b)]
    return {k: np.array([r[k] for r in rows], float) for k in RATE_FEATURES}


def _rate_columns(st: str, shared: bool) -> dict:
    """The fit's column name of each rate of ``st``: shared ones named by their kernel class."""
    cls = analytic.ATTENTION_KERNEL.get(st, st) if shared else st
    return {"layer": f"layer@{st}", "gemm_flops": "gemm_flops@" + ("all" if shared else st),
            "attn_flops": f"attn_flops@{cls}", **{k: f"{k}@" + ("all" if shared else st) for k in COMM_FEATURES}}


KERNEL_FIT_POINTS = 3


def fit_kernel_rates(rows, tables: dict, shape: ModelShape) -> dict:
    """``{kernel class: {"attn_flops": seconds per FLOP, "tokens": seconds per token, "GFLOPs",
    "lengths", "worst_residual"}}`` from the profile's ``kernel`` rows (``kernels.py``): ``a*b*s +
    r*FLOPs`` by relative non-negative least squares on the class's :data:`KERNEL_FIT_POINTS`
    longest lengths among those its strategies are fitted on (``tables``, as for
    :func:`fit_time_rates`; held-out lengths stay held out). The longest, because short calls run
    in another regime (the CPU kernel's block sizes change below 768 tokens: 256 to 512 tokens
    took 3.9x, 1024 to 2048 3.2x) and the s**2 rate is what extrapolates. A class with fewer
    such lengths, or no s**2 rate, is left out (its rate is then fitted with the layers')."""
    out = {}
    for kernel in kernels.KERNELS:
        fitted = {(int(si), int(bi)) for st, (s, b, _) in tables.items() if kernels.kernel_of(st) == kernel
                  for si, bi in zip(s, b)}
        sel = sorted((r for r in rows if r.get("type") == "kernel" and r["kernel"] == kernel
                      and (r["s"], r["b"]) in fitted), key=lambda r: r["b"] * r["s"])[-KERNEL_FIT_POINTS:]
        if len(sel) < KERNEL_FIT_POINTS:
            continue
        y = np.array([r["kernel_seconds"] for r in sel])
        X = np.array([[r["b"] * r["s"], kernels.kernel_flops(kernel, shape, r["s"], r["b"])] for r in sel])
        c = _nnls(X, y, 1.0 / y)
        if c[1] <= 0:
            log.warning(f"kernel {kernel}: no s**2 rate in its calibration; its rate is fitted with the layers'")
            continue
        out[kernel] = {"tokens": float(c[0]), "attn_flops": float(c[1]), "GFLOPs": 1e-9 / float(c[1]),
                       "lengths": sorted(r["s"] for r in sel), "worst_residual": float(np.max(np.abs(X @ c / y - 1.0)))}
    return out


def fit_time_rates(tables: dict, shape: ModelShape, shared: bool = True, fixed: dict | None = None) -> dict:
    """``{strategy: {feature: seconds per unit}}`` by one non-negative least squares over all
    strategies' profiled layer times, relative (each point weighted by 1/measured, so the
    short lengths count as much as the long ones).

    ``tables``: ``{strategy: (s, b, seconds)}``. With ``shared`` (default) the GEMM rate is one
    for all strategies (the same linears, the same FLOPs) and the attention rate one per kernel
    class: the strategies calling the flash kernel pin its s**2 rate together, where one
    strategy's own curvature over a few noisy short lengths let it swing, and the collective
    rate of a strategy is then told apart from its GEMMs (within one strategy both grow as
    b*s). Without ``shared`` every rate is the strategy's own. ``fixed``: ``{column: rate}`` taken
    as given (the kernel classes' attention rates, :func:`fit_kernel_rates`), the rest fitted
    to what they leave."""
    names = {st: _rate_columns(st, shared) for st in tables}
    cols = list(dict.fromkeys(c for m in names.values() for c in m.values()))
    fixed = {c: v for c, v in (fixed or {}).items() if c in cols}
    X_rows, ys = [], []
    for st, (s, b, y) in tables.items():
        f = rate_features(st, shape, s, b)
        X = np.zeros((len(y), len(cols)))
        for k, c in names[st].items():
            X[:, cols.index(c)] = f[k]
        X_rows.append(X)
        ys.append(np.asarray(y, float))
    X, y = np.concatenate(X_rows), np.concatenate(ys)
    free = [c for c in cols if c not in fixed]
    rest = y - sum(X[:, cols.index(c)] * v for c, v in fixed.items())
    got = dict(zip(free, (float(v) for v in _nnls(X[:, [cols.index(c) for c in free]], rest, 1.0 / y))))
    got.update(fixed)
    return {st: {k: got[c] for k, c in names[st].items()} for st in tables}


def throughputs(rates: dict, shape: ModelShape, strategy: str) -> dict:
    """A strategy's rates as a user checks them against the hardware: GFLOP/s (GEMM, attention),
    GB/s (collectives, wire bytes), ms per layer and microseconds per message of its fixed cost
    (None where the rate is 0: that work took no measurable time in the fit)."""
    inv = lambda v, unit: unit / v if v > 0 else None  # noqa: E731
    f = analytic.time_features(strategy, shape, shape.p, 1)
    out = {"gemm_GFLOPs": inv(rates["gemm_flops"], 1e-9), "attn_GFLOPs": inv(rates["attn_flops"], 1e-9),
           "layer_ms": rates["layer"] * 1e3,
           "us_per_message": rates["layer"] * 1e6 / f["messages"] if f["messages"] else None}
    for k in COMM_FEATURES:
        if f[k] > 0:  # the classes this strategy uses
            out[f"{k.split(':')[1]}_GBs"] = inv(rates[k], 1e-9)
    return out


def memory_degree(strategy, shape) -> int:
    """The order in s of the analytic memory formula: 2 where it has score rows (colossal)."""
    terms = set(analytic.SAVED.get(strategy, {})) | {k for ph in analytic.TRANSIENT.get(strategy, []) for k, v in ph.items() if v}
    return 2 if terms & {"rows", "rows32"} else 1


def fit_memory_physics(strategy, shape, s, b, y, target, top: int = 0):
    """Memory in the analytic formula's form (its order in s), coefficients from the profile.

    Fitted on the ``top`` largest profiled lengths (default: degree + 1, the fewest that fix
    the curve; at the largest lengths the activations dominate the
    constant weight terms, and extrapolation starts there), by least squares with coefficients
    of either sign (memory is deterministic: through the points; colossal's transient grew
    5.0x, 4.4x, 4.2x, 4.1x per doubling from 512 on the unseen shape of docs/costmodel.md, a
    quadratic with a negative linear term, which non-negative coefficients missed by 4.5-6.6%
    at 2x and 4x); non-negative least squares where that curve's leading coefficient or a value
    at a fitted length is not positive.
    """
    deg = memory_degree(strategy, shape)
    order = np.argsort(b * s)
    k = min(max(deg + 1, top), len(y))
    idx = order[-k:]
    X = time_features(s[idx], b[idx], deg)
    w = 1.0 / np.maximum(y[idx], 1.0)
    c = np.linalg.lstsq(X * w[:, None], y[idx] * w, rcond=None)[0] if k > deg else None
    if c is None or c[-1] <= 0 or np.any(X @ c <= 0):
        c = _nnls(X, y[idx], w)
    return deg, [float(v) for v in c]


def running_median3(r, b):
    """Median of each point and its two neighbours along s (same b); the ends keep their own
    value, so the extrapolation still starts from the largest length's measurement."""
    out = np.array(r, float)
    for bv in np.unique(b):
        idx = np.flatnonzero(b == bv)  # rows are sorted by (b, s)
        for j in range(1, len(idx) - 1):
            out[idx[j]] = float(np.median(r[idx[j - 1:j + 2]]))
    return out


def fit_xgb_residual(s, b, ratio, seed=0):
    import xgboost as xgb

    d = xgb.DMatrix(xgb_features(s, b), label=ratio, feature_names=list(XGB_FEATURES))
    params = {"objective": "reg:squarederror", "max_depth": 2, "eta": 0.3, "lambda": 1.0,
              "min_child_weight": 0.0, "base_score": 0.0, "seed": seed, "nthread": 1}
    return xgb.train(params, d, num_boost_round=40)


def held_out(rows, strategy, holdout_seqs=(), holdout_largest=False, fit_max_seq=None) -> set:
    """The lengths of ``strategy`` left out of the fit: ``holdout_seqs``, those above
    ``fit_max_seq``, and with ``holdout_largest`` the strategy's largest measured length (of
    those left; to test extrapolation)."""
    out = set(holdout_seqs)
    if fit_max_seq is not None:
        out |= {r["s"] for r in rows if r.get("type") == "layer" and r["strategy"] == strategy
                and r["s"] > fit_max_seq}
    if holdout_largest:
        lens = [r["s"] for r in rows if r.get("type") == "layer" and r["strategy"] == strategy
                and r["s"] not in out]
        if lens:
            out.add(max(lens))
    return out


def layer_table(rows, strategy, time_stat="median", exclude=()):
    sel = [r for r in rows if r.get("type") == "layer" and r["strategy"] == strategy and r["s"] not in exclude]
    sel.sort(key=lambda r: (r["b"], r["s"]))
    s = np.array([r["s"] for r in sel], float)
    b = np.array([r["b"] for r in sel], float)
    ys = {tg: np.array([float(r[tg]) for r in sel]) for tg in TARGETS}
    if time_stat == "min":
        ys["seconds"] = np.array([min(r["layer_times"]) + r.get("comm_seconds", 0.0) for r in sel])
    return s, b, ys


MIN_LENGTHS = 3  # a strategy's time is a fixed, a linear and a quadratic term in s


def check_enough_lengths(tables: dict, path: str) -> None:
    """Each strategy has at least :data:`MIN_LENGTHS` fitted lengths (at its smallest micro-batch
    size): with fewer, the rates of the terms in s and s**2 are not determined (fitted on two
    lengths they came out zero: the same time at 4K and 32K tokens). A
    :class:`~.profile.ProfileFileError` naming the strategies and their lengths."""
    few = {}
    for st, (s, b, _) in tables.items():
        b0 = min(b)
        lens = sorted({int(x) for x, y in zip(s, b) if y == b0})
        if len(lens) < MIN_LENGTHS:
            few[st] = lens
    if few:
        raise ProfileFileError(
            f"profile {path!r} has too few lengths to fit a time model: at least {MIN_LENGTHS} per "
            "strategy (a fixed cost, a term in s, a term in s**2; 5 or more spread over the lengths you "
            "train make a model that holds), here " + ", ".join(f"{st} {v}" for st, v in few.items())
            + ": profile more --seqs (or hold fewer out)")


def read_profiles(paths) -> tuple[dict, list]:
    """The first profile's header and every profile's rows; all must be of one shape, p and
    dtype, and no (kind, strategy, s, b) may be measured twice."""
    header, rows = read_profile(paths[0])
    seen = {}
    for path in paths:
        h, rs = (header, rows) if path == paths[0] else read_profile(path)
        if path != paths[0]:
            for key in ("shape", "p", "dtype"):
                if h.get(key) != header.get(key):
                    raise ProfileFileError(f"profile {path!r} differs from {paths[0]!r} in {key}: "
                                     f"{h.get(key)!r} vs {header.get(key)!r}")
            rows = rows + rs
        for r in rs:
            if r.get("type") in ("layer", "pool", "nonlayer", "kernel", "recompute"):
                k = (r["type"], r.get("strategy") or r.get("kernel"), r["s"], r["b"])
                if k in seen and seen[k] != path:
                    raise ProfileFileError(f"profiles {seen[k]!r} and {path!r} both measure {k[0]} "
                                     f"{k[1] or ''} s={k[2]} b={k[3]}: give each measurement once")
                seen[k] = path
    return header, rows


def fit_pool(rows, names, profile_path) -> dict | None:
    """``{strategy or "nonlayer": {buffer: [c0, c1]}}``, each buffer's bytes ``c0 + c1 * b * s``
    (exact: least squares on the pool rows, refused if any row is off by more than 1%)."""
    pool = [r for r in rows if r.get("type") == "pool"]
    if not pool:
        return None
    out = {}
    for st in list(names) + ["nonlayer"]:
        sel = [r for r in pool if r["strategy"] == st]
        if not sel:
            raise ValueError(f"profile {profile_path!r} has pool rows but none for {st!r}")
        bufs = sorted({n for r in sel for n in r["buffers"]})
        T = np.array([r["b"] * r["s"] for r in sel], float)
        A = np.stack([np.ones_like(T), T], axis=1)
        out[st] = {}
        for n in bufs:
            y = np.array([float(r["buffers"].get(n, 0)) for r in sel])
            c = np.linalg.lstsq(A, y, rcond=None)[0] if len(set(T)) > 1 else np.array([y.mean(), 0.0])
            worst = float(np.max(np.abs(A @ c - y) / np.maximum(y, 1.0)))
            if worst > 0.01:
                raise ValueError(f"profile {profile_path!r}: pool buffer {n!r} of {st!r} is not c0 + c1 * b * s "
                                 f"(off by {worst:.1%} at one of {[(r['s'], r['b']) for r in sel]})")
            out[st][n] = [round(float(c[0]), 6), round(float(c[1]), 6)]
    return out


def fit_profile(profile_path, out_path: str, use_xgb: bool = False, time_stat: str = "median",
                holdout_seqs=(), holdout_largest: bool = False, fit_max_seq: int | None = None,
                time_model: str = "rates", holdout_packs=(), pack_correction: str = "none",
                attention_rate: str = "kernel") -> dict:
    """Fit and save; lengths in ``holdout_seqs``, above ``fit_max_seq`` (and each strategy's
    largest, with ``holdout_largest``) are left out, so that ``report`` can test the model on
    them: measured in the same session as the fitted lengths, they share its machine conditions.

    ``profile_path``: one profile, or a list of profiles of one shape (e.g. an older profile
    and the pool rows of ``profile --pool-only``). ``time_model``: ``rates`` (the analytic work
    with fitted rates) or ``poly`` (the earlier curve in s, degree by AICc; for comparison).
    Packs (``pack`` rows, ``profile --packs``): those whose index is in ``holdout_packs`` are
    left out for ``report``, the others fit the pack terms (:func:`fit_packs`) after the single
    sequences; ``pack_correction``: whether a pack's time takes the single sequence's residual
    correction at its padded length (``ratio``) or not (``none``). ``attention_rate``: each
    kernel class's s**2 rate from the profile's ``kernel`` rows where it has them (``kernel``,
    :func:`fit_kernel_rates`) or fitted with the layers' other rates (``joint``, the earlier way)."""
    if attention_rate not in ("kernel", "joint"):
        raise ValueError(f"attention_rate must be 'kernel' or 'joint', got {attention_rate!r}")
    if pack_correction not in ("ratio", "none"):
        raise ValueError(f"pack_correction must be 'ratio' or 'none', got {pack_correction!r}")
    paths = [profile_path] if isinstance(profile_path, str) else list(profile_path)
    header, rows = read_profiles(paths)
    shape = ModelShape.from_dict(header["shape"])
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    strategies = [st for st in header["strategies"]
                  if any(r.get("type") == "layer" and r["strategy"] == st for r in rows)]
    if not strategies:
        raise ProfileFileError(f"profile {paths[0]!r} has no layer measurements")
    meta = _metadata(header, shape, strategies, rows, paths, time_stat)
    skips = {st: held_out(rows, st, holdout_seqs, holdout_largest, fit_max_seq) for st in strategies}
    tables = {}
    for st in strategies:
        tables[st] = layer_table(rows, st, time_stat, exclude=skips[st])
        if not len(tables[st][0]):
            raise ProfileFileError(f"profile {paths[0]!r}: nothing left to fit for {st!r} after holding out "
                                   f"{sorted(skips[st])}")
    check_enough_lengths(tables, paths[0])
    rates = None
    if time_model == "rates":
        tabs = {st: (s, b, ys["seconds"]) for st, (s, b, ys) in tables.items()}
        meta["kernel_rates"] = fit_kernel_rates(rows, tabs, shape) if attention_rate == "kernel" else {}
        rates = fit_time_rates(tabs, shape, fixed={f"attn_flops@{k}": v["attn_flops"]
                                                    for k, v in meta["kernel_rates"].items()})
    elif time_model != "poly":
        raise ValueError(f"unknown time model {time_model!r} (rates or poly)")
    for st in strategies:
        _fit_strategy(meta, rows, st, shape, skips[st], use_xgb, out_path, tables[st],
                      rates[st] if rates else None)
        if rates:
            meta["targets"][st]["seconds"]["physics"]["attention_rate"] = (
                "kernel" if kernels.kernel_of(st) in meta["kernel_rates"] else "joint")
    nonlayer = _fit_nonlayer(rows)
    if nonlayer is not None:
        meta["nonlayer"] = nonlayer
    meta["pack_correction"] = pack_correction
    _save(meta, out_path)
    if any(r.get("type") == "pack" for r in rows):
        fit_packs(meta, rows, shape, out_path, holdout_packs)
        _save(meta, out_path)
    if any(r.get("type") == "recompute" for r in rows):
        fit_recompute(meta, rows, shape, out_path)
        _save(meta, out_path)
    return meta


def fit_block_recompute(model, rows: list, shape: ModelShape, kind: str) -> dict:
    """Per strategy with ``recompute`` rows measuring the layer with its ``kind`` block ("attn" or
    "mlp") checkpointed (``st:rc-attn`` / ``st:rc-mlp``; rows of older profiles have none): the
    extra time as :func:`fit_recompute` fits the whole layer's, the saved bytes
    ``a * plain saved + c0 + c1 * b*s/p`` (what the block keeps is linear in the tokens, the rest
    of the layer is the plain layer's), least squares raised to cover every cell, the transient
    as ``factor * (plain saved + transient) + extra``."""
    out = {}
    for st in model.strategies:
        cells = sorted((r for r in rows if r.get("type") == "recompute" and r["strategy"] == st
                        and r.get(f"{kind}_times") and r.get("plain_times")), key=lambda r: (r["b"], r["s"]))
        if not cells:
            continue
        extra = [[int(r["s"]), int(r["b"]), float(np.median([a / c - 1.0 for a, c in zip(r[f"{kind}_times"],
                                                                                        r["plain_times"]) if c > 0]))]
                 for r in cells]
        plain = [model.layer(st, int(r["s"]), int(r["b"])) for r in cells]
        t = np.array([r["b"] * r["s"] / shape.p for r in cells], float)
        ps = np.array([pl.saved_bytes for pl in plain])
        pm = np.array([pl.saved_bytes + pl.transient_bytes for pl in plain])
        saved = np.array([float(r[f"{kind}_saved_bytes"]) for r in cells])
        trans = np.array([float(r[f"{kind}_transient_bytes"]) for r in cells])
        if len(cells) >= 3:
            a, c0, c1 = np.linalg.lstsq(np.stack([ps, np.ones_like(t), t], axis=1), saved, rcond=None)[0]
        else:
            a, c0, c1 = 0.0, 0.0, float(np.max(saved / t))
        a, c1 = max(float(a), 0.0), float(c1)
        c0 = math.ceil(float(c0) + max(0.0, float(np.max(saved - (a * ps + c0 + c1 * t)))))
        while np.any(a * ps + c0 + c1 * t < saved):  # an upper bound, rounding included
            c0 += 1
        t_extra = float(math.floor(max(0.0, float(np.min(trans - pm)))))
        factor = max(1.0, float(np.max((trans - t_extra) / pm)))
        while np.any(factor * pm + t_extra < trans):
            factor = float(np.nextafter(factor, 2.0))
        smooth = running_median3(np.array([e[2] for e in extra]), np.array([e[1] for e in extra], float))
        out[st] = {"extra": [[e[0], e[1], float(v)] for e, v in zip(extra, smooth)], "extra_measured": extra,
                   "saved": [a, float(c0), c1], "transient_factor": factor, "transient_extra": t_extra}
    return out


def fit_recompute(meta: dict, rows: list, shape: ModelShape, out_path: str) -> None:
    """``meta["recompute"]``: per strategy, what a recomputed layer (``st:rc``) costs beside the
    plain one, from the profile's ``recompute`` rows (``sweep._recompute_rows``):

    * ``extra_measured``: per cell ``[s, b, f]``, ``f`` the median over its rounds of ``rc /
      plain - 1`` (the two timed in the same round: the ratio is what a noisy machine leaves
      intact), ``extra_spread`` its rounds' quartiles, the strategy's ``extra_median`` and
      ``extra_range`` over cells; ``extra``: the same with each inner cell's ``f`` the median
      of it and its two neighbours (:func:`running_median3`), which the model interpolates in
      log s between the cells (constant outside them) and multiplies the plain layer's
      predicted time by ``1 + f``;
    * ``saved``: ``[c0, c1]``, ``c0 + c1 * (b*s/p)`` bytes (``c1``: the bytes per local token,
      the layer's output; ``c0``: what the checkpoint keeps beside it, the RNG states), least
      squares on the cells, ``c0`` then raised to cover every cell;
    * ``transient_factor`` (>= 1) and ``transient_extra`` (bytes >= 0): the recompute and the
      backward above the saved bytes, ``factor * (plain saved + plain transient) + extra`` of
      the plain layer as this model predicts it: ``extra`` the least measured excess over the
      prediction, ``factor`` the least that then covers every cell (an upper bound of every
      measured cell, so plans stay within memory).

    The section covers the strategies with recompute rows; ``recompute_complete`` says whether
    that is all of the model's (``FittedCostModel.recomputes``)."""
    from .fitted import FittedCostModel

    model = FittedCostModel.load(out_path, shape)
    out = {}
    for st in meta["strategies"]:
        cells = sorted((r for r in rows if r.get("type") == "recompute" and r["strategy"] == st
                        and r.get("rc_times") and r.get("plain_times")), key=lambda r: (r["b"], r["s"]))
        if not cells:
            continue
        extra, spread, plain_mem, t = [], [], [], []
        for r in cells:
            f = [a / c - 1.0 for a, c in zip(r["rc_times"], r["plain_times"]) if c > 0]
            extra.append([int(r["s"]), int(r["b"]), float(np.median(f))])
            spread.append([float(np.percentile(f, 25)), float(np.percentile(f, 75))])
            pl = model.layer(st, int(r["s"]), int(r["b"]))
            plain_mem.append(pl.saved_bytes + pl.transient_bytes)
            t.append(r["b"] * r["s"] / shape.p)
        t, plain_mem = np.array(t, float), np.array(plain_mem)
        saved = np.array([float(r["saved_bytes"]) for r in cells])
        trans = np.array([float(r["transient_bytes"]) for r in cells])
        if len(set(t)) > 1:
            c0, c1 = np.linalg.lstsq(np.stack([np.ones_like(t), t], axis=1), saved, rcond=None)[0]
        else:
            c0, c1 = 0.0, float(saved[0] / t[0])
        c1 = max(float(c1), 0.0)
        c0 = math.ceil(float(c0) + max(0.0, float(np.max(saved - (c0 + c1 * t)))))
        while np.any(c0 + c1 * t < saved):  # an upper bound, rounding included
            c0 += 1
        t_extra = float(math.floor(max(0.0, float(np.min(trans - plain_mem)))))
        factor = max(1.0, float(np.max((trans - t_extra) / plain_mem)))
        while np.any(factor * plain_mem + t_extra < trans):
            factor = float(np.nextafter(factor, 2.0))
        plain_meas = np.array([float(r["plain_saved_bytes"]) + float(r["plain_transient_bytes"]) for r in cells])
        fs = [e[2] for e in extra]
        # one noisy cell does not bend the curve: each inner cell's the median of it and its
        # two neighbours (as the time correction's points, :func:`running_median3`)
        smooth = running_median3(np.array(fs), np.array([e[1] for e in extra], float))
        out[st] = {"extra": [[e[0], e[1], float(v)] for e, v in zip(extra, smooth)], "extra_measured": extra,
                   "extra_spread": spread, "extra_median": float(np.median(fs)),
                   "extra_range": [float(min(fs)), float(max(fs))],
                   "saved": [c0, c1], "saved_bytes_per_token": c1,
                   "transient_factor": factor, "transient_extra": t_extra,
                   "transient_ratio": [float(v) for v in trans / plain_mem],
                   # the plain layer's memory measured beside it against this model's prediction
                   "plain_memory_error": float(np.max(np.abs(plain_meas / plain_mem - 1.0))),
                   "cells": [[int(r["s"]), int(r["b"]), float(r["seconds"]), float(r["plain_seconds"]),
                              float(r["saved_bytes"]), float(r["transient_bytes"])] for r in cells]}
    meta["recompute"] = out
    meta["recompute_blocks"] = {kind: fit_block_recompute(model, rows, shape, kind) for kind in ("attn", "mlp")}
    missing = [st for st in meta["strategies"] if st not in out]
    meta["recompute_complete"] = not missing
    if missing:
        log.warning(f"warning: no recompute rows for {missing}: the model prices no recomputed (:rc) layer "
                    "(profile --recompute-only --append at lengths they fit, and fit again)")


def _save(meta: dict, out_path: str) -> None:
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, out_path)


def pack_rows(rows, strategies, exclude=()) -> list:
    """The profile's ``pack`` rows of ``strategies``, those whose pack index is in ``exclude`` left out."""
    return [r for r in rows if r.get("type") == "pack" and r["strategy"] in strategies and r["pack"] not in exclude]


def fit_packs(meta: dict, rows: list, shape: ModelShape, out_path: str, holdout=()) -> None:
    """The pack terms of ``meta`` from the profile's packs (those not in ``holdout``): the
    rates of the pack features (:func:`fit_pack_rates`) and, per strategy and memory target,
    the median ratio measured / predicted - 1 (``pack_memory``)."""
    from .fitted import FittedCostModel

    fitted = pack_rows(rows, meta["strategies"], set(holdout))
    meta["pack_fitted"] = sorted({r["pack"] for r in fitted})
    meta["pack_held_out"] = sorted({r["pack"] for r in rows if r.get("type") == "pack"} - set(meta["pack_fitted"]))
    if not fitted:
        return
    model = FittedCostModel.load(out_path, shape)
    if all(meta["targets"][st]["seconds"]["physics"]["kind"] == "rates" for st in meta["strategies"]):
        meta["pack_rates"] = fit_pack_rates(model, fitted, shape)
    meta["pack_memory"] = {}
    for st in meta["strategies"]:
        mine = [r for r in fitted if r["strategy"] == st]
        if not mine:
            continue
        out = {}
        for tg in ("saved_bytes", "transient_bytes"):
            ratios = [float(r[tg]) / p - 1.0 for r in mine
                      if (p := model.predict_pack(st, tg, _pack_of(r))) > 0]
            out[tg] = float(np.median(ratios)) if ratios else 0.0
        meta["pack_memory"][st] = out


def _pack_of(row):
    from .packs import PackShape

    return PackShape(tuple(row["lengths"]))


def fit_pack_rates(model, fitted: list, shape: ModelShape) -> dict:
    """``{strategy: {pack feature: seconds per unit}}`` (``analytic.PACK_FEATURES``): one
    non-negative least squares over the profiled packs of what the model without them leaves
    (measured - predicted), weighted by 1/measured: a fixed cost per strategy, the extra kernel
    calls per kernel class (``analytic.ATTENTION_KERNEL``), colossal's rows."""
    cols, X, y, w = [], [], [], []
    names = {}
    for r in fitted:
        st = r["strategy"]
        names[st] = {"pack": f"pack@{st}", "pack_calls": f"pack_calls@{analytic.ATTENTION_KERNEL.get(st, st)}",
                     "pack_rows": f"pack_rows@{st}"}
        cols.extend(c for c in names[st].values() if c not in cols)
    for r in fitted:
        st, pk = r["strategy"], _pack_of(r)
        f = analytic.time_features(st, shape, pk, 1)
        x = np.zeros(len(cols))
        for k, c in names[st].items():
            x[cols.index(c)] = f[k]
        X.append(x)
        y.append(float(r["seconds"]) - model.predict_pack(st, "seconds", pk))
        w.append(1.0 / float(r["seconds"]))
    got = dict(zip(cols, (float(v) for v in _nnls(np.array(X), np.array(y), np.array(w)))))
    return {st: {k: got[c] for k, c in m.items()} for st, m in names.items()}


def _metadata(header: dict, shape: ModelShape, strategies: list, rows: list, paths: list, time_stat: str) -> dict:
    """The model file's head: shape, strategies, the profiles it came from (with their SHA-256),
    the pool's fit; the per-strategy tables to fill."""
    profile_path = paths[0]
    return {"format": FORMAT, "shape": shape.key(), "strategies": strategies,
            "profile": {"path": os.path.basename(profile_path), "sha256": sha256(profile_path),
                        "hardware": header.get("hardware"), "versions": header.get("versions"),
                        "mode": header.get("mode"), "interconnect": header.get("interconnect")},
            "time_stat": time_stat, "targets": {}, "files": {}, "s_max": {}, "s_min": {}, "limits": {},
            "fit_residuals": {}, "fitted": {}, "held_out": {},
            "extra_profiles": [{"path": os.path.basename(p), "sha256": sha256(p)} for p in paths[1:]],
            "pool": fit_pool(rows, strategies, profile_path)}


def _fit_strategy(meta: dict, rows: list, st: str, shape: ModelShape, skip: set, use_xgb: bool,
                  out_path: str, table: tuple, rates: dict | None) -> None:
    """``meta``'s entries for ``st``: the lengths fitted and held out, their range, where its
    sweep stopped, each target's prediction and its largest relative residual."""
    s, b, ys = table
    meta["fitted"][st] = sorted([int(x), int(y)] for x, y in zip(s, b))
    meta["held_out"][st] = sorted(skip)
    meta["s_max"][st] = int(s.max())
    meta["s_min"][st] = int(s.min())
    lim = [r["s"] for r in rows if r.get("type") == "limit" and r["strategy"] == st]
    if lim:
        meta["limits"][st] = int(min(lim))
    meta["targets"][st] = {}
    meta["fit_residuals"][st] = {}
    for tg in TARGETS:
        y = ys[tg]
        phys, phi = _physics(st, tg, shape, s, b, y, rates)
        spec = {"physics": phys, "xgb": None, "ratio_clip": [-0.5, 0.5]}
        ratio = np.where(phi > 0, y / np.maximum(phi, 1e-30) - 1.0, 0.0)
        if tg == "seconds":
            # the time correction (trees or interpolated ratio) fades out beyond the profiled
            # range: there the analytic work with its fitted rates alone predicts
            spec["beyond"] = "fade"
        if tg == "seconds" and use_xgb and len(y) >= 3 and np.max(np.abs(ratio)) > 1e-6:
            spec["xgb"] = _save_xgb(fit_xgb_residual(s, b, np.clip(ratio, -0.5, 0.5)), out_path, st, tg,
                                    meta["files"])
        elif tg == "seconds":
            # the residual ratio interpolated piecewise-linearly in log s between the profiled
            # lengths (trees would make steps), each inner point's the median of it and its two
            # neighbours, so one noisy length does not bend the curve
            r_pts = running_median3(ratio, b)
            spec["residual_points"] = [[float(a), float(c), float(r)] for a, c, r in zip(s, b, r_pts)]
        else:
            # memory is deterministic and piecewise linear in s (the larger of a few phases,
            # each linear; colossal's quadratic), so the difference to the physics curve is
            # interpolated linearly in s: exact between two lengths where one phase holds
            spec["residual"] = "difference"
            spec["residual_points"] = [[float(a), float(c), float(r)] for a, c, r in zip(s, b, y - phi)]
        meta["targets"][st][tg] = spec
        meta["fit_residuals"][st][tg] = float(np.max(np.abs(ratio))) if len(ratio) else 0.0


def _physics(st: str, tg: str, shape: ModelShape, s, b, y, rates: dict | None = None) -> tuple:
    """``(spec, values at the fitted points)`` of a target's physics curve: time from the
    fitted ``rates`` (else by AICc degree), memory in the analytic order."""
    if tg == "seconds" and rates is not None:
        phys = {"kind": "rates", "rates": dict(rates), "attention_kernel": analytic.ATTENTION_KERNEL.get(st, st),
                "throughputs": throughputs(rates, shape, st)}
        return phys, rates_predict(rates, rate_features(st, shape, s, b))
    if tg == "seconds":
        deg, coef, aic = fit_time_physics(s, b, y)
        phys = {"kind": "poly", "degree": deg, "coef": [float(c) for c in coef],
                "aic": {str(k): v for k, v in aic.items()}}
        return phys, time_features(s, b, deg) @ coef
    deg, coef = fit_memory_physics(st, shape, s, b, y, tg)
    phys = {"kind": "poly", "degree": deg, "coef": coef, "form": "analytic order"}
    return phys, time_features(s, b, deg) @ np.asarray(coef)


def _save_xgb(bst, out_path: str, st: str, tg: str, files: dict) -> str:
    """The residual trees saved beside the model (``files``: name -> SHA-256); their name."""
    stem = os.path.splitext(os.path.basename(out_path))[0]
    name = f"{stem}.{st}.{tg}.xgb.json"
    fpath = os.path.join(os.path.dirname(os.path.abspath(out_path)), name)
    bst.save_model(fpath)
    files[name] = sha256(fpath)
    return name


def _fit_nonlayer(rows: list) -> dict | None:
    """The non-layer part (embedding, output layer, loss), linear in tokens, and the step's
    update; None for a profile without non-layer rows."""
    nl = [r for r in rows if r.get("type") == "nonlayer"]
    opt = [r for r in rows if r.get("type") == "optimizer"]
    if not nl:
        return None
    T = np.array([r["b"] * r["s"] for r in nl], float)
    A = np.stack([np.ones_like(T), T], axis=1)
    out = {}
    for tg in TARGETS:
        y = np.array([float(r[tg]) for r in nl])
        if len(y) >= 2:
            c = _nnls(A, y, 1.0 / np.maximum(y, 1e-30))
        else:
            c = np.array([float(y[0]), 0.0])
        out[tg] = [float(v) for v in c]
    if opt:
        # the update after a step's last backward, once per step: gradient reduction
        # (profiles from before it was measured have the optimizer step only) and, in
        # single-device mode, its modelled collectives
        o = opt[0]
        parts = {k: float(o.get(k, 0.0)) for k in ("grad_sync_seconds", "optimizer_seconds", "comm_seconds")}
        out.update(parts, update_seconds=sum(parts.values()), param_bytes=int(o["param_bytes"]))
    return out


@command("python -m megatron_paradyse.costmodel fit")
def main(argv=None):
    ap = ArgumentParser(prog="python -m megatron_paradyse.costmodel fit",
                                 description="Fit the cost model to a profile (JSON lines).")
    ap.add_argument("profile", nargs="+",
                    help="profile(s) of one shape: e.g. a profile and the pool rows of `profile --pool-only`")
    ap.add_argument("-o", "--output", required=True, help="the model's metadata JSON; XGBoost files go beside it")
    ap.add_argument("--xgb", action="store_true",
                    help="add the XGBoost residual to the time model (off by default: on the shipped CPU "
                         "profiles it fitted the timing noise, broke monotonicity in s and raised the "
                         "interpolated held-out error; see docs/costmodel.md)")
    ap.add_argument("--time-stat", choices=("median", "min"), default="median",
                    help="per-length statistic of the repeats that the time model fits (default median)")
    ap.add_argument("--holdout-seqs", default="",
                    help="comma-separated lengths measured in the profile but left out of the fit "
                         "(for `report` to test interpolation on)")
    ap.add_argument("--holdout-largest", action="store_true",
                    help="also leave out each strategy's largest measured length (to test extrapolation)")
    ap.add_argument("--fit-max-seq", type=int, default=None,
                    help="leave out every length above this one (to test extrapolation to 2x, 4x ...)")
    ap.add_argument("--holdout-packs", default="",
                    help="comma-separated pack indices (the profile's `pack` field) left out of the fit, "
                         "for `report` to test packs on")
    ap.add_argument("--pack-correction", choices=("ratio", "none"), default="none",
                    help="a pack's time: the rates alone (none, default: on held-out packs of the p = 2 demo "
                         "profile, docs/costmodel.md 'Packs', 12.0%% mean error against 13.0%%) or times the single "
                         "sequence's residual correction at its padded length (ratio)")
    ap.add_argument("--attention-rate", choices=("kernel", "joint"), default="kernel",
                    help="kernel (default): each attention kernel class's s**2 rate from the profile's kernel "
                         "calibration (`kernel` rows) where it has one; joint: fitted with the layers' other "
                         "rates (the earlier way; at 4x the fitted length it missed by up to 42%%, "
                         "docs/costmodel.md)")
    ap.add_argument("--time-model", choices=("rates", "poly"), default="rates",
                    help="rates (default): the analytic work of each strategy with rates fitted; "
                         "poly: the earlier curve in s with its degree chosen by AICc (for comparison)")
    args = ap.parse_args(argv)
    writable_file(args.output, "-o")
    hold = _ints(args.holdout_seqs, "--holdout-seqs")
    meta = fit_profile(args.profile, args.output, use_xgb=args.xgb, time_stat=args.time_stat,
                       holdout_seqs=hold, holdout_largest=args.holdout_largest, fit_max_seq=args.fit_max_seq,
                       time_model=args.time_model, holdout_packs=_ints(args.holdout_packs, "--holdout-packs"),
                       pack_correction=args.pack_correction, attention_rate=args.attention_rate)
    shape = ModelShape.from_dict(meta["shape"])
    print(f"wrote {args.output} for {shape.describe()}: strategies {', '.join(meta['strategies'])}")
    if meta["pool"] is None:
        log.warning("warning: no pool rows in the profile: the communication pool is not modelled (run "
                    "`profile --pool-only` with the same shape and give its file as a second PROFILE)")
    print("\n".join(rates_table(meta)))
    if meta.get("recompute"):
        print("\n".join(recompute_table(meta)))
    if meta.get("pack_fitted") is not None:
        print(f"packs: fitted on {len(meta['pack_fitted'])}, held out {meta['pack_held_out']}; "
              f"time correction at the padded length: {meta['pack_correction']}")
        for st, r in (meta.get("pack_rates") or {}).items():
            mem = (meta.get("pack_memory") or {}).get(st, {})
            print(f"  {st:9s} pack: fixed {r['pack'] * 1e3:.2f} ms, {r['pack_calls'] * 1e6:.0f} us per extra kernel "
                  f"call" + (f", rows {r['pack_rows'] * 1e12:.1f} ms per GFLOP" if st == "colossal" else "")
                  + "; memory x (1 + " + ", ".join(f"{k} {v:+.3f}" for k, v in mem.items()) + ")")


def _ints(text: str, what: str) -> list:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None


def recompute_table(meta: dict) -> list:
    """The fit's lines on recomputed layers: per strategy the extra time over the plain layer
    per cell (with the rounds' range), the saved bytes and the transient factor."""
    lines = ["recompute (:rc): extra time over the plain layer per length, measured [rounds' quartiles] "
             "-> used; saved; transient"]
    for st, r in meta["recompute"].items():
        cells = ", ".join(f"{s}: {f:+.0%} [{lo:+.0%}..{hi:+.0%}] -> {g:+.0%}" for (s, _, f), (lo, hi), (_, _, g)
                          in zip(r["extra_measured"], r["extra_spread"], r["extra"]))
        lines.append(f"  {st:9s} {cells}; saved {r['saved'][1]:.0f} B/token + {r['saved'][0]:.0f} B; transient "
                     f"{r['transient_factor']:.4f} x plain (saved + transient) + {r['transient_extra']:.0f} B "
                     f"(plain memory measured beside it vs model: {r['plain_memory_error']:.2%})")
    return lines


def rates_table(meta: dict) -> list:
    """The fit's lines: per strategy its fitted rates as throughputs (or the curve's degree, for
    a ``poly`` model), its profiled range and its worst residual."""
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    lines = [f"  kernel {k}: {v['GFLOPs']:.1f} GFLOP/s (s**2), {v['tokens'] * 1e9:.1f} us per 1000 tokens; "
             f"calibrated at s = {v['lengths']}, worst residual "
             f"{v['worst_residual']:.1%}" for k, v in (meta.get("kernel_rates") or {}).items()]
    for st in meta["strategies"]:
        t = meta["targets"][st]["seconds"]["physics"]
        tail = (f"; s fitted {meta['s_min'][st]}..{meta['s_max'][st]}; worst physics residual "
                + ", ".join(f"{k} {v:.1%}" for k, v in meta["fit_residuals"][st].items()))
        if t["kind"] == "rates":
            th = t["throughputs"]
            comm = ", ".join(f"{k[:-4]} {fmt(v, '{:.3f}')} GB/s" for k, v in th.items() if k.endswith("_GBs"))
            lines.append(f"  {st:9s} time: GEMM {fmt(th['gemm_GFLOPs'], '{:.1f}')} GFLOP/s, attention "
                         f"({t['attention_kernel']}) {fmt(th['attn_GFLOPs'], '{:.1f}')} GFLOP/s, "
                         f"{comm + ', ' if comm else ''}fixed {th['layer_ms']:.2f} ms/layer "
                         f"({fmt(th['us_per_message'], '{:.0f}')} us/message)" + tail)
        else:
            lines.append(f"  {st:9s} time: degree {t['degree']} in s (AIC {t['aic']})" + tail)
    return lines
