"""The systems the benchmark compares, each a rule giving a micro-batch its plan.

* ``stock``: the plugin's plan is ``None``: stock megatron-core TP+SP code, whose attention
  on CPU is megatron's unfused ``DotProductAttention`` (``s x s`` score tensors);
* ``tp_sp``, ``ulysses``, ``ring``, ``colossal``, ``metp``: one strategy for every layer
  (``tp_sp`` is the same TP+SP layer as stock with the plugin's memory-linear attention);
* ``<strategy>+rc``: the same with every layer recomputed in backward (plan entries
  ``<strategy>:rc``), ``<strategy>+rc-mlp`` with every layer's MLP block recomputed
  (``<strategy>:rc-mlp``, megatron's selective MLP recompute); ``stock+rc``: stock with megatron's own full recompute of every layer
  (``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``);
* ``paradyse_heuristic``, ``paradyse_optimal``: the planners
  (``megatron_paradyse.planner.build_planner``) under the memory budget;
* the per-batch oracle is computed afterwards from the measured steps (``report.py``);
* with pipeline stages (``--pp`` > 1) a step is several micro-batches in flight together:
  :meth:`SystemSpec.step_plan` gives the step's run order, plans and per-stage predictions (a
  planner's ``PipelinePlanner.plan_step``; a static system's fixed plan evaluated by a
  ``PipelinePlanner`` whose only candidate is that plan; none for stock);
* ``<system>+pack``: the same documents packed into micro-batches of several documents (THD,
  attention inside each document) up to a token cap: a static strategy with megatron's usual
  token-cap packing (greedy first-fit in stream order, no memory model: what a Megatron user
  runs today), a planner with ``data.PackScheduler``'s balanced packing (packs that fit its
  budget by its cost model) and a plan per pack.

Planners and the cost model are used where their packages exist; a system that cannot be
built is left out with a note saying why (nothing is stubbed).
"""
from __future__ import annotations

import dataclasses

from ..costmodel import build_cost_model
from ..costmodel.analytic import AnalyticCostModel
from ..parallel.packing import PackShape
from ..parallel.plans import make_entry
from ..parallel.strategies import supports
from ..planner import PipelinePlanner, build_planner
from ..training.arguments import transformer_config_from_args
from ..training.model_args import shape_from_args

UNIFORM = ("tp_sp", "ulysses", "ring", "colossal", "metp")
STOCK_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
PLANNERS = ("heuristic", "optimal")
EVAL_BUDGET = float(2 ** 60)  # a static plan's evaluator: a budget nothing reaches, so no plan is tightened


@dataclasses.dataclass
class SystemSpec:
    name: str
    kind: str                 # "stock" | "uniform" | "planner"
    num_layers: int
    strategy: str | None = None
    planner: object = None
    cost_model: object = None
    budget: float = 0.0
    last_fits: bool | None = None
    errors: list = dataclasses.field(default_factory=list)
    packed: bool = False
    config: dict = dataclasses.field(default_factory=dict)  # TransformerConfig fields of its model
    pipeline: object = None   # with stages: a planner's PipelinePlanner, or a static plan's evaluator

    @property
    def pack_mode(self) -> str:
        """How this packed system forms packs: greedy (static) or balanced (a planner's)."""
        return "balanced" if self.kind == "planner" else "greedy"

    def plan_for(self, s: int, b: int):
        if self.kind == "stock":
            return None
        if self.kind == "uniform":
            return (self.strategy,) * self.num_layers
        try:
            choice = self.planner.plan(_length(s), int(b))
        except Exception as e:  # noqa: BLE001 - the planner failed: run its leanest plan, say so
            if not hasattr(self.planner, "leanest"):
                raise
            self.errors.append(f"{self.name}: planner.plan({s}, {b}) raised {type(e).__name__}: {e}; "
                               "ran the leanest uniform plan")
            self.last_fits = False
            return (self.planner.leanest(_length(s), int(b))[0],) * self.num_layers
        self.last_fits = bool(choice.fits)
        return tuple(choice.layers)

    def predict(self, plan, s: int, b: int):
        if plan is None or self.cost_model is None:
            return None
        try:
            c = self.cost_model.step(plan, _length(s), int(b))
        except Exception:  # noqa: BLE001 - a model without this strategy predicts nothing
            return None
        return float(c.seconds + self.cost_model.update_seconds()), float(c.peak_bytes)  # a step of one micro-batch

    def predicted_max(self, cap: int, res: int):
        """The longest multiple of ``res`` up to ``cap`` the cost model (or planner) says fits; None if unknown."""
        if self.kind == "stock" or self.cost_model is None:
            return None
        if self.kind == "planner" and hasattr(self.planner, "longest_fit"):
            # the same rule as the static systems' start below: the full budget. Beyond its
            # margin the planner runs its leanest plan, which the steps judge by the budget too
            limit, self.planner.limit = self.planner.limit, self.budget
            try:
                return int(self.planner.longest_fit(1, multiple=res, upper=cap)) or None
            finally:
                self.planner.limit = limit

        def ok(s):
            if self.kind == "planner":
                return bool(getattr(self.planner, "choose", self.planner.plan)(s, 1).fits)
            pred = self.predict(self.plan_for(s, 1), s, 1)
            return pred is not None and pred[1] <= self.budget
        lo, hi = 0, cap // res
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid * res):
                lo = mid
            else:
                hi = mid - 1
        return lo * res or None

    def step_plan(self, shapes) -> dict:
        """A pipelined step of micro-batches ``shapes`` = ``[(s, b)]``: ``order`` (run order),
        ``plans`` (one full-model plan per micro-batch, by index; None: stock), and the
        predictions ``stage_peaks`` (bytes per stage), ``seconds`` and ``fits`` (None where
        there is no prediction: stock, or a static plan its evaluator cannot price)."""
        n = len(shapes)
        out = dict(order=tuple(range(n)), plans=(None,) * n, stage_peaks=None, seconds=None, fits=None)
        if self.kind == "stock":
            return out
        if self.kind == "uniform":
            out["plans"] = ((self.strategy,) * self.num_layers,) * n
        if self.pipeline is None:
            return out
        sp = self.pipeline.plan_step([(int(s), int(b)) for s, b in shapes])
        if self.kind == "uniform":
            if any(tuple(p) != out["plans"][0] for p in sp.plans):  # not its fixed plan: no prediction
                return out
            return dict(out, stage_peaks=list(sp.stage_peaks), seconds=float(sp.seconds))
        self.last_fits = bool(sp.fits)
        return dict(order=tuple(sp.order), plans=tuple(tuple(p) for p in sp.plans),
                    stage_peaks=list(sp.stage_peaks), seconds=float(sp.seconds), fits=bool(sp.fits))

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "strategy": self.strategy, "packed": self.packed,
                "config": dict(self.config)}


def _length(s):
    """A length as planners take it: an int, or a pack's ``PackShape`` as it is."""
    return s if isinstance(s, PackShape) else int(s)


def load_cost_model(args, path=None):
    """``(cost_model, note)``: ``build_cost_model(shape_from_args(args), path)`` if it exists;
    with context parallelism wrapped in ``costmodel.cp.CPCostModel`` (``training.planning.with_context_parallel``)."""
    from ..training.planning import with_context_parallel

    cm, note = _load_cost_model(args, path)
    return (cm if cm is None else with_context_parallel(args, cm)), note


def _load_cost_model(args, path=None):
    shape = shape_from_args(args)
    try:
        return build_cost_model(shape, path), None
    except Exception as e:  # noqa: BLE001
        if path is not None:
            return None, f"cost model {path} could not be loaded: {type(e).__name__}: {e}"
        try:  # the shipped fitted model is unusable: the analytic one, said so
            return AnalyticCostModel(shape), (f"the shipped fitted cost model could not be loaded "
                                              f"({type(e).__name__}: {e}); the analytic model is used")
        except Exception as e2:  # noqa: BLE001
            return None, f"cost model could not be built: {type(e2).__name__}: {e2}"


def build_systems(cfg, args):
    """``(specs, notes)`` for ``cfg.systems`` (a ``config.BenchConfig``; names as in the module
    docstring)."""
    notes = []
    config = transformer_config_from_args(args)
    p = args.tensor_model_parallel_size
    cost_model, note = load_cost_model(args, cfg.cost_model)
    if note:
        notes.append(note)
    budget = float(cfg.budget_bytes)
    specs = []
    for full in cfg.systems:
        name = full[:-len("+pack")] if full.endswith("+pack") else full
        before = len(specs)
        _add_system(specs, notes, name, cfg, args, config, p, cost_model, budget)
        if full != name and len(specs) > before:
            specs[-1] = dataclasses.replace(specs[-1], name=full, packed=True, errors=[])
        if cfg.dims.pp_on and len(specs) > before:
            specs[-1].pipeline = _pipeline_of(specs[-1], cfg, cost_model, budget, notes)
    return specs, notes


def _pipeline_of(spec, cfg, cost_model, budget, notes):
    """With stages: a planner's ``PipelinePlanner`` under the budget; for a static system, a
    ``PipelinePlanner`` with its strategy as the only candidate (recompute ``only`` for an
    ``:rc`` entry, else ``off``), no margin, an unreachable budget and no reordering, whose
    ``plan_step`` is the fixed plan's per-stage peaks and step time; None for stock or when the
    cost model cannot price it (said in ``notes``)."""
    if spec.kind == "stock" or cost_model is None:
        return None
    if spec.kind == "planner":
        kw = {} if cfg.margin_bytes is None else {"margin_bytes": cfg.margin_bytes}
        return PipelinePlanner(spec.name[len("paradyse_"):], cost_model, budget, cfg.pp, num_chunks=cfg.vpp, **kw)
    strategy, rc = spec.strategy.split(":")[0], spec.strategy.endswith(":rc")
    try:
        return PipelinePlanner("optimal", cost_model, EVAL_BUDGET, cfg.pp, margin_bytes=0.0, reorder=False,
                               strategies=(strategy,), recompute="only" if rc else "off", num_chunks=cfg.vpp)
    except Exception as e:  # noqa: BLE001 - a static system runs without a prediction, said so
        notes.append(f"{spec.name}: no per-stage prediction ({type(e).__name__}: {e})")
        return None


def uniform_of(name: str):
    """``(strategy, recompute)`` of a uniform static system: ``tp_sp`` (None), ``tp_sp+rc``
    ("layer": every layer ``tp_sp:rc``), ``tp_sp+rc-mlp`` ("mlp": every layer ``tp_sp:rc-mlp``,
    what megatron's selective ``--recompute-modules mlp`` recomputes); None for another name."""
    for suffix, kind in (("+rc-mlp", "mlp"), ("+rc", "layer"), ("", None)):
        base = name[:-len(suffix)] if suffix and name.endswith(suffix) else (name if not suffix else None)
        if base in UNIFORM:
            return base, kind
    return None


def _add_system(specs, notes, name, cfg, args, config, p, cost_model, budget):
    """Append the spec of the unpacked system ``name`` (its own planner), or a note why not."""
    if name in ("stock", "stock+rc"):
        specs.append(SystemSpec(name, "stock", args.num_layers, cost_model=None, budget=budget,
                                config=STOCK_RECOMPUTE if name == "stock+rc" else {}))
    elif uniform_of(name) is not None:
        strategy, recompute = uniform_of(name)
        ok, why = supports(strategy, config, p)
        if not ok:
            notes.append(f"{name} left out: {why}")
            return
        entry = make_entry(strategy, recompute)
        if entry != strategy and cost_model is not None and not cost_model.recomputes():
            notes.append(f"{name}: the cost model cannot price recomputed layers: no prediction")
        specs.append(SystemSpec(name, "uniform", args.num_layers, strategy=entry, cost_model=cost_model,
                                budget=budget))
    elif name.startswith("paradyse_") and name[len("paradyse_"):] in PLANNERS:
        if cost_model is None:
            notes.append(f"{name} left out: needs a cost model")
            return
        kw = {} if cfg.margin_bytes is None else {"margin_bytes": cfg.margin_bytes}
        planner = build_planner(name[len("paradyse_"):], cost_model, budget, **kw)
        specs.append(SystemSpec(name, "planner", args.num_layers, planner=planner, cost_model=cost_model,
                                budget=budget))
    else:
        raise ValueError(f"unknown system {name!r}")
