"""Dynamic CP: in one world of 8 gloo ranks (a pool of 4 nodes x p = 2), a step of rounds
whose micro-batches run at a CP size c that changes within the step (4; 2 and 2; 2, 1 and 1;
1 four times), each with a random plan over every strategy (and ``:rc``), packed and unpacked
(one document), gives stock megatron-core TP = 1's loss sum and every gradient on the same
documents (fp32, relative error < 1e-5), once the gradients are summed over the pool (DDP's
reduction). The collective trace shows the c each micro-batch ran at: each micro-batch's
operations on the Dynamic CP groups are on its block's group of c ranks alone (none at c = 1),
and the whole world's trace keeps NCCL's ordering rule.

Stock megatron-core runs Dynamic CP only with Transformer Engine on its ``dev`` line, so the
reference is stock TP = 1 without CP, document by document.
"""
import random
from types import SimpleNamespace as NS

import megatron_paradyse as mp
from megatron_paradyse.testing.spawn import run_world

from .exactness import REL_TOL, rel_err

P, NODES = 2, 4
SPEC = dict(num_layers=3, hidden_size=64, num_attention_heads=4, bias=True)
LENGTHS = (77, 30, 5, 61, 20, 41, 3, 9, 14, 33, 50, 12, 90, 17, 6, 25, 40, 8, 19)
# rounds of (first node, c, documents): every round's blocks partition the 4 nodes
ROUNDS = (
    ((0, 4, (0, 1, 2)),),
    ((0, 2, (3,)), (2, 2, (4, 5, 6))),
    ((0, 1, (7, 8)), (1, 1, (9,)), (2, 2, (10, 11))),
    ((0, 1, (15,)), (1, 1, (16, 17)), (2, 1, (18,)), (3, 1, (14,))),
    ((0, 2, (12,)), (2, 1, (13,)), (3, 1, ())),
)
ALL = ("tp_sp", "ulysses", "ring", "colossal", "metp")


def _schedule(num_layers):
    rng = random.Random(47)
    return [tuple(NS(first=f, size=c, documents=d,
                     plan=tuple(rng.choice(ALL) + rng.choice(("", ":rc")) for _ in range(num_layers)))
                  for f, c, d in round_) for round_ in ROUNDS]


def _document(i, vocab):
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, vocab, (LENGTHS[i] + 1,), generator=g)


def _pack(documents, vocab, unit):
    """Tokens, labels, in-document positions, the loss mask and the lengths of a pack of
    ``documents``, padded by a trailing padding document to a multiple of ``unit``."""
    import torch

    lengths = [LENGTHS[i] for i in documents]
    pad = (-sum(lengths)) % unit or (unit if not lengths else 0)
    docs = [_document(i, vocab) for i in documents] + ([torch.zeros(pad + 1, dtype=torch.long)] if pad else [])
    lengths += [pad] if pad else []
    tokens = torch.cat([d[:-1] for d in docs]).unsqueeze(0)
    labels = torch.cat([d[1:] for d in docs]).unsqueeze(0)
    positions = torch.cat([torch.arange(d) for d in lengths]).unsqueeze(0)
    mask = torch.ones_like(tokens, dtype=torch.float32)
    mask[:, tokens.shape[1] - pad:] = 0
    return (tokens, labels, positions, mask), lengths


def _micro_batch(model, groups, item, vocab):
    """This rank's share of ``item``'s micro-batch at its block's c: the masked loss sum, backward."""
    from megatron_paradyse.parallel import context, dynamic_cp

    from .test_packed_exact import _params

    place = groups.place(item)
    dynamic_cp.use_place(place)
    c, rank = (place.size, place.rank) if place is not None else (1, 0)
    (tokens, labels, positions, mask), lengths = _pack(item.documents, vocab, 2 * c * P)
    tokens, labels, positions, mask = (context.split_for_cp(t, c, rank) for t in (tokens, labels, positions, mask))
    mp.set_plan(model, list(item.plan))
    loss = (model(tokens, positions, None, labels=labels, packed_seq_params=_params(lengths)) * mask).sum()
    loss.backward()
    return loss.detach()


def _reference(spec):
    """Stock TP = 1, document by document: the loss sum and every gradient."""
    import torch

    from megatron_paradyse.testing import models as T

    model = T.build_gpt(spec, 1)
    loss = sum(model(d[:-1].unsqueeze(0), torch.arange(LENGTHS[i]).unsqueeze(0), None, labels=d[1:].unsqueeze(0)).sum()
               for i, d in ((i, _document(i, spec.vocab_size)) for i in range(len(LENGTHS))))
    loss.backward()
    return {"loss": loss.detach(), "grads": T.gather_full(model, "grad")}


def run_dynamic(rank, world):
    """The rounds under Dynamic CP on the 8 ranks; then, in the same world re-initialised at
    TP = 1, rank 0's stock reference (its model runs stock code: no plan is set on it)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_paradyse import trace
    from megatron_paradyse.parallel import dynamic_cp
    from megatron_paradyse.testing import models as T

    T.init_megatron(P)
    spec = T.TinyGPT(**SPEC)
    mp.install()
    groups = dynamic_cp.DynamicCPGroups(P)
    dynamic_cp.enable(groups)
    model = T.build_gpt(spec, P)
    names = {g.group_name: key for key, g in groups.by_block.items()}
    total, ran = torch.zeros(()), []
    for round_ in _schedule(spec.num_layers):
        item = dynamic_cp.mine(round_, groups.node)
        with trace.recording() as ops:  # inside the world's own trace
            total += _micro_batch(model, groups, item, spec.vocab_size)
        ran.append(((item.first, item.size), sorted({(names[op.group], len(op.members)) for op in ops
                                                     if op.group in names})))
    T.allreduce_sequence_parallel_grads(model)
    pool = ps.get_data_parallel_group()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=pool)
    dist.all_reduce(total, group=pool)
    out = {"loss": total, "grads": T.gather_full(model, "grad"), "ran": ran}
    dynamic_cp.disable()
    T.init_megatron(1)
    if rank == 0:
        out["ref"] = _reference(spec)
    return out


def test_dynamic_cp_rounds_match_stock_tp1():
    ranks = run_world(run_dynamic, NODES * P, timeout=600, trace=True)
    got, ref = ranks[0], ranks[0]["ref"]
    errs = {"loss": rel_err(got["loss"], ref["loss"]),
            "grad": max(rel_err(got["grads"][k], ref["grads"][k]) for k in ref["grads"])}
    assert set(got["grads"]) == set(ref["grads"])
    assert max(errs.values()) < REL_TOL, errs
    for r, out in enumerate(ranks):  # each micro-batch's operations on the Dynamic CP groups: its block's, of c ranks
        for block, seen in out["ran"]:
            assert seen == ([(block, block[1])] if block[1] > 1 else []), f"rank {r}: a micro-batch on {block} posted {seen}"
    print("worst rel. errors under Dynamic CP:", {k: f"{v:.1e}" for k, v in errs.items()})


def test_dynamic_cp_flags_are_checked_before_any_collective():
    """Every Dynamic CP combination that cannot run is one line, raised while parsing (every rank
    parses the same flags), before torch.distributed starts; a caller that does not run it refuses the
    flag for now, and the layout check refuses Dynamic CP without the per-token loss."""
    import pytest

    from megatron_paradyse.layout import ParallelDims
    from megatron_paradyse.training.arguments import ArgumentError, parse_args
    from megatron_paradyse.training.dims import LayoutError, check_layout

    from .test_training import _argv

    dcp = ["--dynamic-context-parallel", "--paradyse-plan", "tp_sp", "--micro-batch-size", "1", "--global-batch-size", "8"]
    cases = [
        (_argv(2, dcp), 8, "--dynamic-context-parallel needs --paradyse"),
        (_argv(2, dcp + ["--paradyse", "--pipeline-model-parallel-size", "2"]), 8, "with --pipeline-model-parallel"),
        (_argv(2, dcp[:-1] + ["6", "--paradyse"]), 6, "pool of DP x CP = 3 nodes"),
        (_argv(2, dcp + ["--paradyse", "--min-dynamic-context-parallel-size", "8"]), 8, "from 1 to the pool"),
        (_argv(2, dcp + ["--paradyse", "--min-dynamic-context-parallel-size", "3"]), 8, "must be a power of two"),
        (_argv(2, dcp + ["--paradyse", "--max-seqlen-per-dp-cp-rank", "7"]), 8, "positive multiple of"),
        (_argv(2, dcp + ["--paradyse", "--cp-comm-type", "a2a"]), 8, "--cp-comm-type a2a"),
        (_argv(2, ["--hybrid-context-parallel"] + dcp[1:] + ["--paradyse", "--context-parallel-size", "3"]), 6,
         "pool of DP x CP = 3 nodes"),
        (_argv(2, dcp + ["--paradyse", "--paradyse-pack", "greedy"]), 8, "packs each step's documents itself"),
    ]
    for argv, world, needle in cases:
        with pytest.raises(ArgumentError, match=needle.replace("-", r"\-").replace("(", r"\(")) as e:
            parse_args(argv, world_size=world)
        assert "\n" not in str(e.value)
    parse_args(_argv(2, dcp[:1] + dcp[3:] + ["--paradyse"]), world_size=8)  # the planner: accepted
    args = parse_args(_argv(2, dcp + ["--paradyse", "--context-parallel-size", "2"]), world_size=8)
    assert args.paradyse_dims == ParallelDims(tp=2, dp=4, sequence_parallel=True, dynamic_cp=True)
    dims = ParallelDims(tp=2, dp=4, sequence_parallel=True, dynamic_cp=True)
    with pytest.raises(LayoutError, match="needs --calculate-per-token-loss"):
        check_layout(dims, paradyse=True, dynamic_cp_runs=True, per_token_loss=False)
    with pytest.raises(LayoutError, match="is not supported here"):
        check_layout(dims, paradyse=True)
