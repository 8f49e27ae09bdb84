"""A record of the collectives and point-to-point operations each rank posts, and the check of
NCCL's ordering rule on it: the CPU stand-in for what NCCL needs and gloo does not enforce.

NCCL matches the operations of one communicator by their order: every member of a group must
post the same collectives in the same order (sizes and dtypes included), and the sends from
one rank to another must meet that rank's receives in order. gloo often forgives a violation
(or sums the wrong buffers silently), so the test worlds record what each rank posts and
:func:`check` asserts the rule.

:class:`Recorder` records at the one place every collective of torch.distributed reaches, the
``ProcessGroup`` object's methods (megatron-core's module-level aliases such as
``dist_reduce_scatter_func`` and ``batch_isend_irecv``'s coalesced sends included): per call the
group's name (torch names groups in creation order, the same on every rank), its members, the
operation, the peer (point-to-point, global rank) or root (broadcast, reduce), the element count
and the dtype. :func:`run_world` (``testing.spawn.run_world(..., trace=True)``) returns each
rank's record beside its result.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import types
import weakref

import torch
import torch.distributed as dist

from . import runtime

# ProcessGroup methods -> (kind, how the element count is read): "all" the first tensor
# argument's elements, "none" not compared (uneven all-to-all splits), "p2p" a send or receive
_METHODS = types.MappingProxyType({
    "allreduce": "all", "allreduce_coalesced": "all", "broadcast": "all", "reduce": "all",
    "allgather": "all", "_allgather_base": "all", "allgather_into_tensor_coalesced": "all",
    "allgather_coalesced": "all", "all_gather_single_coalesced": "all",
    "reduce_scatter": "all", "_reduce_scatter_base": "all", "reduce_scatter_tensor_coalesced": "all",
    "reduce_scatter_single_coalesced": "all",
    "all_gather_single": "all", "reduce_scatter_single": "all",  # torch 2.13's *_tensor collectives
    "alltoall_base": "none", "alltoall": "none", "all_to_all_single": "none",
    "barrier": "none", "monitored_barrier": "none",
    "gather": "none", "scatter": "none",  # the root passes a list of every rank's buffer
    "send": "p2p", "recv": "p2p",
})
_ROOTED = ("broadcast", "reduce", "gather", "scatter")


@dataclasses.dataclass(frozen=True)
class Op:
    """One posted operation: ``group`` (torch's group name), ``members`` (global ranks),
    ``op`` (the ProcessGroup method), ``peer`` (a send's destination or a receive's source,
    global rank), ``root`` (global rank), ``numel`` (None where not compared) and ``dtype``."""

    group: str
    members: tuple
    op: str
    numel: int | None
    dtype: str | None
    peer: int | None = None
    root: int | None = None
    batch: int | None = None  # point-to-point: this rank's batch_isend_irecv call it was posted in

    def key(self) -> tuple:
        """What every member of the group must agree on."""
        return (self.op, self.numel, self.dtype, self.root)

    def __str__(self) -> str:
        where = f" peer {self.peer}" if self.peer is not None else f" root {self.root}" if self.root is not None else ""
        return f"{self.op}[group {self.group} {list(self.members)}]{where} {self.numel} x {self.dtype}"


def _tensors(obj) -> list:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


class Recorder:
    """Record this process's posted collectives while active (a context manager; the
    ``ProcessGroup`` methods are restored on exit). ``ops``: the :class:`Op` list, in order.
    ``path``: each op is also appended to that file as it is posted (before the backend runs
    it), so a rank that hangs or aborts inside a collective leaves its record behind."""

    def __init__(self, path: str | None = None):
        self.ops: list = []
        self._members: dict = {}
        self._file = open(path, "a", buffering=1) if path else None
        self._batch, self._in_batch = 0, False
        self._name = f"trace:{id(self)}"

    def _group(self, pg) -> tuple:
        got = self._members.get(id(pg))
        if got is None or got[0]() is not pg:  # held weakly: a destroyed group must be let go
            try:
                members = tuple(dist.get_process_group_ranks(pg))
            except Exception:  # noqa: BLE001 - a backend-level group torch does not map
                members = ()
            got = self._members[id(pg)] = (weakref.ref(pg), pg.group_name, members)
        return got[1], got[2]

    def _record(self, pg, method: str, call_args: tuple) -> None:
        name, members = self._group(pg)
        ts = _tensors(call_args)
        how = _METHODS[method]
        numel = sum(t.numel() for t in ts) if how != "none" and ts else None
        dtype = str(ts[0].dtype).replace("torch.", "") if ts else None
        peer = root = None
        if how == "p2p":
            local = int(call_args[1])
            peer = members[local] if local < len(members) else local
        elif method in _ROOTED:
            opts = call_args[-1] if call_args else None
            local = getattr(opts, "rootRank", None)
            if local is not None and local < len(members):
                root = members[local]
        op = Op(name, members, method, numel, dtype, peer, root, self._batch if self._in_batch else None)
        self.ops.append(op)
        if self._file is not None:
            self._file.write(json.dumps(dataclasses.astuple(op)) + "\n")

    def __enter__(self):
        from torch._C._distributed_c10d import ProcessGroup

        patches = []
        for method in _METHODS:
            fn = getattr(ProcessGroup, method, None)
            if fn is None:
                continue

            def wrapper(pg, *args, _fn=fn, _m=method, **kwargs):
                self._record(pg, _m, args)
                return _fn(pg, *args, **kwargs)

            patches.append(runtime.Patch(ProcessGroup, method, wrapper))
        batched = dist.batch_isend_irecv

        def batch_isend_irecv(ops):
            self._batch += 1
            self._in_batch = True
            try:
                return batched(ops)
            finally:
                self._in_batch = False

        patches += [runtime.Patch(mod, "batch_isend_irecv", batch_isend_irecv)
                    for mod in (dist, dist.distributed_c10d)]
        # the registry's patches named ``trace:<id>`` (restored on exit as they were: the class's
        # own entries, pybind's instancemethods; recorders nest)
        runtime.install(self._name, *patches)
        return self

    def __exit__(self, *exc):
        runtime.restore(self._name)
        if self._file is not None:
            self._file.close()
        return False


def read(path: str) -> list:
    """The :class:`Op` list a :class:`Recorder` with ``path`` wrote (empty if none)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                g, members, *rest = json.loads(line)
                out.append(Op(g, tuple(members), *rest))
    return out


class TraceError(AssertionError):
    """The ranks' records break NCCL's ordering rule; the message names the first difference."""


def check(traces: list, partial: bool = False) -> dict:
    """Assert NCCL's ordering rule over ``traces`` (one :class:`Op` list per global rank):

    * each group's collectives (all but sends and receives) form the same sequence of
      ``(op, numel, dtype, root)`` on every member;
    * per group and ordered pair of ranks, the sends from one meet the receives of the other
      in order, with the same count and dtype;
    * a group whose members exchange point-to-point batches starts with a collective on every
      member (NCCL creates a communicator at its first use, which every member must join).

    Returns a summary ``{group name: {"members", "collectives", "p2p"}}``; raises
    :class:`TraceError` naming the first violation. ``partial``: the records of a world that
    failed or hung (ranks stopped at different points): only differences within what every
    member posted count, not missing tail operations.
    """
    coll = collections.defaultdict(dict)   # group -> rank -> [Op]
    sends = collections.defaultdict(list)  # (group, src, dst) -> [Op]
    recvs = collections.defaultdict(list)
    first = collections.defaultdict(dict)  # group -> rank -> first Op
    members = {}
    for rank, ops in enumerate(traces):
        for op in ops:
            members[op.group] = op.members
            first[op.group].setdefault(rank, op)
            if op.op == "send":
                sends[(op.group, rank, op.peer)].append(op)
            elif op.op == "recv":
                recvs[(op.group, op.peer, rank)].append(op)
            else:
                coll[op.group].setdefault(rank, []).append(op)
    for group, ranks in sorted(members.items()):
        _same_sequence(group, ranks, {r: coll[group].get(r, []) for r in ranks if r < len(traces)}, partial)
    for key in sorted(set(sends) | set(recvs)):
        _paired(key, sends.get(key, []), recvs.get(key, []), partial)
    for group in sorted({k[0] for k in set(sends) | set(recvs)}):
        _first_use(group, members[group], first[group], sends, recvs)
    return {g: {"members": list(members[g]),
                "collectives": len(next(iter(coll[g].values()), [])),
                "p2p": sum(len(v) for k, v in sends.items() if k[0] == g)} for g in sorted(members)}


def _first_use(group: str, ranks: tuple, first: dict, sends: dict, recvs: dict) -> None:
    """NCCL creates a communicator at its first use, which every member must join: the members'
    first operations are all collectives, or all point-to-point batches that pair up with each
    other (each op of a rank's first batch meets its partner in the partner's first batch)."""
    kinds = {r: op.op in ("send", "recv") for r, op in first.items()}
    if not any(kinds.values()):
        return
    if not all(kinds.values()) or set(first) != set(ranks):
        late = sorted(set(ranks) - {r for r, k in kinds.items() if k})
        raise TraceError(f"group {group} {list(ranks)}: some members start with a point-to-point "
                         f"batch while rank(s) {late} do not take part in it; NCCL needs every "
                         "member in a group's first operation (an all-reduce on the group first "
                         "would create its communicator: collectives.ensure_ready)")
    for r, op in first.items():
        mine = [(k, i, o) for k, ops in list(sends.items()) + list(recvs.items()) if k[0] == group
                for i, o in enumerate(ops) if o.batch == op.batch and r == (k[1] if o.op == "send" else k[2])]
        for (g, src, dst), i, o in mine:
            peer = dst if o.op == "send" else src
            other = (recvs if o.op == "send" else sends).get((g, src, dst), [])
            if i < len(other) and other[i].batch != first[peer].batch:
                raise TraceError(f"group {group} {list(ranks)}: rank {r}'s first batch ({o}) meets "
                                 f"rank {peer} outside rank {peer}'s first batch; NCCL needs every "
                                 "member in a group's first operation")


def _same_sequence(group: str, ranks: tuple, seqs: dict, partial: bool = False) -> None:
    ref_rank = min(seqs) if seqs else None
    if ref_rank is None:
        return
    ref = seqs[ref_rank]
    for r, seq in sorted(seqs.items()):
        n = min(len(ref), len(seq))
        for i in range(n):
            if ref[i].key() != seq[i].key():
                raise TraceError(
                    f"group {group} {list(ranks)}: collective {i} differs: rank {ref_rank} posts "
                    f"{ref[i]}, rank {r} posts {seq[i]} (NCCL would hang or combine the wrong buffers)")
        if len(ref) != len(seq) and not partial:
            longer, extra = (ref_rank, ref[n]) if len(ref) > len(seq) else (r, seq[n])
            raise TraceError(f"group {group} {list(ranks)}: rank {ref_rank} posts {len(ref)} "
                             f"collectives, rank {r} {len(seq)}; the first unmatched, on rank "
                             f"{longer}: {extra}")


def _paired(key: tuple, sent: list, got: list, partial: bool = False) -> None:
    group, src, dst = key
    for i, (a, b) in enumerate(zip(sent, got)):
        if (a.numel, a.dtype) != (b.numel, b.dtype):
            raise TraceError(f"group {group}: send {i} from rank {src} to {dst} is {a.numel} x {a.dtype}, "
                             f"the receive posted for it {b.numel} x {b.dtype}")
    if len(sent) != len(got) and not partial:
        raise TraceError(f"group {group}: rank {src} posts {len(sent)} sends to rank {dst}, which "
                         f"posts {len(got)} receives from it")


def traced(fn, folder, rank, world_size, *args, **kwargs):
    """``fn(rank, world_size, *args, **kwargs)`` under a :class:`Recorder` writing to
    ``folder/rank{rank}.jsonl``: ``(result, ops)``."""
    with Recorder(rank_path(folder, rank)) as rec:
        out = fn(rank, world_size, *args, **kwargs)
    return out, rec.ops


def rank_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.jsonl")


@contextlib.contextmanager
def recording():
    """``with recording() as ops:`` this process's posted operations, appended to ``ops``."""
    with Recorder() as rec:
        yield rec.ops
