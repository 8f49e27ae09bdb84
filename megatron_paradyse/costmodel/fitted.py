"""The fitted cost model: load, check and predict (``fit.py`` makes one from a profile).

Files: ``MODEL`` (a JSON metadata file) and, beside it, one XGBoost model per strategy and
target in XGBoost's own JSON format (``<stem>.<strategy>.<target>.xgb.json``). The metadata
records the shape, p, dtype, strategy set, the profiled range and every file's SHA-256, so a
truncated, corrupt or swapped file is refused with its name.

Prediction of a target ``y`` (layer seconds, saved bytes, transient bytes) at ``(s, b)``:

* a physics model ``phi(s, b)``: time, the layer's analytic work
  (``analytic.time_features``: GEMM FLOPs, attention FLOPs, collective bytes, a fixed cost)
  times rates fitted to the profile (``fit.fit_time_rates``; a format-1 file: a curve in s,
  ``[1, b*s, b*s^2]``, its degree chosen by AIC); memory, the analytic formula's form (linear
  in s, quadratic for colossal's score rows) with its coefficients fitted to the profile's
  largest lengths;
* inside the profiled range, for time, times ``1 + r(s, b)``, ``r`` the residual ratio
  ``measured / phi - 1`` interpolated piecewise-linearly in log s between the profiled
  lengths (an XGBoost regressor instead when fitted with ``--xgb``); for memory, plus the
  difference ``measured - phi`` interpolated linearly in s (memory is piecewise linear in s);
* a pack (``packs``; :meth:`FittedCostModel.predict_pack`): the same rates on the pack's
  analytic work, the pack's own fitted rates, memory as the single sequence of its padded
  length plus the analytic difference;
* a recomputed layer (plan entry ``st:rc``, where the file has a ``recompute`` section:
  :meth:`FittedCostModel.recomputes`): the plain prediction with the measured extra time,
  saved bytes and transient factor (:meth:`FittedCostModel._recomputed`, ``fit.fit_recompute``);
* beyond the largest profiled length ``s_max``: for time, the correction at ``s_max`` fades
  linearly in log2 s to none at ``2 * s_max`` (:func:`fade`), so far beyond the profile the
  rates alone predict (a format-1 file carries the ratio at ``s_max`` on); for memory,
  ``phi(s, b)`` plus the measured difference's ratio at ``s_max``, which continues the
  analytic form scaled to the profile and meets the in-range prediction at ``s_max``.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os

import numpy as np

from ..errors import UserError
from ..parallel.plans import split_entry, strategy_of
from . import analytic, packs
from .base import CostModel, LayerCost, as_tokens, check_length
from .shape import ModelShape

FORMAT = "paradyse-costmodel/2"
# format 1 (time a curve in s whose correction continued beyond the profiled range) is still
# read and predicts as it did; format 2 adds the ``rates`` time model and the fading correction
READ_FORMATS = ("paradyse-costmodel/1", FORMAT)
TARGETS = ("seconds", "saved_bytes", "transient_bytes")
SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "models")


class CostModelFileError(UserError, ValueError):
    """A model file is missing, truncated, corrupt or does not match the run."""


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def time_features(s, b, degree: int):
    s = np.asarray(s, float)
    b = np.asarray(b, float)
    cols = [np.ones_like(s), b * s]
    if degree >= 2:
        cols.append(b * s * s)
    return np.stack(cols, axis=-1)


def xgb_features(s, b):
    s = np.asarray(s, float)
    b = np.asarray(b, float)
    return np.stack([s, b, b * s, b * s * s, np.log(s)], axis=-1)


XGB_FEATURES = ("s", "b", "b*s", "b*s^2", "log_s")


def rates_predict(rates: dict, feats: dict):
    """Seconds: the sum of rate (seconds per unit) times feature (the time model of format 2)."""
    return sum(rates[k] * feats[k] for k in rates)


def fade(s: float, s_max: float) -> float:
    """The weight of the in-range correction at ``s``: 1 up to ``s_max``, falling linearly in
    log2 s to 0 at ``2 * s_max`` and beyond."""
    if s <= s_max:
        return 1.0
    return max(0.0, 1.0 - float(np.log2(s / s_max)))


def host_length(s, p: int) -> float:
    """The length at which a calibration's factor applies to ``s``: ``s`` itself for one
    sequence; for a pack (padded to a multiple of ``p``), the single sequence with the same
    share of attention in its work, sum(d_i^2) / T. A host's factor moves with that share (at
    long lengths attention dominates a layer); a pack of short documents does the work of its
    documents, not of one sequence of its total length, so it takes the factor of a short one."""
    if not packs.is_pack(s):
        return s
    pk = s.padded(p)
    return max(1.0, pk.sum_sq / pk.tokens)


class FittedCostModel(CostModel):
    kind = "fitted"

    def __init__(self, meta: dict, boosters: dict, path: str, prefetch: bool = True):
        self.meta = meta
        self.prefetch = prefetch
        self.path = path
        self.shape = ModelShape.from_dict(meta["shape"])
        self.strategies = tuple(meta["strategies"])
        self.num_layers = self.shape.num_layers
        self.boosters = boosters
        self._cache: dict = {}

    def device_kind(self) -> str:
        """From the profile's hardware record: its ``device`` (profiles since the device
        decision), else ``cuda`` where a GPU was recorded."""
        hw = (self.meta.get("profile") or {}).get("hardware") or {}
        return hw.get("device") or ("cuda" if hw.get("gpu") else "cpu")

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str, shape: ModelShape | None = None, strategies=None,
             prefetch: bool = True) -> "FittedCostModel":
        """Load ``path`` (the metadata JSON); with ``shape``, refuse a model made for another.
        ``prefetch``: the run's weight prefetch, which the ZeRO strategies' pool depends on."""
        if not os.path.isfile(path):
            raise CostModelFileError(f"cost model file {path!r} does not exist")
        try:
            with open(path) as f:
                meta = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CostModelFileError(f"cost model file {path!r} is truncated or corrupt (not valid JSON: {exc})") from None
        if not isinstance(meta, dict) or meta.get("format") not in READ_FORMATS:
            raise CostModelFileError(f"cost model file {path!r} is not a {' or '.join(READ_FORMATS)} metadata file "
                                     f"(format={meta.get('format') if isinstance(meta, dict) else type(meta).__name__!r})")
        for key in ("shape", "strategies", "targets", "files", "s_max"):
            if key not in meta:
                raise CostModelFileError(f"cost model file {path!r} lacks the field {key!r}")
        try:
            mshape = ModelShape.from_dict(meta["shape"])
        except (TypeError, ValueError) as exc:
            raise CostModelFileError(f"cost model file {path!r}: bad shape ({exc})") from None
        if shape is not None and mshape != shape:
            diffs = [f"{k}: model {getattr(mshape, k)!r} vs run {getattr(shape, k)!r}"
                     for k in mshape.key() if getattr(mshape, k) != getattr(shape, k)]
            raise CostModelFileError(f"cost model file {path!r} was made for another model shape: "
                                     + "; ".join(diffs))
        if strategies is not None and set(strategies) - set(meta["strategies"]):
            raise CostModelFileError(f"cost model file {path!r} covers strategies {meta['strategies']}, "
                                     f"the run needs {sorted(strategies)}")
        base = os.path.dirname(os.path.abspath(path))
        boosters = {}
        if meta["files"]:
            import xgboost as xgb
        for name, digest in meta["files"].items():
            fpath = os.path.join(base, name)
            if not os.path.isfile(fpath):
                raise CostModelFileError(f"cost model {path!r}: its file {fpath!r} is missing")
            if sha256(fpath) != digest:
                raise CostModelFileError(f"cost model {path!r}: file {fpath!r} is truncated or corrupt "
                                         "(its SHA-256 differs from the one recorded when it was saved)")
            bst = xgb.Booster()
            try:
                bst.load_model(fpath)
            except Exception as exc:  # noqa: BLE001 - xgboost raises its own error types
                raise CostModelFileError(f"cost model {path!r}: XGBoost cannot read {fpath!r} ({exc})") from None
            boosters[name] = bst
        for st in meta["strategies"]:
            for tg in TARGETS:
                if tg not in meta["targets"].get(st, {}):
                    raise CostModelFileError(f"cost model file {path!r} lacks target {tg!r} of strategy {st!r}")
        return cls(meta, boosters, path, prefetch)

    # ---------------------------------------------------------------- predicting
    def _phi(self, st, tg, s, b):
        spec = self.meta["targets"][st][tg]["physics"]
        if spec["kind"] == "poly":
            return float(time_features(s, b, spec["degree"]) @ np.asarray(spec["coef"]))
        if spec["kind"] == "rates":
            return float(rates_predict(spec["rates"], analytic.time_features(st, self.shape, s, b)))
        sv, tr = analytic.layer_memory(st, self.shape, s, b)
        x = sv if tg == "saved_bytes" else tr
        a, c = spec["coef"]
        return float(a * x + c)

    def _ratio(self, st, tg, s, b):
        """The factor on ``phi(s, b)``: measured over physics, interpolated at s over the profiled
        lengths of the profiled micro-batch size nearest to b."""
        spec = self.meta["targets"][st][tg]
        pts = spec.get("residual_points")
        if pts:
            near = min({p[1] for p in pts}, key=lambda v: abs(v - b))
            sel = sorted((p[0], p[2]) for p in pts if p[1] == near)
            xs, rs = [p[0] for p in sel], [p[1] for p in sel]
            if spec.get("residual") == "difference":
                base = self._phi(st, tg, s, near)
                return (base + float(np.interp(s, xs, rs))) / base if base > 0 else 1.0
            return 1.0 + float(np.interp(np.log(s), np.log(xs), rs))
        name = spec.get("xgb")
        if not name:
            return 1.0
        import xgboost as xgb

        r = float(self.boosters[name].predict(xgb.DMatrix(xgb_features([s], [b]),
                                                          feature_names=list(XGB_FEATURES)))[0])
        lo, hi = spec.get("ratio_clip", (-0.5, 0.5))
        return 1.0 + min(max(r, lo), hi)

    def _with_difference(self, st, tg, s, b):
        """Memory inside the profiled range: physics plus the measured difference interpolated
        linearly in s at the profiled micro-batch size nearest to b (another b scales it as the
        physics does), never below 0. Added, not a ratio: the physics curve, fitted to the
        longest lengths with coefficients of either sign, may be 0 or below at the shortest."""
        pts = self.meta["targets"][st][tg]["residual_points"]
        near = min({p[1] for p in pts}, key=lambda v: abs(v - b))
        sel = sorted((p[0], p[2]) for p in pts if p[1] == near)
        d = float(np.interp(s, [p[0] for p in sel], [p[1] for p in sel]))
        phi_b, phi_n = self._phi(st, tg, s, b), self._phi(st, tg, s, near)
        return max(0.0, phi_b + d * (phi_b / phi_n if near != b and phi_n > 0 else 1.0))

    def predict(self, st, tg, s, b):
        """Inside the profiled range the physics times the measured correction; beyond it the
        correction at ``s_max`` carried on, or, for a target fitted with ``beyond: fade`` (time
        since format 2), faded linearly in log2 s to none at ``2 * s_max``: the residual
        describes the profiled lengths, not the longer ones."""
        s_max = self.meta["s_max"][st]
        if s <= s_max and self.meta["targets"][st][tg].get("residual") == "difference":
            return self._with_difference(st, tg, s, b)
        if s <= s_max:
            return self._phi(st, tg, s, b) * self._ratio(st, tg, s, b)
        r = self._ratio(st, tg, s_max, b) - 1.0
        if self.meta["targets"][st][tg].get("beyond") == "fade":
            r *= fade(s, s_max)
        return self._phi(st, tg, s, b) * (1.0 + r)

    def predict_pack(self, st, tg, s):
        """A pack ``s`` (``packs``): time, the rates on the pack's analytic work
        (``analytic.time_features``), times the single sequence's correction at the pack's
        padded length where the model says so (``pack_correction``: ``ratio``; ``none``, the
        default and what files without the field get: the rates alone), plus the pack's own rates (``pack_rates``: a fixed cost, kernel calls,
        colossal's rows; fitted on profiled packs); memory, the single sequence of the padded
        length plus the analytic difference the pack makes (``analytic.pack_memory``), times
        ``1 + pack_memory`` (the median ratio measured on profiled packs, if any). A format-1
        time curve predicts the single sequence of the padded length."""
        T = packs.geometry(s, self.shape.p).tokens
        one = self.predict(st, tg, T, 1)
        if tg == "seconds":
            phys = self.meta["targets"][st][tg]["physics"]
            if phys["kind"] != "rates":
                return one
            feats = analytic.time_features(st, self.shape, s, 1)
            phi_one = self._phi(st, tg, T, 1)
            corr = one / phi_one if self.meta.get("pack_correction", "none") == "ratio" and phi_one > 0 else 1.0
            extra = rates_predict((self.meta.get("pack_rates") or {}).get(st, {}), feats)
            return rates_predict(phys["rates"], feats) * corr + extra
        i = TARGETS.index(tg) - 1
        delta = analytic.layer_memory(st, self.shape, s, 1)[i] - analytic.layer_memory(st, self.shape, T, 1)[i]
        ratio = ((self.meta.get("pack_memory") or {}).get(st) or {}).get(tg, 0.0)
        return (one + delta) * (1.0 + ratio)

    def recomputes(self) -> bool:
        """True where the file has a ``recompute`` section (``fit.fit_recompute``, from the
        profile's ``recompute`` rows) covering every strategy: :meth:`layer` then prices
        ``st:rc`` entries. Files fitted before (or from profiles without those rows): False."""
        rc = self.meta.get("recompute")
        return bool(rc) and all(st in rc for st in self.strategies)

    def _recomputed(self, entry: str, strategy: str, s, b: int) -> LayerCost:
        """A recomputed layer (``st:rc``) from the plain one (calibrated where the model is):
        time times ``1 +`` the measured extra fraction interpolated in log s (a pack: at its
        padded length; constant outside the measured lengths); saved ``c0 + c1 * b*s/p``;
        transient ``factor * (plain saved + transient) + extra`` (``fit.fit_recompute``)."""
        rc = (self.meta.get("recompute") or {}).get(strategy)
        if not self.recomputes() or rc is None:
            raise KeyError(f"the cost model {self.path!r} cannot price the recomputed layer {entry!r}: it was "
                           "fitted from a profile without recompute rows for every strategy (profile "
                           "--recompute-only --append, then fit again)")
        plain = self.layer(strategy, s, b)
        tokens, bb = as_tokens(s, b, self.shape.p)
        f = _interp_extra(rc["extra"], tokens, bb)
        c0, c1 = rc["saved"]
        saved = c0 + c1 * tokens * bb / self.shape.p
        trans = rc["transient_factor"] * (plain.saved_bytes + plain.transient_bytes) + rc["transient_extra"]
        return LayerCost(plain.seconds * (1.0 + f), saved, trans)

    def recompute_kinds(self) -> tuple:
        """``"layer"`` where :meth:`recomputes`; the blocks (``st:rc-attn``, ``st:rc-mlp``) with it:
        measured where the profile has their rows (``recompute_blocks``), else assumed from the
        fitted plain layer (:func:`~.analytic.assumed_block_recompute`)."""
        return ("layer", "attn", "mlp") if self.recomputes() else ()

    def _block(self, entry: str, strategy: str, kind: str, s, b: int) -> LayerCost:
        """A layer whose ``kind`` block is recomputed: the profile's fit (``fit.fit_recompute``'s
        ``recompute_blocks``) where it has one, else the analytic assumption on this model's
        plain layer."""
        plain = self.layer(strategy, s, b)
        fit = ((self.meta.get("recompute_blocks") or {}).get(kind) or {}).get(strategy)
        if fit is None:
            return analytic.assumed_block_recompute(strategy, self.shape, s, b, plain, kind)
        tokens, bb = as_tokens(s, b, self.shape.p)
        f = _interp_extra(fit["extra"], tokens, bb)
        a, c0, c1 = fit["saved"]
        saved = max(0.0, a * plain.saved_bytes + c0 + c1 * tokens * bb / self.shape.p)
        trans = fit["transient_factor"] * (plain.saved_bytes + plain.transient_bytes) + fit["transient_extra"]
        return LayerCost(plain.seconds * (1.0 + f), saved, trans)

    def layer(self, strategy: str, s, b: int) -> LayerCost:
        """One layer at ``s`` (a length, or a pack: :meth:`predict_pack`) and ``b``; a plan entry
        ``st:rc`` (recomputed in backward), ``st:rc-attn`` or ``st:rc-mlp`` (one block) where
        :meth:`recomputes`."""
        base, rc = split_entry(strategy)
        if rc and base in self.strategies:
            check_length(s, b, self.shape.p)
            key = (strategy, s, b)
            if key not in self._cache:
                if rc == "layer":
                    self._cache[key] = self._recomputed(strategy, base, s, b)
                elif not self.recomputes():
                    raise KeyError(f"the cost model {self.path!r} cannot price the recomputed block {strategy!r}: "
                                   "it prices no recompute (profile --recompute-only --append, then fit again)")
                else:
                    self._cache[key] = self._block(strategy, base, rc, s, b)
            return self._cache[key]
        if strategy not in self.strategies:
            raise KeyError(f"unknown strategy {strategy!r}; the model {self.path!r} knows {self.strategies}")
        check_length(s, b, self.shape.p)
        key = (strategy, s, b)
        if key not in self._cache:
            fn = self.predict_pack if packs.is_pack(s) else (lambda st, tg, x: self.predict(st, tg, x, b))
            vals = [max(0.0, fn(strategy, tg, s)) for tg in TARGETS]
            vals[0] *= self.host_factor(strategy, host_length(s, self.shape.p))
            self._cache[key] = LayerCost(*vals)
        return self._cache[key]

    def host_factor(self, strategy: str | None, s) -> float:
        """The time factor of a calibration to this host (``costmodel.calibrate``): the
        strategy's measured/predicted ratio interpolated in log s between the calibration
        lengths, constant outside them; ``strategy=None``: the non-layer part and the update's.
        1 for a model that was not calibrated."""
        cal = self.meta.get("calibration")
        if not cal:
            return 1.0
        if strategy is None or strategy not in cal["strategies"]:
            return float(cal["other"])
        pts = cal["strategies"][strategy]
        return float(np.interp(np.log(float(s)), [np.log(x[0]) for x in pts], [x[3] for x in pts]))

    def static_bytes(self) -> float:
        return analytic.static_bytes(self.shape)

    def nonlayer(self, s, b: int) -> LayerCost:
        nl = self.meta.get("nonlayer")
        if not nl:
            return LayerCost(0.0, 0.0, 0.0)
        s, b = as_tokens(s, b, self.shape.p)
        x = np.array([1.0, b * s])
        vals = [max(0.0, float(x @ np.asarray(nl[tg]))) for tg in TARGETS]
        vals[0] *= self.host_factor(None, s)
        return LayerCost(*vals)

    def update_seconds(self) -> float:
        # a model fitted before the update was kept apart counted its optimizer step in nonlayer
        return float((self.meta.get("nonlayer") or {}).get("update_seconds", 0.0)) * self.host_factor(None, 0)

    def pool(self, strategy: str, s, b: int) -> dict:
        """The pool's buffers from the profile's pool rows (empty for a model fitted without
        them); a pack's from its padded length's (``analytic.pack_pool``). A ZeRO strategy's
        gathered weights are ``analytic.zero_weight_pool``'s, with this model's ``prefetch`` (the
        run's; a profile records them with prefetch as it was then; they do not depend on s or b)."""
        strategy = strategy_of(strategy)  # a recomputed layer's pool is its strategy's
        if packs.is_pack(s):
            return analytic.pack_pool(strategy, self.shape.p, s, self.pool(strategy, *as_tokens(s, b, self.shape.p)))
        got = (self.meta.get("pool") or {}).get(strategy, {})
        out = {n: max(0.0, c0 + c1 * b * s) for n, (c0, c1) in got.items()}
        if got and strategy in analytic.ZERO:
            out = {n: v for n, v in out.items() if not n.startswith("paradyse:weight0_")}
            dt = analytic._DTYPE_NAME[self.shape.dtype]
            out.update({f"{n}/{dt}": float(v) for n, v in analytic.zero_weight_pool(self.shape, self.prefetch).items()})
        return out


def extrapolation_note(cm, longest: int) -> str | None:
    """Why ``cm``'s predictions for lengths up to ``longest`` tokens are guesses: ``longest`` is
    beyond the longest length it was fitted on (the factor named); None inside the range,
    or for a model that was not fitted to a profile (the analytic model)."""
    top = max((cm.meta.get("s_max") or {}).values(), default=None) if isinstance(cm, FittedCostModel) else None
    if not top or longest <= top:
        return None
    return (f"lengths up to {longest} tokens are {longest / top:.1f}x the longest length the cost model "
            f"{os.path.basename(cm.path)} was fitted on ({int(top)} tokens): its times and peaks there "
            "are extrapolated from the fitted rates and the analytic memory, not measured; profile "
            "longer --seqs to plan them from measurements")


def find_shipped(shape: ModelShape) -> str | None:
    """The metadata file in the package's ``models/`` whose shape equals ``shape``."""
    for path in sorted(glob.glob(os.path.join(SHIPPED_DIR, "*.json"))):
        if path.endswith(".xgb.json"):
            continue
        try:
            with open(path) as f:
                meta = json.load(f)
            if meta.get("format") in READ_FORMATS and ModelShape.from_dict(meta["shape"]) == shape:
                return path
        except Exception:  # noqa: BLE001 - a broken shipped file is reported when loaded by path
            continue
    return None


def _interp_extra(pts: list, tokens: int, b: int) -> float:
    """A recompute's measured extra time fraction ``[[s, b, f], ...]`` at ``tokens``: at the
    nearest micro-batch size, interpolated in log s (constant outside the measured lengths)."""
    near = min({x[1] for x in pts}, key=lambda v: abs(v - b))
    sel = sorted((x[0], x[2]) for x in pts if x[1] == near)
    return float(np.interp(np.log(tokens), [np.log(x[0]) for x in sel], [x[1] for x in sel]))
