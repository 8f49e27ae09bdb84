"""The profiler measures the layer training runs, on the rank's device, and survives running
out of memory on some ranks.

* The profiler's model flags give the trainer's ``TransformerConfig`` (every field) for the
  same command-line flags, fusion switches included, completed for a CUDA device and for the
  CPU (``complete_model`` takes the device; no GPU is needed to compare).
* The single-device mode (one process as rank 0 of a fake 4-rank group) builds through the
  trainer's builder: with RMSNorm under sequence parallelism and the CPU's sequence-parallel
  norm shim switched off (as on a GPU host, where no shim applies) the layer builds and runs.
* Out of memory is decided by all ranks together: on a 2-rank gloo world, rank 1 alone runs
  out of memory at one length of one strategy (after the pass's collectives, in its
  measurement), both ranks at another, rank 1 alone in a timed pass of a third: the sweep
  finishes on both ranks, both record the same skips, and the other strategies and lengths
  are profiled.
* The cost model imports neither the test helpers nor the trainer.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_paradyse.costmodel import measure as M
from megatron_paradyse.costmodel import profile as P

TRAIN_ONLY = ["--micro-batch-size", "1", "--seq-length", "512", "--train-iters", "1", "--lr", "1e-4",
              "--mock-data"]
MODELS = {
    "gqa-swiglu-rmsnorm": ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8",
                           "--group-query-attention", "--num-query-groups", "2", "--swiglu",
                           "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type",
                           "rope", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--vocab-size", "258",
                           "--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--untie-embeddings-and-output-weights", "--no-bias-swiglu-fusion",
                           "--no-masked-softmax-fusion"],
    "gelu-bias-fusions-on": ["--num-layers", "3", "--hidden-size", "256", "--num-attention-heads", "4",
                             "--ffn-hidden-size", "640", "--position-embedding-type", "rope",
                             "--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "1000",
                             "--tensor-model-parallel-size", "4", "--sequence-parallel", "--norm-epsilon", "1e-6",
                             "--init-method-std", "0.01", "--untie-embeddings-and-output-weights"],
}


def _fields(config) -> dict:
    def norm(v):
        if isinstance(v, functools.partial):  # init methods: a new partial per config
            return (v.func, v.args, tuple(sorted(v.keywords.items())))
        return v

    return {f.name: norm(getattr(config, f.name)) for f in dataclasses.fields(config)}


@pytest.mark.parametrize("dev", ["cuda", "cpu"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_profiler_config_equals_trainers(name, dev, monkeypatch):
    from megatron_paradyse.training.arguments import parse_args, transformer_config_from_args

    flags = MODELS[name] + (["--bf16"] if dev == "cuda" and "fusions" in name else [])
    tp = int(flags[flags.index("--tensor-model-parallel-size") + 1])
    if dev == "cuda":  # the trainer checks that nccl has CUDA; the completion needs none
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    targs = parse_args(flags + TRAIN_ONLY + ["--distributed-backend", "nccl" if dev == "cuda" else "gloo"],
                       world_size=tp)
    pargs = P.build_parser().parse_args(flags + ["-o", "unused.jsonl"])
    done = M.complete({k: getattr(pargs, k) for k in M.model_flag_names()}, tp, torch.device(dev), max_seq=512)
    want, got = _fields(transformer_config_from_args(targs)), _fields(M.model_config(done))
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    from megatron_paradyse.training.model_args import shape_from_args

    assert M.shape_of(done) == shape_from_args(targs)
    if dev == "cuda" and "fusions" in name:  # the switches left on by the flags are on for CUDA
        assert got["bias_activation_fusion"] and got["bias_dropout_fusion"]
        # masked softmax: on where megatron's extension is installed (never here, nor on the H100 image)
        assert got["masked_softmax_fusion"] == (importlib.util.find_spec("scaled_masked_softmax_cuda") is not None)
        assert got["bf16"] and got["params_dtype"] == torch.bfloat16
    if dev == "cpu":
        assert not got["masked_softmax_fusion"] and not got["bias_activation_fusion"]


def test_profiler_refuses_query_groups_the_trainer_would_ignore():
    with pytest.raises(SystemExit):
        P.main(["--p", "2", "--num-query-groups", "2", "--seqs", "64", "-o", "unused.jsonl"])


def test_fake_mode_builds_through_the_trainers_builder(tmp_path, monkeypatch):
    # without the CPU's sequence-parallel norm shim megatron's WrappedTorchNorm refuses
    # sequence parallelism (what the GPU host saw); the builder's SP norm needs no shim
    monkeypatch.setenv("PARADYSE_CPU_SHIMS_SKIP", "sp_norm")
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--normalization",
             "RMSNorm", "--swiglu", "--vocab-size", "100"]
    pargs = P.build_parser().parse_args(flags + ["--p", "4", "-o", "unused"])
    model_args = {k: getattr(pargs, k) for k in M.model_flag_names()}
    shape = P.shape_of_flags(model_args, 4)
    cfg = P.ProfileConfig(seqs=[64], strategies=["tp_sp", "ulysses"], parts=["layer"], warmup=0, repeats=1,
                          nonlayer=False, fake_world=4, fake_rank=0, command="test", model_args=model_args,
                          backend="gloo")  # the CPU plays the rank (on a GPU host the default is its GPU)
    rows = P.run_profile(shape, cfg, out=str(tmp_path / "fake.jsonl"), timeout=180)
    head = rows[0]
    assert head["mode"] == "fake" and head["hardware"]["device"] == "cpu"
    assert head["model"]["normalization"] == "RMSNorm" and head["model"]["sequence_parallel"]
    layers = {(r["strategy"], r["s"]) for r in rows if r["type"] == "layer"}
    assert layers == {("tp_sp", 64), ("ulysses", 64)}


# ------------------------------------------------------------------------------- out of memory

OOM_SEQS = [32, 64, 128]
OOM_STRATS = ["tp_sp", "ulysses", "ring", "metp"]


def _oom_world(rank, world, shape_d, cfg):
    """A profiler rank whose measurements run out of memory where the test says."""
    from megatron_paradyse.costmodel import measure
    from megatron_paradyse.costmodel.sweep import rank_sweep

    current = {}
    set_strategy, memory, timed = measure.set_strategy, measure.LayerRunner.memory, measure.LayerRunner.time

    def oom(what):
        return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected: {what})")

    def set_strategy_(model, name):
        current["st"] = name
        set_strategy(model, name)

    def memory_(self, part, s, b, passes=2):
        if current["st"] == "ulysses" and s == 128:  # every rank, at the start of the pass
            raise oom("ulysses, every rank")
        out = memory(self, part, s, b, passes)  # the pass's collectives ran on every rank
        if rank == 1 and current["st"] in ("ring", "metp:rc") and s == 64:
            raise oom(f"{current['st']}, rank 1 alone")
        return out

    def time_(self, part, s, b, warmup=1, repeats=3):
        out = timed(self, part, s, b, warmup, repeats)
        if rank == 1 and current["st"] == "tp_sp" and s == 128 and repeats > 0:  # a timed pass
            raise oom("tp_sp timed, rank 1 alone")
        return out

    measure.set_strategy = set_strategy_
    measure.LayerRunner.memory = memory_
    measure.LayerRunner.time = time_
    return rank_sweep(rank, world, shape_d, cfg)


@pytest.mark.slow(reason="a profiler world whose ranks run out of memory together")
def test_out_of_memory_is_skipped_by_every_rank_together():
    from megatron_paradyse.costmodel import demo_shape
    from megatron_paradyse.costmodel.profile import ProfileConfig, merge_ranks
    from megatron_paradyse.costmodel.ranks import run_ranks

    shape = demo_shape(2)
    cfg = ProfileConfig(seqs=OOM_SEQS, strategies=OOM_STRATS, parts=["layer"], warmup=1, repeats=1,
                        nonlayer=False, recompute_points=3)
    per_rank = run_ranks(_oom_world, 2, shape.key(), cfg, timeout=150)  # a hang would end here as RankError

    def cells(rows):
        return [(r["type"], r.get("strategy"), r.get("s"), r.get("b")) for r in rows]

    assert cells(per_rank[0]) == cells(per_rank[1])  # the same rows, in the same order
    limits = {(r["strategy"], r["s"]): (r["reason"], r["oom_ranks"]) for r in per_rank[0] if r["type"] == "limit"}
    assert limits == {("ring", 64): ("out of memory on rank(s) [1]", [1]),
                      ("ulysses", 128): ("out of memory on rank(s) [0, 1]", [0, 1]),
                      ("tp_sp", 128): ("out of memory on rank(s) [1]", [1])}
    assert [r for r in per_rank[0] if r["type"] == "limit"] == \
        [dict(r, rank=0) for r in per_rank[1] if r["type"] == "limit"]
    merged = merge_ranks(per_rank)
    layers = {(r["strategy"], r["s"]) for r in merged if r["type"] == "layer"}
    assert layers == {("tp_sp", 32), ("tp_sp", 64), ("ulysses", 32), ("ulysses", 64), ("ring", 32),
                      ("metp", 32), ("metp", 64), ("metp", 128)}
    for r in merged:
        if r["type"] == "layer":
            assert r["layer_seconds"] > 0 and r["saved_bytes"] > 0 and len(r["layer_times"]) >= 1
    # the recompute phase at the lengths each strategy fit; metp:rc out of memory on rank 1 alone
    # at 64: skipped by both ranks, with its own limit row (the layer sweep's limits untouched)
    rc = {(r["strategy"], r["s"]) for r in merged if r["type"] == "recompute"}
    assert rc == {("tp_sp", 32), ("tp_sp", 64), ("ulysses", 32), ("ulysses", 64), ("ring", 32), ("metp", 32)}
    assert [(r["strategy"], r["s"], r["oom_ranks"]) for r in per_rank[0] if r["type"] == "recompute_limit"] \
        == [("metp", 64, [1])]


# ------------------------------------------------------------------------------------ layering


def test_costmodel_imports_neither_testing_nor_training():
    root = Path(M.__file__).resolve().parent
    bad = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                if any(part in ("testing", "training") for part in n.split(".")) and not n.startswith("torch"):
                    bad.append(f"{path.name}:{node.lineno} imports {n}")
    assert not bad, bad
