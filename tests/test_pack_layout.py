"""The packed ring layout: every visible (query, key) pair exactly once, balance, one-document
equivalence with the zig-zag layout, and the hops a pack needs (no ranks: pure functions)."""
import random

import pytest

from megatron_paradyse.parallel.pack_layout import PackedLayout
from megatron_paradyse.parallel.packing import Documents, PackShape, check_cu_seqlens
from megatron_paradyse.parallel.zigzag import RingLayout


def _docs(lengths):
    bounds = [0]
    for d in lengths:
        bounds.append(bounds[-1] + d)
    return Documents(tuple(bounds))


def _visible(docs, lay, rank, src):
    """Every (query position, key position) pair rank's queries must see of src's keys."""
    qs = [pos for a, b in lay.ranges(rank) for pos in range(a, b)]
    ks = [pos for a, b in lay.ranges(src) for pos in range(a, b)]
    return {(i, j) for i in qs for j in ks if j <= i and docs.doc_of(i) == docs.doc_of(j)}


def _positions(lay, rank):
    return [pos for a, b in lay.ranges(rank) for pos in range(a, b)]


def _covered(lay, rank, src, blocks):
    qpos, kpos = _positions(lay, rank), _positions(lay, src)
    pairs = []
    for rows, keys, causal in blocks:
        for i in range(rows.start, rows.stop):
            for j in range(keys.start, keys.stop):
                if causal and j - keys.start > i - rows.start:
                    continue
                pairs.append((qpos[i], kpos[j]))
    return pairs


CASES = [(2, [1, 7, 13, 35]), (4, [3, 1, 50, 2, 9, 31]), (4, [64]), (2, [5, 5, 5, 5, 4]),
         (4, [1] * 12), (3, [10, 17, 3, 6]), (4, [2, 90, 1, 3])]


@pytest.mark.parametrize("p,lengths", CASES)
def test_blocks_cover_every_visible_pair_once(p, lengths):
    shape = PackShape(tuple(lengths)).padded(p)
    docs = _docs(shape.lengths)
    lay = PackedLayout(p, docs)
    assert sorted(pos for r in range(p) for pos in _positions(lay, r)) == list(range(docs.total))
    for rank in range(p):
        for src in range(p):
            want = _visible(docs, lay, rank, src)
            got = _covered(lay, rank, src, lay.kernel_blocks(rank, src))
            assert len(got) == len(set(got)) and set(got) == want, (rank, src)
            score = _covered(lay, rank, src, [(b.rows, b.keys, b.causal) for b in lay.score_blocks(rank, src)])
            assert len(score) == len(set(score)) and set(score) == want, (rank, src)
            for b in lay.score_blocks(rank, src):  # colossal's columns are the keys' positions
                assert list(range(b.cols.start, b.cols.stop)) == _positions(lay, src)[b.keys]


def test_one_document_is_the_zigzag_layout():
    for p, T in ((2, 36), (4, 64), (4, 20), (3, 30)):
        lay, ring = PackedLayout(p, _docs([T])), RingLayout(p, T // p)
        for r in range(p):
            assert _positions(lay, r) == [i for a, b in ring.ranges(r) for i in range(a, b)]


def test_local_documents_stay_and_need_no_hop():
    lay = PackedLayout(4, _docs([4, 4, 8, 8, 8]))  # chunks of 8: nothing crosses a boundary
    assert all(set(lay.moves_plan(r)[0]) == set(lay.moves_plan(r)[1]) == {r} for r in range(4))  # rows stay home
    assert lay.last_hops() == (0, 0, 0, 0)
    lay = PackedLayout(4, _docs([4, 16, 12]))  # the 16 crosses: its pieces are everywhere
    assert max(lay.last_hops()) > 0


def test_spanning_documents_are_balanced():
    rng = random.Random(3)
    for _ in range(20):
        p = rng.choice([2, 4])
        lengths = [rng.randint(1, 200) for _ in range(rng.randint(1, 6))]
        docs = _docs(PackShape(tuple(lengths)).padded(p).lengths)
        lay = PackedLayout(p, docs)
        for d, (a, b) in enumerate(zip(docs.bounds, docs.bounds[1:])):
            if a // lay.chunk == (b - 1) // lay.chunk:
                continue
            per_doc = []
            for r in range(p):
                n = sum(1 for s in range(p) for i, j in _covered(lay, r, s, lay.kernel_blocks(r, s))
                        if docs.doc_of(i) == d)
                per_doc.append(n)
            # pieces differ by at most one token, and a row sees at most the document: the ranks'
            # causal work on a spanning document differs by at most two rows of it
            assert max(per_doc) - min(per_doc) <= 2 * (b - a), per_doc


def test_cu_seqlens_are_checked():
    assert check_cu_seqlens([0, 3, 3, 7], 7) == (0, 3, 7)
    for bad, total in (([1, 4], 4), ([0, 5, 3], 3), ([0, 3], 4), ([0], 0)):
        with pytest.raises(ValueError):
            check_cu_seqlens(bad, total)
    with pytest.raises(ValueError):
        PackShape(())
