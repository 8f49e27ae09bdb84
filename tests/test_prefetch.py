"""Prefetched ZeRO weight gathers (``parallel/prefetch.py``) and the weight communicator (``groups.py``).

One world of 2 gloo ranks runs a 4-layer model planned ``ulysses, ring, metp, colossal`` and
records, per ZeRO linear, how it took its weight (a prefetch waited on, or gathered there),
when each prefetch was issued, and the layer's other collectives. Checked: every weight but
the first of a run of ZeRO layers (in forward and in backward order) was issued before the
compute that precedes its use (the previous linear's, and for the projection the attention
core's collectives), on the twin communicator; METP's broadcasts on the twin too; prefetch off
gives the same bits with every gather blocking; a wrong hint is dropped, never read.
Exactness against stock megatron-core with prefetch on (the default) is
``tests/test_strategies_exact.py`` (p = 2 and 4, mixed plans), ``test_packed_exact.py``,
``test_recompute_exact.py`` and ``test_cp_exact.py``.
"""
from __future__ import annotations

import pytest
import torch

from megatron_paradyse.testing.spawn import run_world

PLAN = ["ulysses", "ring", "metp", "colossal"]
NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
SPEC = dict(num_layers=4, hidden_size=64, num_attention_heads=4, bias=True)


def _names(model):
    """data_ptr of each ZeRO weight shard -> (layer, linear name)."""
    import megatron_paradyse as mp

    out = {}
    for i, layer in enumerate(mp.unwrap(model).decoder.layers):
        for mod in (layer.self_attention, layer.mlp):
            for n in NAMES:
                if hasattr(mod, n):
                    out[getattr(mod, n).weight.data_ptr()] = (i, n)
    return out


def _traced_pass(model, spec, tok, lab, T, prefetch, calls):
    """loss, grads, the trace (event, (layer, linear) or collective), the weight collectives
    and the communication pool of one fwd+bwd."""
    from megatron_paradyse.parallel.buffers import pool_sizes, release_pool

    names = _names(model)
    release_pool()
    prefetch.TRACE = trace = []
    model.zero_grad(set_to_none=True)
    loss = T.forward_backward(model, tok, lab)[0]
    prefetch.TRACE = None
    events = [(e, names[w.data_ptr()] if torch.is_tensor(w) else w) for e, w in trace]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads, events, list(calls), pool_sizes()


def _record_collectives(prefetch, calls):
    """Wrap the collectives: the layer's own go into the trace, the weight ones into ``calls``."""
    import torch.distributed as dist

    def tap(name, fn):
        def wrapper(*args, **kwargs):
            if prefetch.TRACE is not None:
                prefetch.TRACE.append(("comm", name))
                if name in ("all_gather_into_tensor", "broadcast"):
                    calls.append((name, kwargs.get("group"), bool(kwargs.get("async_op"))))
            return fn(*args, **kwargs)
        return wrapper

    for name in ("all_to_all_single", "batch_isend_irecv", "all_gather_into_tensor", "broadcast"):
        setattr(dist, name, tap(name, getattr(dist, name)))


def _world(rank, world):
    import megatron_paradyse as mp
    from megatron_paradyse.parallel import groups, prefetch
    from megatron_paradyse.parallel.strategies import zero3
    from megatron_paradyse.testing import models as T
    from megatron.core import parallel_state

    T.init_megatron(world)
    mp.install()
    tp = parallel_state.get_tensor_model_parallel_group()
    twin = groups.weight_group(tp)
    T.init_megatron(world)  # again: the twin is kept, not made twice (the old TP group is destroyed)
    tp = parallel_state.get_tensor_model_parallel_group()
    spec = T.TinyGPT(**SPEC)
    model = T.build_gpt(spec, world)
    mp.set_plan(model, PLAN)
    tok, lab = T.make_batch(spec, 2, 36, seed=3)
    calls = []
    _record_collectives(prefetch, calls)
    out = {"twin_ok": twin is not tp and twin is groups.weight_group(parallel_state.get_tensor_model_parallel_group())
           and torch.distributed.get_process_group_ranks(twin) == torch.distributed.get_process_group_ranks(tp)}
    on = _traced_pass(model, spec, tok, lab, T, prefetch, calls)
    out["calls_on"] = [(n, g is twin, a) for n, g, a in on[3]]
    calls.clear()
    with prefetch.disabled():
        off = _traced_pass(model, spec, tok, lab, T, prefetch, calls)
    calls.clear()
    real = zero3.hints

    def wrong(module, name, group):  # fc1's forward hint names the projection: the wrong weight
        fwd, bwd = real(module, name, group)
        return (zero3._within(module, "linear_proj", group) if name == "linear_fc1" else fwd), bwd

    zero3.hints = wrong
    bad = _traced_pass(model, spec, tok, lab, T, prefetch, calls)
    zero3.hints = real
    out.update(on=on[2], off=off[2], bad=bad[2], same_off=_same(on, off), same_bad=_same(on, bad),
               pool_on=on[4], pool_off=off[4])
    return out


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.fixture(scope="module")
def ranks():
    return run_world(_world, 2, timeout=300)


def _uses(events):
    """(forward, backward) lists of ((layer, linear), how the weight was taken)."""
    taken, out = None, []
    for e, what in events:
        if e in ("wait", "gather"):
            taken = e
        elif e == "use":
            out.append((what, taken))
    zero_layers = sum(1 for n in PLAN if n != "metp")
    return out[:4 * zero_layers], out[4 * zero_layers:]


def test_each_gather_is_issued_before_the_compute_that_precedes_its_use(ranks):
    for r in ranks:
        assert r["twin_ok"]
        fwd, bwd = _uses(r["on"])
        # a run of ZeRO layers gathers its first weight there, every later one was prefetched
        assert [w for w, how in fwd if how == "gather"] == [(0, "linear_qkv"), (3, "linear_qkv")]
        assert [w for w, how in bwd if how == "gather"] == [(3, "linear_fc2"), (1, "linear_fc2")]
        assert [w for w, _ in bwd] == [(i, n) for i in (3, 1, 0) for n in reversed(NAMES)]
        assert sum(how == "wait" for _, how in fwd + bwd) == 20
        assert not [e for e in r["on"] if e[0] == "drop"]
        ev = r["on"]
        forward_end = [k for k, x in enumerate(ev) if x[0] == "use"][len(fwd) - 1]
        for k, (e, what) in enumerate(ev):
            if e != "wait":
                continue
            start = max(i for i in range(k) if ev[i] == ("issue", what))
            between = ev[start + 1:k]
            assert any(x[0] == "use" and x[1] != what for x in between), (what, between)  # the compute before
            if what[1] == "linear_proj" and k < forward_end:
                # forward's projection: issued before the attention core, which ran before its use
                assert any(x[0] == "comm" and x[1] in ("all_to_all_single", "batch_isend_irecv")
                           for x in between), (what, between)


def test_weight_traffic_runs_on_the_twin_communicator(ranks):
    for r in ranks:
        calls = r["calls_on"]
        gathers = [c for c in calls if c[0] == "all_gather_into_tensor"]
        # 12 ZeRO linears, forward and backward: 20 prefetched (async), 4 gathered where used;
        # megatron's own gathers (biases, the sequence-parallel output layer) stay on the TP group
        assert sum(on_twin for _, on_twin, _ in gathers) == 24
        assert [on_twin for _, on_twin, a in gathers if a] == [True] * 20
        casts = [c for c in calls if c[0] == "broadcast"]
        assert casts and all(on_twin and a for _, on_twin, a in casts)  # metp's head-group weights


def test_prefetch_off_is_blocking_and_bitwise_equal(ranks):
    for r in ranks:
        assert r["same_off"]
        fwd, bwd = _uses(r["off"])
        assert len(fwd) == len(bwd) == 12 and all(how == "gather" for _, how in fwd + bwd)
        assert not [e for e in r["off"] if e[0] in ("issue", "wait")]


def test_a_wrong_hint_is_dropped_never_read(ranks):
    for r in ranks:
        assert r["same_bad"]
        drops = [w for e, w in r["bad"] if e == "drop"]
        assert drops == [(i, "linear_fc2") for i in (0, 1, 3)]


def test_a_prefetch_into_the_slot_in_use_is_refused():
    from megatron_paradyse.parallel import prefetch

    t = prefetch.Target(torch.zeros(2, 2), 0, None, 0)
    with pytest.raises(RuntimeError, match="holds the weight in use"):
        prefetch.issue(t, busy=t.slot)
    with prefetch.disabled():
        assert not prefetch.enabled() and t.slot == "weight0_0"
    assert prefetch.enabled() and prefetch.Target(t.shard, 1, None, 1).slot == "weight0_1"


def test_the_cost_model_prices_the_prefetched_weight(ranks):
    """The pool the ranks hold after the plan's fwd+bwd (largest rank, per buffer) is the analytic
    model's, prefetch on and off; on holds one more gathered weight (the larger of the
    projection and fc2) and its staged shard, no more."""
    from megatron_paradyse.costmodel import analytic
    from megatron_paradyse.costmodel.shape import ModelShape
    from megatron_paradyse.parallel import prefetch

    shape = ModelShape(num_layers=4, hidden=64, heads=4, query_groups=4, ffn=256, swiglu=False, bias=True,
                       vocab=512, dtype="fp32", p=2)
    cm = analytic.AnalyticCostModel(shape)
    for key, on in (("pool_on", True), ("pool_off", False)):
        got = {n: max(r[key].get(n, 0) for r in ranks) for n in set().union(*[r[key] for r in ranks])}
        want = {}
        for st in set(PLAN) | {"nonlayer"}:
            for n, v in analytic.pool_buffers(st, shape, 36, 2, prefetch=on).items():
                want[n] = max(want.get(n, 0), int(v))
        assert got == want, (on, got, want)
    zero = ["ulysses"] * 4
    on = cm.pool_bytes(zero, 36, 2)
    off = analytic.AnalyticCostModel(shape, prefetch=False)  # the cost model takes prefetch as an argument
    assert off.pool_bytes(PLAN, 36, 2) == sum(want.values())
    assert on - off.pool_bytes(zero, 36, 2) == 256 * 64 * 4  # fc2's weight, gathered whole
    with prefetch.disabled():  # the kernels' switch does not steer a cost model built with prefetch on
        assert cm.pool_bytes(zero, 36, 2) == on
    one = ModelShape(**dict(shape.key(), p=1))  # p = 1: nothing to prefetch, one slot
    assert analytic.zero_weight_pool(one, True) == analytic.zero_weight_pool(one, False)


def _trainer_world(rank, world, flags):
    """One training step of this repository's trainer per flag set: (prefetch on?, events)."""
    from megatron_paradyse.parallel import prefetch
    from megatron_paradyse.training import arguments, trainer as training

    out = []
    for extra in flags:
        argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "1",
                "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--attention-dropout", "0",
                "--hidden-dropout", "0", "--mock-data", "--tensor-model-parallel-size", "2",
                "--sequence-parallel", "--paradyse", "--paradyse-plan", "ulysses"] + extra
        args = arguments.parse_args(argv, world_size=world)
        prefetch.TRACE = trace = []
        training.Trainer(args).train(1)
        prefetch.TRACE = None
        out.append((prefetch.enabled(), sorted({e for e, _ in trace})))
    return out


def test_the_trainer_flag_turns_prefetch_off():
    from megatron_paradyse.training import arguments

    assert arguments.build_parser().get_default("paradyse_no_prefetch") is False  # on by default
    for [(on, events)] in run_world(_trainer_world, 2, [["--paradyse-no-prefetch"]], timeout=300):
        assert not on and events == ["gather", "use"]  # no gather posted ahead, none waited on
