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
    chunk: int = 0      # the model chunk (virtual pipeline stage) it runs; 0 under 1F1B
    chunks: tuple = ()  # interleaved: the (chunk, position) pairs in flight (in_flight: their positions)


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

    def dep(op, r):
        if op.kind == "F":
            return ("F", r - 1, op.mb) if r > 0 else None
        return ("B", r + 1, op.mb) if r < P - 1 else ("F", r, op.mb)

    clock, ops = run_ops(orders, dep, lambda op, r: (op.kind, r, op.mb),
                         lambda op, r: (fwd if op.kind == "F" else bwd)[r][op.mb], "1F1B")
    busy = tuple(float(sum(fwd[r]) + sum(bwd[r])) for r in range(P))
    return Schedule(max(clock, default=0.0), busy, tuple(clock), tuple(tuple(o) for o in ops))


def run_ops(orders, dep, key, seconds, what: str) -> tuple:
    """Time each stage's ops (``orders[r]``, in order): an op starts when its stage is free and
    the op ``dep(op, r)`` it waits for (a ``key``; None: nothing) has ended, and takes
    ``seconds(op, r)``. Returns ``(each stage's end, its timed ops)``; a RuntimeError names
    ``what`` if the orders deadlock."""
    P = len(orders)
    done, clock, pos = {}, [0.0] * P, [0] * P
    ops = [[] for _ in range(P)]
    moved = True
    while moved:
        moved = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                d = dep(op, r)
                if d is not None and d not in done:
                    break
                start = max(clock[r], done[d] if d is not None else 0.0)
                end = start + seconds(op, r)
                done[key(op, r)] = clock[r] = end
                ops[r].append(op._replace(start=start, end=end))
                pos[r] += 1
                moved = True
    if any(pos[r] < len(orders[r]) for r in range(P)):
        raise RuntimeError(f"{what} schedule deadlocked")
    return clock, ops


# ---------------------------------------------------------------- the interleaved schedule
#
# With V model chunks per pipeline rank (megatron's virtual pipeline stages) rank r holds chunks
# c = 0..V-1, virtual stage c P + r, layers split evenly over the P V virtual stages. Every rank
# runs the same table of (micro-batch, chunk) "virtual micro-batches": groups of N micro-batches
# (``microbatch_group_size_per_vp_stage``, megatron's default P) through chunk 0, then the same
# group through chunk 1, ...; backwards take the same table with the chunks reversed.


def interleaved_group(num_microbatches: int, num_stages: int) -> int:
    """Micro-batches per group: megatron's default P where P divides M, else all M in one
    group (megatron refuses a last group smaller than P; a packed step's M varies)."""
    return num_stages if num_microbatches % num_stages == 0 else num_microbatches


def interleaved_table(num_microbatches: int, num_chunks: int, group: int) -> tuple:
    """The ``(micro-batch, chunk)`` of each forward virtual micro-batch, in run order: groups of
    ``group`` micro-batches through every chunk in turn (the last group takes the rest)."""
    M, V, N = int(num_microbatches), int(num_chunks), int(group)
    out = []
    for lo in range(0, M, N):
        hi = M if lo + N >= M else lo + N
        out += [(j, c) for c in range(V) for j in range(lo, hi)]
    return tuple(out)


def interleaved_warmup(stage: int, num_stages: int, num_microbatches: int, num_chunks: int, group: int,
                       forward_only: bool = False) -> int:
    """Forwards stage ``stage`` runs before its first backward: ``2 (P - r - 1) + (V - 1) N``,
    at most all ``M V`` of them (all of them forward-only)."""
    total = num_microbatches * num_chunks
    if forward_only:
        return total
    return min(2 * (num_stages - stage - 1) + (num_chunks - 1) * group, total)


def interleaved_order(stage: int, num_stages: int, num_microbatches: int, num_chunks: int,
                      group: int | None = None) -> tuple:
    """``stage``'s :class:`StageOp` s in the order megatron's interleaved schedule runs them
    (``forward_backward_pipelining_with_interleaving``), untimed: the warm-up forwards, then
    pairs (forward ``w + i``, backward ``i``), then the cool-down backwards, where forward
    ``k`` is the table's ``k``-th entry and backward ``k`` the same entry with the chunk
    reversed (``V - 1 - c``). Each op has its ``chunk``; ``chunks`` holds the ``(chunk,
    micro-batch)`` pairs whose forward ran and backward did not, itself included, and
    ``in_flight`` their micro-batches."""
    P, M, V = int(num_stages), int(num_microbatches), int(num_chunks)
    N = P if group is None else int(group)
    table = interleaved_table(M, V, N)
    T = len(table)
    w = interleaved_warmup(stage, P, M, V, N)
    fwd = [("F", j, c) for j, c in table]
    bwd = [("B", j, V - 1 - c) for j, c in table]
    order = fwd[:w]
    for i in range(T - w):
        order += [fwd[w + i], bwd[i]]
    order += bwd[T - w:]
    live, out = set(), []
    for kind, j, c in order:
        live.add((c, j))
        out.append(StageOp(kind, j, tuple(sorted({k for _, k in live})), chunk=c, chunks=tuple(sorted(live))))
        if kind == "B":
            live.discard((c, j))
    return tuple(out)


def interleaved_receives(stage: int, num_stages: int, num_microbatches: int, num_chunks: int,
                         group: int | None = None, forward_only: bool = False) -> tuple:
    """``(forward, backward)``: the micro-batches whose activations (gradients) ``stage``
    receives, in the order it receives them: its peer's sends in that peer's run order. Stage r
    > 0 receives every forward output of stage r - 1; stage 0 those of stage P - 1 but its last
    chunk's; backwards the same way down (stage P - 1 all of stage 0's but chunk 0's)."""
    P, M, V = int(num_stages), int(num_microbatches), int(num_chunks)
    table = interleaved_table(M, V, P if group is None else int(group))
    fwd = tuple(j for j, c in table if stage > 0 or c != V - 1)
    bwd = () if forward_only else tuple(j for j, c in table if stage < P - 1 or c != V - 1)
    return fwd, bwd


def simulate_interleaved(fwd, bwd, group: int | None = None) -> Schedule:
    """The interleaved step of ``fwd[r][c][j]`` / ``bwd[r][c][j]`` seconds (stage r, chunk c,
    micro-batch j in run order): each stage runs its ops in :func:`interleaved_order`, an op
    starting when the stage is free and its input is there: F(r, c, j) after F(r - 1, c, j),
    on stage 0 after F(P - 1, c - 1, j); B(r, c, j) after B(r + 1, c, j), on the last stage
    after B(0, c + 1, j), and the last virtual stage's after its own forward. Communication
    takes no time; ``Schedule.ops`` are the :class:`StageOp` s with their chunks."""
    P = len(fwd)
    V = len(fwd[0]) if P else 0
    M = len(fwd[0][0]) if V else 0
    orders = [interleaved_order(r, P, M, V, group) for r in range(P)]

    def dep(op, r):
        c, j = op.chunk, op.mb
        if op.kind == "F":
            return ("F", r - 1, c, j) if r > 0 else (("F", P - 1, c - 1, j) if c > 0 else None)
        if r < P - 1:
            return ("B", r + 1, c, j)
        return ("B", 0, c + 1, j) if c < V - 1 else ("F", r, c, j)

    clock, ops = run_ops(orders, dep, lambda op, r: (op.kind, r, op.chunk, op.mb),
                         lambda op, r: (fwd if op.kind == "F" else bwd)[r][op.chunk][op.mb], "interleaved")
    busy = tuple(float(sum(sum(x) for x in fwd[r]) + sum(sum(x) for x in bwd[r])) for r in range(P))
    return Schedule(max(clock, default=0.0), busy, tuple(clock), tuple(tuple(o) for o in ops))
