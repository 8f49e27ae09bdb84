"""Plans: one module for what a plan is, how it is checked, parsed, printed and hashed.

A plan is a tuple with one entry per decoder layer (``None`` means stock megatron code). An
entry is a strategy name, or a strategy name with :data:`RC` (``tp_sp:rc``): that layer runs the
strategy and is recomputed in backward (its input saved, the layer run again inside the
backward; ``parallel/recompute.py``); with :data:`RC_ATTN` (``tp_sp:rc-attn``) or :data:`RC_MLP`
(``tp_sp:rc-mlp``) only that block of the layer is. Every place that touches a plan (``set_plan``, ``--paradyse-plan``, the trainer's
logs, the cross-rank check, the planner) goes through this module:

* :func:`normalize_plan` / :func:`validate_names`: the type and the local checks;
* :func:`parse_plan`: ``--paradyse-plan``, a strategy name (all layers), a comma list (one per
  layer), run-length ``tp_sp*2+ring*2``, or a length rule ``rule:512=tp_sp,2048=ulysses,ring``
  (the first bound at or above the micro-batch's padded length wins; the last entry has no
  bound), parsed into a :class:`PlanRule`, a pure function of data every rank has;
* :func:`describe`: the compact run-length form for logs;
* :func:`plan_hash`: the deterministic hash the cross-rank check compares.
"""
from __future__ import annotations

import hashlib
import types

from .strategies import get as _get_strategy

Plan = tuple  # one entry (strategy name, optionally with RC) per layer

RC = ":rc"  # the suffix of a plan entry whose layer is recomputed in backward
RC_ATTN = ":rc-attn"  # ... whose attention block (input norm, attention, residual add) is
RC_MLP = ":rc-mlp"  # ... whose MLP block (pre-MLP norm, MLP, residual add) is
# what a plan entry recomputes in backward, by suffix: the whole layer or one of its two blocks
RECOMPUTE = types.MappingProxyType({RC: "layer", RC_ATTN: "attn", RC_MLP: "mlp"})
KINDS = tuple(RECOMPUTE.values())
SUFFIX = types.MappingProxyType({kind: suffix for suffix, kind in RECOMPUTE.items()})

_HASH_BITS = 62


def split_entry(entry: str) -> tuple:
    """``(strategy name, what it recomputes)`` of a plan entry: ``"ring:rc"`` -> ``("ring",
    "layer")``, ``"ring:rc-mlp"`` -> ``("ring", "mlp")``, ``"ring"`` -> ``("ring", None)``."""
    for suffix, kind in RECOMPUTE.items():
        if entry.endswith(suffix):
            return entry[:-len(suffix)], kind
    return entry, None


def make_entry(strategy: str, recompute=None) -> str:
    """The plan entry of ``strategy`` recomputing ``recompute``: None or False (nothing), True
    or ``"layer"`` (the whole layer), ``"attn"`` or ``"mlp"`` (that block)."""
    if recompute is None or recompute is False:
        return strategy
    return strategy + SUFFIX["layer" if recompute is True else recompute]


def recomputes_layer(entry: str) -> bool:
    """Whether the entry recomputes its whole layer (``st:rc``)."""
    return split_entry(entry)[1] == "layer"


def strategy_of(entry: str) -> str:
    """The strategy a plan entry runs (without its recompute suffix)."""
    return split_entry(entry)[0]


def validate_names(names) -> Plan:
    """``names`` as a tuple of known plan entries (a strategy name, or one with :data:`RC`);
    ValueError naming the known ones otherwise."""
    names = tuple(names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"plan entries must be strategy names, got {name!r}")
        base, _ = split_entry(name)
        if ":" in base:
            raise ValueError(f"bad plan entry {name!r}: a strategy name, or one with {RC!r} (the layer "
                             f"recomputed in backward), {RC_ATTN!r} or {RC_MLP!r} (its attention or MLP "
                             f"block), e.g. tp_sp{RC}")
        _get_strategy(base)
    return names


def normalize_plan(plan, num_layers: int) -> Plan:
    """A plan as a tuple of one known strategy name per layer; ValueError otherwise."""
    if isinstance(plan, str):
        plan = [plan] * num_layers
    plan = tuple(plan)
    if len(plan) != num_layers:
        raise ValueError(f"plan has {len(plan)} entries but the model has {num_layers} layers "
                         "on this pipeline stage: give one strategy name per layer, or one name for all")
    return validate_names(plan)


def describe(plan) -> str:
    """Compact run-length form for logs, e.g. ``tp_sp:rc*2+tp_sp*18+metp*4``; ``stock`` for None."""
    if plan is None:
        return "stock"
    out, prev, n = [], None, 0
    for name in plan:
        if name == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev}*{n}")
        prev, n = name, 1
    out.append(f"{prev}*{n}")
    return "+".join(out)


def plan_hash(obj) -> int:
    """A deterministic 62-bit hash of a plan (or any repr-able value); Python's ``hash`` is salted."""
    digest = hashlib.blake2b(repr(obj).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << _HASH_BITS) - 1)


def _one_plan(text: str, num_layers: int) -> tuple:
    """A single plan: ``name``, ``a,b,c,...`` (one per layer) or ``a*2+b*2`` (run-length)."""
    text = text.strip()
    if not text:
        raise ValueError("empty plan")
    if "," in text:
        names = [t.strip() for t in text.split(",")]
    elif "+" in text or "*" in text:
        names = []
        for item in text.split("+"):
            name, _, count = item.strip().partition("*")
            name = name.strip()
            try:
                n = int(count) if count else 1
            except ValueError:
                raise ValueError(f"bad run-length item {item!r} (expected name*count)") from None
            if n < 1:
                raise ValueError(f"bad run-length count in {item!r}")
            names += [name] * n
    else:
        names = [text] * num_layers
    if len(names) != num_layers:
        raise ValueError(f"plan {text!r} has {len(names)} layers but the model has {num_layers} "
                         "(--num-layers)")
    return validate_names(names)


class PlanRule:
    """A plan as a deterministic function of a micro-batch's padded sequence length.

    ``thresholds`` is ascending; a micro-batch of padded length ``s`` runs the plan of the
    first threshold ``>= s``, or ``default`` beyond the last.
    """

    def __init__(self, spec: str, thresholds: list, plans: list, default: tuple):
        self.spec, self.thresholds, self.plans, self.default = spec, thresholds, plans, default

    def __call__(self, seq_length: int) -> tuple:
        for limit, plan in zip(self.thresholds, self.plans):
            if seq_length <= limit:
                return plan
        return self.default

    def strategies(self) -> list:
        names = set(self.default)
        for plan in self.plans:
            names.update(plan)
        return sorted(names)

    def __repr__(self):
        return f"PlanRule({self.spec!r})"


def parse_plan(spec: str, num_layers: int) -> PlanRule:
    """Parse ``--paradyse-plan``; ValueError with the reason on a bad spec (local, no collective)."""
    if spec is None:
        raise ValueError("no plan given")
    spec = spec.strip()
    if not spec.startswith("rule:"):
        return PlanRule(spec, [], [], _one_plan(spec, num_layers))
    entries = [e.strip() for e in spec[len("rule:"):].split(",") if e.strip()]
    if not entries:
        raise ValueError("a rule needs entries, e.g. rule:512=tp_sp,2048=ulysses,ring")
    thresholds, plans, default = [], [], None
    for k, entry in enumerate(entries):
        limit, eq, plan = entry.partition("=")
        if not eq:
            if k != len(entries) - 1:
                raise ValueError(f"rule entry {entry!r} without '=' must come last (the default)")
            default = _one_plan(entry, num_layers)
            continue
        try:
            limit = int(limit)
        except ValueError:
            raise ValueError(f"rule threshold {limit!r} is not an integer length") from None
        if thresholds and limit <= thresholds[-1]:
            raise ValueError("rule thresholds must be strictly ascending")
        thresholds.append(limit)
        plans.append(_one_plan(plan, num_layers))
    if default is None:
        raise ValueError("a rule needs a final default plan without '=' for longer sequences, "
                         "e.g. rule:512=tp_sp,ring")
    return PlanRule(spec, thresholds, plans, default)


def describe_plans(plans) -> str:
    """The plans of a step's micro-batches, compactly: one :func:`describe` if all agree."""
    texts = [describe(p) for p in plans]
    if len(set(texts)) == 1:
        return texts[0]
    if len(texts) > 8:
        return ",".join(texts[:8]) + f",...(+{len(texts) - 8})"
    return ",".join(texts)


def rule_plan_fn(rule: PlanRule):
    """``plan_fn`` for :class:`PlannedIterator`: the rule applied to the padded length."""
    return lambda mb, step, index: rule(mb.seq_length)
