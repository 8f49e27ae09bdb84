"""``build_planner``: a planner of a kind (heuristic or optimal) for a cost model under a budget."""
from __future__ import annotations

from .core import Planner
from .heuristic import HeuristicPlanner
from .optimal import OptimalPlanner
from .refine import Refinement

KINDS = {"heuristic": HeuristicPlanner, "optimal": OptimalPlanner}


def build_planner(kind: str, cost_model, memory_budget_bytes: float, gamma: float | None = None,
                  margin_bytes: float | None = None, strategies=None, refinement=None,
                  device_kind: str | None = None, recompute: str = "auto", recompute_chunk: int = 1,
                  **kwargs) -> Planner:
    """A planner of ``kind`` (``heuristic`` | ``optimal``) for ``cost_model`` under the budget.

    ``gamma``: the hysteresis (keep the previous plan while it fits and is at most gamma
    slower); default 0.05 for ``heuristic`` (the paper's) and 0 for ``optimal`` (switching
    costs nothing here: ``set_plan`` only sets attributes, so the exact planner need not
    trade time for stability; give a gamma to damp switching on noisy, refined predictions).
    ``margin_bytes``: default 10% of the budget on GPU, 5% on CPU, by ``device_kind`` ("cuda" or
    "cpu": the device the plans are for; default the cost model's). ``strategies``: restrict
    to these (default: all the cost model predicts). ``refinement``: a :class:`Refinement`
    (``True`` builds one) whose all-reduced factors correct the predictions (a recomputed
    layer uses its strategy's). ``recompute``: the candidates per layer: ``auto`` (default)
    every strategy and, when the cost model prices them (``CostModel.recomputes()``; otherwise
    plain strategies, with one warning), each one recomputed in backward (plan entry
    ``tp_sp:rc``); ``off`` plain strategies only; ``only`` recomputed ones only (megatron's
    ``--recompute-granularity full --recompute-method uniform``; ValueError if the cost model
    cannot price them). ``recompute_chunk``: megatron's ``--recompute-num-layers`` under the
    uniform method, layers recomputed as one chunk: each ``:rc`` transient also holds
    ``chunk - 1`` more layers' saved bytes (the largest strategy's). ``recompute_first``:
    megatron's ``--recompute-method block``, the first N layers of every plan recomputed
    whatever the search chose, priced and re-checked (``Planner.choose``). Other keywords go
    to the planner's class (``order`` for ``optimal``).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown planner {kind!r}: one of {sorted(KINDS)}")
    if gamma is None:
        gamma = 0.05 if kind == "heuristic" else 0.0
    if refinement is True:
        refinement = Refinement(tuple(strategies) if strategies is not None else tuple(cost_model.strategies))
    return KINDS[kind](cost_model, memory_budget_bytes, gamma=gamma, margin_bytes=margin_bytes,
                       strategies=strategies, refinement=refinement, device_kind=device_kind,
                       recompute=recompute, recompute_chunk=recompute_chunk, **kwargs)
