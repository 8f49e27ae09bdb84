"""The systems the benchmark compares, each a rule giving a micro-batch its plan.

* ``stock``: the plugin's plan is ``None``: stock megatron-core TP+SP code, whose attention
  on CPU is megatron's unfused ``DotProductAttention`` (``s x s`` score tensors);
* ``tp_sp``, ``ulysses``, ``ring``, ``colossal``, ``metp``: one strategy for every layer
  (``tp_sp`` is the same TP+SP layer as stock with the plugin's memory-linear attention);
* ``paradyse_heuristic``, ``paradyse_optimal``: the planners
  (``megatron_paradyse.planner.build_planner``) under the memory budget;
* the per-batch oracle is computed afterwards from the measured steps (``report.py``).

Planners and the cost model are used where their packages exist; a system that cannot be
built is left out with a note saying why (nothing is stubbed).
"""
from __future__ import annotations

import dataclasses

from ..costmodel import ModelShape, build_cost_model
from ..costmodel.analytic import AnalyticCostModel
from ..parallel.strategies import supports
from ..planner import build_planner
from ..training.arguments import transformer_config_from_args

UNIFORM = ("tp_sp", "ulysses", "ring", "colossal", "metp")
PLANNERS = ("heuristic", "optimal")


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

    def plan_for(self, s: int, b: int):
        if self.kind == "stock":
            return None
        if self.kind == "uniform":
            return (self.strategy,) * self.num_layers
        try:
            choice = self.planner.plan(int(s), int(b))
        except Exception as e:  # noqa: BLE001 - the planner failed: run its leanest plan, say so
            if not hasattr(self.planner, "leanest"):
                raise
            self.errors.append(f"{self.name}: planner.plan({s}, {b}) raised {type(e).__name__}: {e}; "
                               "ran the leanest uniform plan")
            self.last_fits = False
            return (self.planner.leanest(int(s), int(b))[0],) * self.num_layers
        self.last_fits = bool(choice.fits)
        return tuple(choice.layers)

    def predict(self, plan, s: int, b: int):
        if plan is None or self.cost_model is None:
            return None
        try:
            c = self.cost_model.step(plan, int(s), int(b))
        except Exception:  # noqa: BLE001 - a model without this strategy predicts nothing
            return None
        return float(c.seconds + self.cost_model.update_seconds()), float(c.peak_bytes)  # a step of one micro-batch

    def predicted_max(self, cap: int, res: int):
        """The longest multiple of ``res`` up to ``cap`` the cost model (or planner) says fits; None if unknown."""
        if self.kind == "stock" or self.cost_model is None:
            return None
        if self.kind == "planner" and hasattr(self.planner, "longest_fit"):
            return int(self.planner.longest_fit(1, multiple=res, upper=cap)) or None

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

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "strategy": self.strategy}


def load_cost_model(args, path=None):
    """``(cost_model, note)``: ``build_cost_model(ModelShape.from_args(args), path)`` if it exists."""
    shape = ModelShape.from_args(args)
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
    for name in cfg.systems:
        if name == "stock":
            specs.append(SystemSpec("stock", "stock", args.num_layers, cost_model=None, budget=budget))
        elif name in UNIFORM:
            ok, why = supports(name, config, p)
            if not ok:
                notes.append(f"{name} left out: {why}")
                continue
            specs.append(SystemSpec(name, "uniform", args.num_layers, strategy=name, cost_model=cost_model,
                                    budget=budget))
        elif name.startswith("paradyse_") and name[len("paradyse_"):] in PLANNERS:
            kind = name[len("paradyse_"):]
            if cost_model is None:
                notes.append(f"{name} left out: needs a cost model")
                continue
            kw = {} if cfg.margin_bytes is None else {"margin_bytes": cfg.margin_bytes}
            planner = build_planner(kind, cost_model, budget, **kw)
            specs.append(SystemSpec(name, "planner", args.num_layers, planner=planner, cost_model=cost_model,
                                    budget=budget))
        else:
            raise ValueError(f"unknown system {name!r}")
    return specs, notes
