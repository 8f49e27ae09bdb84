"""Megatron's 1F1B pipeline schedule, simulated: a step's time with its bubbles and which
micro-batches are in flight while each forward and backward runs.

Stage r of P runs ``min(P - r - 1, M)`` warm-up forwards, then one forward / one backward,
then the cool-down backwards (megatron-core's ``forward_backward_pipelining_without_
interleaving``), so it holds up to ``min(P - r, M)`` micro-batches' activations at once. The
in-flight sets depend only on the run order (:func:`one_f_one_b`), so memory can be checked
without timing; :func:`simulate_1f1b` adds the times. The pipeline planner
(``planner/stages.py``) and the pipeline simulation (``bench/simulate_pipeline.py``) both use it.
"""
from __future__ import annotations

from typing import NamedTuple


class StageOp(NamedTuple):
    """One forward (``"F"``) or backward (``"B"``) of a micro-batch on a stage; ``start`` and
    ``end`` are 0 in a stage's order (:func:`one_f_one_b`), its times in a :class:`Schedule`."""

    kind: str
    mb: int             # position in the run order
    in_flight: tuple    # positions whose forward is done (or running) and backward not done
    start: float = 0.0
    end: float = 0.0


class Schedule(NamedTuple):
    makespan: float     # seconds from the first forward to the last backward (bubbles included)
    busy: tuple         # per stage: seconds of its forwards and backwards
    ends: tuple         # per stage: when its last backward ends
    ops: tuple          # per stage: its Ops in the order it runs them


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> tuple:
    """``stage``'s :class:`StageOp` s in the order megatron's 1F1B runs them (untimed): ``w =
    min(P - r - 1, M)`` warm-up forwards, then ``M - w`` pairs (forward of ``w + i``, backward
    of ``i``), then the ``w`` cool-down backwards; each with the positions in flight while it
    runs (itself included)."""
    M = int(num_microbatches)
    w = min(num_stages - stage - 1, M)
    order = [("F", j) for j in range(w)]
    for i in range(M - w):
        order += [("F", w + i), ("B", i)]
    order += [("B", j) for j in range(M - w, M)]
    live, out = set(), []
    for kind, j in order:
        live.add(j)
        out.append(StageOp(kind, j, tuple(sorted(live))))
        if kind == "B":
            live.discard(j)
    return tuple(out)


def simulate_1f1b(fwd, bwd) -> Schedule:
    """The 1F1B step of ``fwd[r][j]`` / ``bwd[r][j]`` seconds (stage r, micro-batch j in run
    order): each stage runs its ops in :func:`one_f_one_b` order, an op starting when the stage
    is free and its input is there: F(r, j) after F(r-1, j); B(r, j) after B(r+1, j), on the
    last stage after F(P-1, j). Communication takes no time and a send does not wait for its
    receiver."""
    P, M = len(fwd), len(fwd[0]) if fwd else 0
    orders = [one_f_one_b(r, P, M) for r in range(P)]
    done = {}  # (kind, r, j) -> end
    clock, pos = [0.0] * P, [0] * P
    ops = [[] for _ in range(P)]
    moved = True
    while moved:
        moved = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                kind, j = op.kind, op.mb
                dep = (("F", r - 1, j) if r > 0 else None) if kind == "F" else \
                    (("B", r + 1, j) if r < P - 1 else ("F", r, j))
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                end = start + (fwd[r][j] if kind == "F" else bwd[r][j])
                done[(kind, r, j)] = clock[r] = end
                ops[r].append(op._replace(start=start, end=end))
                pos[r] += 1
                moved = True
    if any(pos[r] < len(orders[r]) for r in range(P)):
        raise RuntimeError("1F1B schedule deadlocked")  # cannot happen: 1F1B is deadlock-free
    busy = tuple(float(sum(fwd[r]) + sum(bwd[r])) for r in range(P))
    return Schedule(max(clock, default=0.0), busy, tuple(clock), tuple(tuple(o) for o in ops))
