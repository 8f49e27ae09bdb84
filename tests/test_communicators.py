"""Every communicator exists before the budget is measured (``parallel/communicators.py``).

A traced gloo world trains with ``--paradyse`` at TP = 2 x CP = 2 and at TP = 2 x DP = 2
(``metp``, ``ring`` and ``ulysses`` layers: the weight twins, the CP ring, the data-parallel
reductions): on every rank, every process group's first operation is the one-element
all-reduce of ``create_all``, made when megatron's parallel state was initialised, and nothing a
training step posts creates a communicator.
"""
from __future__ import annotations

import pytest

from megatron_paradyse.testing.spawn import run_world

ARGV = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
    "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "1",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "1e-3", "--train-iters", "2",
    "--mock-data", "--paradyse-mock-min-length", "16", "--seed", "7", "--log-interval", "1",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--paradyse",
    "--paradyse-plan", "metp+ring",
]


def _world(rank, world, extra):
    from megatron_paradyse.parallel import communicators, groups
    from megatron_paradyse import trace
    from megatron_paradyse.training import arguments, trainer as training

    args = arguments.parse_args(ARGV + list(extra), world_size=world)
    with trace.recording() as ops:
        tr = training.Trainer(args)
        made = groups.created()
        mine = {pg.group_name for pg in communicators.member_groups()}
        warmed = len(ops)
        tr.train()
    return dict(made=made, mine=mine, ops=ops, warmed=warmed)


@pytest.mark.parametrize("extra", [["--context-parallel-size", "2", "--global-batch-size", "1"],
                                   ["--global-batch-size", "4"]], ids=["cp2", "dp2"])
def test_every_group_is_created_before_the_first_step(extra):
    got = run_world(_world, 4, extra, timeout=300, trace=True)
    for rank, r in enumerate(got):
        made = r["made"]
        assert made is not None and made.groups == len(r["mine"]) and made.device_bytes is None
        first = {}
        for i, op in enumerate(r["ops"]):
            first.setdefault(op.group, (i, op))
        used_in_steps = {op.group for op in r["ops"][r["warmed"]:] if len(op.members) > 1}
        assert used_in_steps and used_in_steps <= r["mine"], (rank, used_in_steps - r["mine"])
        for g in used_in_steps:  # first used at start-up, by a collective of every member
            i, op = first[g]
            assert i < r["warmed"] and op.op not in ("send", "recv"), (rank, g, op)
