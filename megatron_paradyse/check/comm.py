"""The check's comm section: the plugin's communication paths without a model, the
communicators' memory, and two replicas with different plans under ``--overlap-grad-reduce``.

* **smoke**: on a group of every rank, made for this section with a short timeout, each
  communication path the strategies use, on integer-valued tensors (every sum exact), against
  values worked out on the host: the ring stream and its gradient ring over a pack whose blocks
  skip hops (``ring``, ``colossal``, METP's MLP), the balanced re-layout and the pack re-layout
  (there and back), a prefetch chain (two weight gathers in flight, waited in order), METP's
  flat head-group broadcasts and its reduce-scatter. The CPU run of the check (gloo, what CI
  runs) meets the same values, so a GPU run compares NCCL with gloo.
* **communicators**: the groups created before the budget and the device memory they took
  (``parallel/communicators.py``).
* **buckets**: TP = 1 with one replica per rank, ``--overlap-grad-reduce`` with buckets small
  enough that fc1 and fc2 are apart, replica 0's last micro-batch ``metp``, the others
  ``tp_sp``; every rank's posted collectives recorded and NCCL's ordering rule checked
  (``megatron_paradyse.trace``): the data-parallel group's sequence the same on every replica.

Every rank runs it; the verdicts are the same on every rank.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .. import trace
from ..device import current
from ..parallel import collectives, groups, megatron_state, pack_layout, zigzag
from ..parallel.buffers import block_slot, release_pool, weight_slot
from ..parallel.packing import Documents
from ..parallel.ring_comm import FlatRing
from ..units import MiB
from .results import INFO, SKIP, Line

SMOKE_TIMEOUT = datetime.timedelta(minutes=2)


def run(opts) -> list:
    """The section's lines (every rank calls it at the same point): the plugin installed and
    megatron's parallel state made at TP = p first (its groups' communicators with it)."""
    from ..parallel.dispatch import install

    install()
    megatron_state.initialize(tensor_model_parallel_size=opts.p)
    lines = [_communicators()]
    group = dist.new_group(list(range(dist.get_world_size())), timeout=SMOKE_TIMEOUT)
    lines += smoke(group)
    lines.append(buckets(opts))
    return lines


def _communicators() -> Line:
    made = groups.created()
    if made is None:
        return Line("comm", "communicators", SKIP, "the plugin made no parallel state in this world yet")
    mem = made.device_bytes
    return Line("comm", "communicators", INFO, made.describe(),
                dict(groups=made.groups, device_mib=None if mem is None else mem / MiB))


# ---------------------------------------------------------------------------------------------
# smoke: each path against host-computed values


def smoke(group) -> list:
    """One line per communication path."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    dev = current()
    out = []
    for name, fn in (("ring stream + gradient ring (skipped hops)", _ring), ("balanced re-layout", _zigzag),
                     ("pack re-layout", _pack), ("prefetch chain", _prefetch), ("metp broadcast + reduce-scatter", _metp)):
        release_pool()
        try:
            bad = fn(group, p, r, dev)
        except Exception as e:  # noqa: BLE001 - a path that raises fails its line, not the check
            bad = f"raised {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        bad = _agree(bad, group)
        out.append(Line.verdict("comm", name, not bad, bad or f"p = {p}: every value as on the host"))
    release_pool()
    return out


def _agree(bad: str, group) -> str:
    """Every rank's verdict: the first failing rank's message, on every rank."""
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, bad or "", group=groups.host_group() or group)
    return next((f"rank {i}: {m}" for i, m in enumerate(flags) if m), "")


def _pack_docs(p: int, first: int = 12) -> Documents:
    """A pack of 8 tokens per rank: a first document of ``first`` tokens, then documents of 2.
    With ``first`` 12 the first one spreads over the ranks (its blocks travel; at p = 8 some
    stop early), with 4 none crosses a rank and every hop is skipped."""
    total = 8 * p
    bounds = [0, min(first, total)] + list(range(first + 2, total, 2)) + [total]
    return Documents(tuple(sorted(set(bounds))))


def _ring(group, p, r, dev) -> str:
    for first in (12, 4):  # blocks that travel, then a pack whose every hop is skipped
        bad = _ring_pack(group, p, r, dev, pack_layout.packed_layout(p, _pack_docs(p, first)))
        if bad:
            return f"pack of a first document of {first}: {bad}"
    return ""


def _ring_pack(group, p, r, dev, layout) -> str:
    last = layout.last_hops()
    mine = torch.full((3, 2), float(r + 1), device=dev)
    seen = []
    ring = FlatRing(group)
    for src, held in ring.stream([mine], block_slot, last=last):
        seen.append((src, None if held is None else float(held[0][0, 0])))
    want = [((r - j) % p, float((r - j) % p + 1) if j <= last[(r - j) % p] else None) for j in range(p)]
    if seen != want:
        return f"ring stream held {seen}, expected {want}"
    grads = ring.grad_ring([mine], last=last)
    for j in range(p):
        src = (r - j) % p
        grads.add([torch.full((3, 2), float(10 * r + 1), device=dev)] if j <= last[src] else None)
    got = float(grads.result()[0][0, 0])
    want_g = float(sum(10 * ((r + j) % p) + 1 for j in range(p) if j <= last[r]))
    return "" if got == want_g else f"gradient ring summed {got}, expected {want_g}"


def _rows(n: int, p: int, r: int, dev) -> torch.Tensor:
    """This rank's contiguous chunk of ``n * p`` rows, row i holding its global index i."""
    return (torch.arange(n, device=dev, dtype=torch.float32) + r * n).view(n, 1, 1).expand(n, 1, 4).contiguous()


def _zigzag(group, p, r, dev) -> str:
    x = _rows(6, p, r, dev)
    layout = zigzag.RingLayout(p, 6)
    y = zigzag.to_balanced(x, layout, group)
    want = [i for a, b in layout.ranges(r) for i in range(a, b)]
    if y[:, 0, 0].tolist() != [float(i) for i in want]:
        return f"balanced rows {y[:, 0, 0].tolist()}, expected {want}"
    back = zigzag.from_balanced(y.clone(), layout, group)
    return "" if torch.equal(back, x) else "the balanced layout did not come back to the contiguous chunk"


def _pack(group, p, r, dev) -> str:
    layout = pack_layout.packed_layout(p, _pack_docs(p))
    x = _rows(8, p, r, dev)
    y = pack_layout.arrange(x, layout, group)
    want = [i for a, b in layout.ranges(r) for i in range(a, b)]
    if y[:, 0, 0].tolist() != [float(i) for i in want]:
        return f"packed rows {y[:, 0, 0].tolist()}, expected {want}"
    back = pack_layout.restore(y.clone(), layout, group)
    return "" if torch.equal(back, x) else "the pack layout did not come back to the contiguous chunk"


def _prefetch(group, p, r, dev) -> str:
    a = torch.full((2, 3), float(r), device=dev)
    b = torch.full((3, 2), float(10 + r), device=dev)
    wg = groups.weight_group(group)
    first, w1 = collectives.gather_shards(a, 0, wg, weight_slot(0, 0), async_op=True)
    second, w2 = collectives.gather_shards(b, 1, wg, weight_slot(0, 1), async_op=True)
    w1.wait()
    want_a = torch.cat([torch.full((2, 3), float(i), device=dev) for i in range(p)])
    if not torch.equal(first, want_a):
        return "the first gather in flight brought the wrong shards"
    w2.wait()
    want_b = torch.cat([torch.full((3, 2), float(10 + i), device=dev).t() for i in range(p)])
    return "" if torch.equal(second, want_b) else "the second gather in flight brought the wrong shards"


def _metp(group, p, r, dev) -> str:
    shards = [torch.full((2, 3), float(r), device=dev), torch.full((4,), float(100 + r), device=dev)]
    wg = groups.weight_group(group)
    for src in range(p):
        views, works = collectives.broadcast_flat_start(shards, src, wg, weight_slot(0, src % 2))
        collectives.wait(works)
        if float(views[0][0, 0]) != src or float(views[1][0]) != 100 + src or views[0].shape != (2, 3):
            return f"head group {src}'s flat broadcast arrived as {views[0][0, 0].item()}, {views[1][0].item()}"
    rows = torch.stack([torch.full((5,), float(r * p + i), device=dev) for i in range(p)])
    got = collectives.reduce_scatter_flat(rows, group)
    want = float(sum(k * p + r for k in range(p)))
    return "" if bool((got == want).all()) else f"reduce-scatter gave {got.tolist()}, expected {want}"


# ---------------------------------------------------------------------------------------------
# buckets: replicas with different plans, one order


BUCKET_ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "128",
               "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
               "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "3", "--mock-data",
               "--paradyse-mock-min-length", "8", "--attention-dropout", "0", "--hidden-dropout", "0",
               "--tensor-model-parallel-size", "1", "--overlap-grad-reduce", "--ddp-bucket-size", "4000",
               "--paradyse", "--log-interval", "1000"]


def _replica_plans(dp_rank: int, layers: int):
    def plan_fn(mb, step, index):
        return ("metp" if (dp_rank == 0 and index == 1) else "tp_sp",) * layers
    return plan_fn


def buckets(opts) -> Line:
    """Two or more replicas with different plans: one order of bucket reductions."""
    world = dist.get_world_size()
    if world < 2:
        return Line("comm", "buckets: replicas, different plans", SKIP, "needs 2 ranks or more (one replica each)")
    from ..training.arguments import parse_args
    from ..training.trainer import Trainer

    argv = BUCKET_ARGV + ["--global-batch-size", str(2 * world), "--distributed-backend", opts.backend]
    args = parse_args(argv, world_size=world)
    with trace.Recorder() as rec:
        trainer = Trainer(args, plan_fn=_replica_plans(dist.get_rank(), args.num_layers))
        trainer.train()
    records = [None] * world
    dist.all_gather_object(records, rec.ops, group=groups.host_group())
    n = len(trainer.model.bucket_groups)
    try:
        summary = trace.check(records)
        bad = ""
    except trace.TraceError as e:
        summary, bad = {}, str(e)
    dp = [s["collectives"] for s in summary.values() if s["members"] == list(range(world))]
    return Line.verdict("comm", "buckets: replicas, different plans", not bad,
                        bad or f"{world} replicas, {n} buckets, {args.train_iters} steps: every group's "
                               f"sequence identical on its members ({max(dp, default=0)} collectives on the "
                               "data-parallel group)", buckets=n)
