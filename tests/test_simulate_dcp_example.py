"""Megatron's Dynamic CP example on the roofline (``bench/simulate_dcp_example.py``): its data,
its two schedulers, the H200 fit and a small run (about a second)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_paradyse.bench.simulate_dcp_example import (PUBLISHED, ExampleSetup, dcp_groups, dcp_needed, dcp_round,
                                                          dp_balanced_groups, example_lengths, h200_fit, main,
                                                          simulate_example, summary, trimmed_mean)

ST = ExampleSetup()
SMALL = dataclasses.replace(ST, gpus=(4, 8), iterations=8, warmup=2)


def test_the_lengths_are_megatrons_mock():
    """The mock draws 1M log-normals from NumPy's global generator seeded 0, mean 1024 (mu = ln
    1024 - sigma^2 / 2), clipped to [128, 8192]."""
    np.random.seed(0)
    ref = np.clip(np.random.lognormal(np.log(1024) - 1.5 ** 2 / 2, 1.5, 1000), 128, 8192).astype(int)
    assert example_lengths(1000, ST) == ref.tolist()
    lens = example_lengths(20000, ST)
    assert min(lens) == 128 and max(lens) == 8192 and 700 < np.mean(lens) < 1000


def test_dp_balanced_packs_in_order_and_splits_to_a_multiple_of_dp():
    st = dataclasses.replace(ST, cp=2, max_seqlen_per_rank=4096)    # packs of at most 8192 tokens
    g = dp_balanced_groups([5000, 3000, 2000, 100, 7000], 2, st)
    # next-fit: [5000, 3000], [2000, 100], [7000]; 3 packs -> [2000] and [100] split: 4 = 2 x DP
    assert [docs for _, docs in g] == [[5000, 3000], [2000], [7000], [100]]
    assert [ranks for ranks, _ in g] == [(0, 1), (2, 3), (0, 1), (2, 3)]


def test_dynamic_cp_sizes_and_rounds():
    assert [dcp_needed(s, ST) for s in (128, 2048, 2056, 4096, 4104, 8192)] == [1, 1, 2, 2, 4, 4]
    lens = sorted(example_lengths(64, ST), reverse=True)
    groups = dcp_groups(lens, 8, ST)
    placed = sorted(s for _, docs in groups for s in docs)
    assert placed == sorted(lens)                                   # every sequence once
    for ranks, docs in groups:
        c = len(ranks)
        assert c & (c - 1) == 0 and c >= max(dcp_needed(s, ST) for s in docs)
        assert sum(docs) / c <= ST.max_seqlen_per_rank              # the per-rank cap
    rnd, rest = dcp_round(lens, 8, ST)
    assert sum(size for size, _ in rnd) == 8                       # no empty rank in a round
    # workload balancing: the round's longest sequence alone bounds every rank's s^2 / c load
    cap = lens[0] * ST.max_seqlen_per_rank * 1.05
    assert all(sum(s * s for s in docs) / size <= cap * 2 for size, docs in rnd)
    assert len(rest) < len(lens)


def test_trimmed_mean_is_the_examples():
    assert trimmed_mean(list(range(20)), 0.1) == pytest.approx(np.mean(range(2, 18)))
    assert trimmed_mean([3.0, 1.0], 0.1) == 2.0


def test_the_h200_fit_goes_through_the_measurements():
    fit = h200_fit()
    rows = sorted(fit["rows"], key=lambda r: r["tokens"])
    assert [r["tokens"] for r in rows] == [4096, 8192]
    for r in rows:   # the check's own analytic FLOPs: the same shape
        assert r["measured_ms"] == pytest.approx(fit["rate_scale"] * r["roofline_ms"] + fit["fixed_ms"])
        assert r["roofline_ms"] < r["measured_ms"]
    assert rows[1]["flops"] == pytest.approx(5.5018531e12, rel=1e-6)


def test_a_small_run_and_what_moves_it():
    r = simulate_example(SMALL)
    by = {x["gpus"]: x for x in r["sizes"]}
    assert set(by) == {4, 8}
    for g, x in by.items():
        assert x["published"] == PUBLISHED[g][0] and x["dp"] == g // 4 and x["global_batch"] == 8 * (g // 4)
        assert x["error"] == pytest.approx(x["speedup"] / x["published"] - 1)
    # a fixed cost per CP hop is what the roofline lacks: it moves dp_balanced (CP 4 on every pack)
    # more than Dynamic CP (most sequences at CP 1)
    hop = simulate_example(dataclasses.replace(SMALL, hop_ms=0.3))
    assert hop["sizes"][0]["speedup"] > by[4]["speedup"] + 0.1
    out = summary(r)
    assert "1.285x" in out and "1.412x" in out and "SIMULATION" in out


def test_command_line(capsys):
    assert main(["--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "H200" in out and "0.3 ms per CP hop" in out and "| 4 | 1 | 8 |" in out
    for bad in (["--gpus", "6"], ["--overlap", "2"], ["--scale-out", "tcp"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2
