"""Data: preprocessing, the stdlib corpus, natural-length documents, bad data, the length-aware sampler.

Single-process and fast (no spawned world).
"""
import json
import logging
import os
import warnings

import numpy as np
import pytest

from megatron_paradyse import data


def _write_texts(root, texts):
    os.makedirs(root, exist_ok=True)
    for name, text in texts.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)


def test_preprocess_folder_and_jsonl(tmp_path):
    texts = {"a.txt": "hello", "sub/b.txt": "é" * 40, "sub/skip.md": "not matched", "empty.txt": ""}
    _write_texts(tmp_path / "in", texts)
    prefix = str(tmp_path / "out" / "docs")
    meta = data.preprocess(str(tmp_path / "in"), prefix, patterns=("*.txt",))
    assert meta["documents"] == ["a.txt", "sub/b.txt"] and meta["skipped_empty"] == 1
    assert meta["vocab_size"] == 258 and meta["eod"] == 256
    ds = data.DocumentDataset(prefix, seq_length=1000, shuffle=False, vocab_size=258)
    first = ds[0]
    assert first.tolist() == list(b"hello") + [256]  # bytes, then EOD
    assert len(ds[1]) == 81 and ds.names == ["a.txt", "sub/b.txt"]
    if meta.get("num_documents") and _has_matplotlib():
        assert os.path.getsize(prefix + ".lengths.png") > 1000
    # JSONL: one document per line, the text under --json-key
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"content": t}) for t in ("abc", "defgh")) + "\n")
    meta = data.preprocess(str(jl), str(tmp_path / "j"), json_key="content", histogram=False)
    assert meta["lengths"] == [4, 6]
    with pytest.raises(ValueError, match="no 'text' field"):
        data.preprocess(str(jl), str(tmp_path / "j2"), histogram=False)
    # the CLI (and scripts/preprocess_data.py's entry) report errors with exit code 2
    from megatron_paradyse.data.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["preprocess", "--input", str(tmp_path / "nothing"), "--output-prefix", str(tmp_path / "x")])
    assert e.value.code == 2


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_named_megatron_core_tokenizer(tmp_path):
    from megatron.core.tokenizers import MegatronTokenizer

    os.makedirs(tmp_path / "tok")
    MegatronTokenizer.write_metadata(tokenizer_path=str(tmp_path / "tok"), tokenizer_library="byte-level",
                                     overwrite=True)
    tok = data.build_tokenizer(str(tmp_path / "tok"))
    assert tok.vocab_size == 512 and tok.tokenize("hé").tolist() == [104, 195, 169]
    with pytest.raises(ValueError, match="not 'byte' and not a tokenizer directory"):
        data.build_tokenizer(str(tmp_path / "missing"))


def test_natural_lengths_split_skip_error(tmp_path, caplog):
    docs = [np.arange(n) % 50 for n in (3, 1, 40, 200, 7)]
    prefix = str(tmp_path / "docs")
    data.write_indexed_dataset(prefix, docs, 50)
    split = data.DocumentDataset(prefix, seq_length=64, shuffle=False, long_docs="split")
    # 200 ids = 199 training tokens -> chunks of 64, 64, 64, 7 training tokens
    assert sorted(len(split[i]) - 1 for i in range(len(split))) == sorted([2, 39, 6, 64, 64, 64, 7])
    # every token of the long document is predicted exactly once, in order
    chunks = [split[i] for i in range(len(split)) if split.sample_docs[split._sample_for(i)] == 3]
    labels = np.concatenate([c[1:] for c in chunks])
    assert labels.tolist() == (np.arange(1, 200) % 50).tolist()
    assert [split.length(i) for i in range(len(split))] == [len(split[i]) - 1 for i in range(len(split))]
    skip = data.DocumentDataset(prefix, seq_length=64, shuffle=False, long_docs="skip")
    assert sorted(len(skip[i]) for i in range(len(skip))) == [3, 7, 40]
    with pytest.raises(ValueError, match=r"document 3 \(199 tokens\)"):
        data.DocumentDataset(prefix, seq_length=64, long_docs="error")
    # a planner limit below --seq-length: the documents above it are named in a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_paradyse"):
        fit = data.DocumentDataset(prefix, seq_length=64, long_docs="split", max_length=32)
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("megatron_paradyse")]
    assert max(fit.length(i) for i in range(len(fit))) == 32
    assert len(msgs) == 1 and "document 2 (39 tokens)" in msgs[0] and "memory budget" in msgs[0]
    with pytest.raises(ValueError, match="long_docs"):
        data.DocumentDataset(prefix, seq_length=64, long_docs="bogus")


def test_bad_data_errors(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    data.write_indexed_dataset(a, [np.arange(10), np.arange(20)], 300)
    data.write_indexed_dataset(b, [np.arange(5)], 300)
    with pytest.raises(data.DataError, match=r"nope\.idx not found"):
        data.DocumentDataset(str(tmp_path / "nope"), 16)
    os.replace(b + ".idx", a + ".idx")  # a's .bin with b's .idx
    with pytest.raises(ValueError, match="does not match"):
        data.DocumentDataset(a, 16)
    with open(b + ".idx", "wb") as fh:
        fh.write(b"garbage")
    open(b + ".bin", "wb").close()
    with pytest.raises(ValueError, match="not a megatron-core index"):
        data.DocumentDataset(b, 16)
    c = str(tmp_path / "c")
    data.write_indexed_dataset(c, [np.array([1, 2, 299])], 300)
    with pytest.raises(ValueError, match="token id 299 is outside the vocabulary"):
        data.DocumentDataset(c, 16, vocab_size=258)
    e = str(tmp_path / "e")
    data.write_indexed_dataset(e, [np.array([1]), np.array([2])], 300)
    with pytest.raises(ValueError, match="empty dataset"):
        data.DocumentDataset(e, 16)
    os.makedirs(tmp_path / "emptydir")
    with pytest.raises(ValueError, match="no non-empty document"):
        data.preprocess(str(tmp_path / "emptydir"), str(tmp_path / "f"))


def test_stdlib_corpus(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    prefix = data.stdlib_corpus(cache)
    stamp = os.path.getmtime(prefix + ".bin")
    assert data.stdlib_corpus(cache) == prefix  # cached: not rebuilt
    assert os.path.getmtime(prefix + ".bin") == stamp
    ds = data.DocumentDataset(prefix, 4096, long_docs="split", vocab_size=258)
    docs = np.asarray(data.DocumentDataset(prefix, 1 << 40, shuffle=False).sample_lengths()) + 1
    assert ds.num_documents > 100 and docs.max() > 100 * np.median(docs) / 10  # long-tailed
    assert "os.py" in ds.names and not any(n.startswith("test/") for n in ds.names)
    assert max(ds.length(i) for i in range(200)) == 4096


def _lengths_dataset(lengths):
    class DS:
        def __len__(self):
            return len(lengths)

        def length(self, i):
            return int(lengths[i % len(lengths)])

        def __getitem__(self, i):
            return np.zeros(self.length(i) + 1, dtype=np.int64)
    return DS()


def test_length_aware_sampler():
    rng = np.random.default_rng(0)
    lens = np.exp(rng.uniform(np.log(8), np.log(4096), size=4096)).astype(int)
    ds = _lengths_dataset(lens)
    gbs, mbs, dp, window = 16, 2, 2, 8
    s = data.LengthAwareSampler(ds, mbs, gbs, dp, seed=3, window_steps=window, multiple=4,
                                cost_fn=data.make_cost_fn(fallback="s2"))
    steps = [s.step_indices(k) for k in range(2 * window)]
    flat = [i for st in steps for per in st for mb in per for i in mb]
    assert sorted(flat) == list(range(2 * window * gbs))  # every sample once, none twice
    assert all(len(per) == gbs // (mbs * dp) and all(len(mb) == mbs for mb in per) for st in steps for per in st)
    # reproducible for a seed; another seed gives other steps
    again = data.LengthAwareSampler(ds, mbs, gbs, dp, seed=3, window_steps=window, multiple=4,
                                    cost_fn=data.make_cost_fn(fallback="s2"))
    assert [again.step_indices(k) for k in reversed(range(2 * window))] == steps[::-1]
    other = data.LengthAwareSampler(ds, mbs, gbs, dp, seed=4, window_steps=window, multiple=4)
    assert [other.step_indices(k) for k in range(window)] != steps[:window]

    # similar lengths per micro-batch (less padding) and balanced predicted work across replicas
    def pad_frac(mbs_list):
        real = sum(lens[i] for mb in mbs_list for i in mb)
        run = sum(len(mb) * max(lens[i] for i in mb) for mb in mbs_list)
        return 1 - real / run

    def imbalance(per_step):  # mean over steps of max/mean replica load (s^2)
        out = []
        for st in per_step:
            loads = [sum(max(lens[i] for i in mb) ** 2 * len(mb) for mb in per) for per in st]
            out.append(max(loads) / np.mean(loads))
        return float(np.mean(out))
    seq = [[[data.sample_indices(k, m, gbs, mbs, r, dp) for m in range(gbs // (mbs * dp))] for r in range(dp)]
           for k in range(2 * window)]
    assert pad_frac([mb for st in steps for per in st for mb in per]) < 0.2 * pad_frac(
        [mb for st in seq for per in st for mb in per])
    assert imbalance(steps) < 1.1 and imbalance(seq) > 1.3  # measured 1.05 vs 1.48
    # the loader resumes exactly: starting at step 5 reads what the uninterrupted loader reads
    full = data.MicroBatchLoader(ds, mbs, gbs, 1, dp, 4, sampler=s)
    ref = [next(full).lengths for _ in range(10 * 4)]
    resumed = data.MicroBatchLoader(ds, mbs, gbs, 1, dp, 4, consumed_samples=5 * gbs, sampler=again)
    assert [next(resumed).lengths for _ in range(5 * 4)] == ref[5 * 4:]
    assert data.step_lengths(ds, 0, gbs, sampler=s) == [lens[i] for per in steps[0] for mb in per for i in mb]


def test_cost_fn_from_a_cost_model():
    from megatron_paradyse.costmodel.base import CostModel, LayerCost

    class Toy(CostModel):
        strategies, num_layers = ("tp_sp",), 2

        def layer(self, strategy, s, b):
            return LayerCost(1e-6 * s * s * b, 0.0, 0.0)

        def static_bytes(self):
            return 0.0
    f = data.make_cost_fn(cost_model=Toy())
    assert f(100, 1) == pytest.approx(2e-2)

    class Planner:
        def plan(self, s, b):
            return type("C", (), {"seconds": float(s + b)})()
    assert data.make_cost_fn(planner=Planner())(10, 2) == 12.0

    class Fits:
        def plan(self, s, b):
            return type("C", (), {"fits": s * b <= 1000})()
    assert data.longest_fitting(Fits(), 1, 4096, 4) == 1000 and data.longest_fitting(Fits(), 2, 4096, 4) == 500
    assert data.longest_fitting(Fits(), 1, 512, 4) == 512 and data.longest_fitting(Fits(), 2000, 4096, 4) == 0
    with warnings.catch_warnings():
        with pytest.raises(ValueError):
            data.make_cost_fn(fallback="bogus")
