"""``python -m megatron_paradyse.bench.host_time`` (docs/gpu.md): its bad flags, its
packs and its host-only layout table, in this process (the micro-batch world is left to runs
of the command: it spawns ranks)."""
import pytest

from megatron_paradyse.bench import host_time as H


def test_bad_flags_are_one_line_and_exit_status_2(capsys):
    for argv, needle in ((["--p", "0"], "--p"), (["--strategies", "nope"], "--strategies"),
                         (["--layers", "1,x"], "--layers"), (["--tokens", "8", "--doc-len", "16"], "--doc-len"),
                         (["--heads", "3", "--p", "2"], "--heads")):
        with pytest.raises(SystemExit) as e:
            H.main(argv + ["--skip-world"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and err.count("error:") == 1, err


def test_packs_are_new_orders_of_the_same_documents():
    cfg = H.HostConfig(tokens=512, doc_len=8, repeats=3)
    ps = H.packs(cfg, 2)
    assert len(ps) == 4 and all(sum(x) == 1024 and sorted(x) == sorted(ps[0]) for x in ps)
    assert len({tuple(x) for x in ps}) == 4 and max(ps[0]) <= 15


def test_layout_table_and_slope(capsys):
    cfg = H.HostConfig(tokens=256, doc_len=8, repeats=2)
    rows = H.layout_rows(cfg, 2)
    assert len(rows) >= 5 and all(ms is None or ms >= 0 for _, ms, _ in rows)
    assert H.split({1: 10.0, 4: 25.0}) == (5.0, 5.0)
    text = H.world_table(cfg, 2, {1: {st: 10.0 for st in cfg.strategies}, 4: {st: 25.0 for st in cfg.strategies}})
    assert "tp_sp" in text and "5.0" in text
    assert H.main(["--tokens", "128", "--doc-len", "8", "--repeats", "1", "--skip-world"]) == 0
    assert "PackedLayout(p=1, docs)" in capsys.readouterr().out


def test_json_folder_is_made_before_measuring(tmp_path):
    from megatron_paradyse.bench import host_time

    out = tmp_path / "new" / "h.json"
    _, a = host_time.parse(["--tokens", "256", "--p", "1", "--json", str(out)])
    assert out.parent.is_dir() and a.json == str(out)
