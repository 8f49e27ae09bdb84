"""Variable-length attention (``parallel/varlen.py``) and kernel selection (``kernel_select.py``).

On CPU the primitive is checked against torch's SDPA per document (values and gradients). Its
CUDA paths run on fake CUDA tensors (``FakeTensorMode``): every kernel family's argument list is
recorded (cu_seqlens int32 on the device, max_seqlen, causal, scale, the LSE layouts, the
*global* out/lse in the backward), the packed paths of every attention core run end to end in
bf16, and the fallback order follows fake device properties.
"""
import logging
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_paradyse.parallel import attention_kernels as K
from megatron_paradyse.parallel import kernel_select as S
from megatron_paradyse.parallel import varlen
from megatron_paradyse.parallel.pack_layout import PackedLayout
from megatron_paradyse.parallel.packing import Documents
from megatron_paradyse.parallel.strategies import ring

LENGTHS = (5, 17, 1, 9, 32)  # T = 64
N, KV, D = 8, 2, 16


def _docs(lengths=LENGTHS):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return Documents(tuple(bounds))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """No flash-attn, no failures remembered, capability as the test says."""
    monkeypatch.setattr(K, "_FA", None)
    monkeypatch.setattr(varlen, "_FAV", None)
    S.forget_failures()
    yield
    S.forget_failures()


def _caps(monkeypatch, cap):
    monkeypatch.setattr(S, "capability", lambda device: cap)


# --- CPU: the reference ---------------------------------------------------------------------

def _per_document_sdpa(q, k, v, docs, scale):
    outs = []
    for a, b in zip(docs.bounds, docs.bounds[1:]):
        sl = slice(a, b)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                   scale=scale, enable_gqa=True))
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("kv", [N, KV])
def test_cpu_varlen_equals_sdpa_per_document(kv):
    docs, scale = _docs(), D ** -0.5
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, docs.total, D, generator=g) for h in (N, kv, kv, N))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _per_document_sdpa(*leaves, docs, scale)
    ref.backward(dout)
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen.document_attention(*mine, scale, docs)
    out.backward(dout)
    assert (out - ref).abs().max() < 1e-6
    for a, b in zip(mine, leaves):
        assert (a.grad - b.grad).abs().max() < 1e-5
    assert varlen.kernel_path(q) == "per document (cpu flash)"


def test_varlen_refuses_more_than_one_row():
    q = torch.zeros(2, N, 64, D)
    with pytest.raises(ValueError, match="one packed row"):
        varlen.forward(q, q, q, _docs(), 1.0)


def test_device_tensors_are_built_once_per_documents():
    docs = _docs()
    a, b = docs.cu_seqlens(), docs.cu_seqlens("cpu")
    assert a is b and a.dtype == torch.int32 and a.tolist() == list(docs.bounds)
    p1, p2 = docs.positions([(0, 10), (20, 30)]), docs.positions(((0, 10), (20, 30)))
    assert p1 is p2 and p1.tolist()[:7] == [0, 1, 2, 3, 4, 0, 1]


# --- fake CUDA: argument lists of both kernel families ----------------------------------------

class _Recorder:
    """Stands in for ``torch.ops.aten`` in ``varlen``: records the varlen kernels' calls and
    runs them (their fake kernels give the shapes)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        real = getattr(torch.ops.aten, name)

        def kernel(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "_efficient_attention_backward":
                # torch 2.13's meta for it lacks the schema's ``out`` argument (it raises); the
                # real kernel ran with this argument list on an H200 (results/gpu/h200/fast_paths/probe_varlen.py)
                return tuple(torch.empty_like(x) for x in args[1:4]) + (None,)
            return real(*args, **kwargs)
        return kernel


def _run_fake(dtype, cap, monkeypatch, head_dim=D, kv=KV):
    """Forward and backward of the primitive on fake CUDA tensors; (recorded calls, q, out, lse)."""
    _caps(monkeypatch, cap)
    rec = _Recorder()
    monkeypatch.setattr(varlen, "aten", rec)
    docs = _docs()
    with FakeTensorMode(allow_non_fake_inputs=True):
        e = lambda h: torch.empty(1, h, docs.total, head_dim, device="cuda", dtype=dtype)  # noqa: E731
        q, k, v, dout = e(N), e(kv), e(kv), e(N)
        out, lse = varlen.forward(q, k, v, docs, 0.25)
        dq, dk, dv = varlen.backward(dout, q, k, v, out, lse, docs, 0.25)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dtype, (1, N, docs.total), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    return rec.calls, docs


def _check_cu(args, at, docs):
    cu_q, cu_k, mq, mk = args[at:at + 4]
    for cu in (cu_q, cu_k):
        assert (cu.dtype, cu.device.type, tuple(cu.shape)) == (torch.int32, "cuda", (len(docs.bounds),))
        assert cu.is_contiguous()
    assert (mq, mk) == (docs.max_length, docs.max_length)  # never under the longest document


def test_torch_flash_varlen_arguments(monkeypatch):
    calls, docs = _run_fake(torch.bfloat16, (9, 0), monkeypatch)
    assert [c[0] for c in calls] == ["_flash_attention_forward", "_flash_attention_backward"]
    (_, fa, fk), (_, ba, bk) = calls
    assert fa[0].shape == (docs.total, N, D) and fa[1].shape == (docs.total, KV, D)  # thd, native GQA
    _check_cu(fa, 3, docs)
    assert fa[7:10] == (0.0, True, False) and fk == {"scale": 0.25}
    _check_cu(ba, 6, docs)
    assert ba[5].shape == (N, docs.total) and ba[5].is_contiguous()  # the global lse, [n, T]
    assert ba[4].shape == (docs.total, N, D)  # the global out, thd
    assert ba[10:12] == (0.0, True) and bk == {"scale": 0.25}
    assert (ba[12].dtype, ba[12].shape, ba[13].dtype) == (torch.uint64, (2,), torch.uint64)


def test_torch_efficient_varlen_arguments(monkeypatch):
    calls, docs = _run_fake(torch.float32, (9, 0), monkeypatch)
    assert [c[0] for c in calls] == ["_efficient_attention_forward", "_efficient_attention_backward"]
    (_, fa, fk), (_, ba, bk) = calls
    assert fa[0].shape == (1, docs.total, N, D) and fa[1].shape == (1, docs.total, N, D)  # K/V expanded
    _check_cu(fa, 4, docs)
    assert fa[8:11] == (0.0, 1, True) and fk == {"scale": 0.25}  # causal (top-left), with the LSE
    _check_cu(ba, 6, docs)
    width = -(-docs.max_length // 32) * 32
    assert ba[10].shape == (len(LENGTHS), N, width) and ba[10].is_contiguous()  # lse per document
    assert ba[5].shape == (1, docs.total, N, D) and ba[5].is_contiguous()
    assert ba[14:16] == (1, False) and bk == {"scale": 0.25}


def test_efficient_lse_rows_round_trip():
    """The memory-efficient kernel's LSE ``[docs, n, width]`` read into ``[1, n, T]`` and written
    back for its backward: the same numbers at the same rows (on CPU tensors)."""
    docs = _docs()
    width = 32
    rows = varlen._lse_rows(docs, "cpu", width)
    kernel_lse = torch.randn(len(LENGTHS), N, width)
    flat = kernel_lse.transpose(0, 1).reshape(N, -1).index_select(1, rows)
    assert flat.shape == (N, docs.total)
    assert torch.equal(flat[:, docs.bounds[1] + 2], kernel_lse[1, :, 2])  # doc 1, row 2
    back = flat.new_zeros((N, len(LENGTHS) * width)).index_copy(1, rows, flat).view(N, -1, width).transpose(0, 1)
    for d, n in enumerate(LENGTHS):
        assert torch.equal(back[d, :, :n], kernel_lse[d, :, :n])


def _fav_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
             window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
             block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    _fav_fwd.args = (cu_seqlens_q, max_seqlen_q, causal, softmax_scale)
    t, h, _ = q.shape
    return torch.empty_like(q), torch.empty(h, t, device=q.device), None, None


def _fav_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
             deterministic, rng_state=None, zero_tensors=False):
    _fav_bwd.args = (softmax_lse.shape, dk.shape, deterministic)


def test_flash_attn_varlen_detected_and_called(monkeypatch):
    iface = types.SimpleNamespace(_flash_attn_varlen_forward=_fav_fwd, _flash_attn_varlen_backward=_fav_bwd)
    assert varlen.flash_attn_varlen_kernels(iface) == (_fav_fwd, _fav_bwd)
    assert varlen.flash_attn_varlen_kernels(types.SimpleNamespace()) is None
    monkeypatch.setattr(K, "_FA", (object(), object()))
    monkeypatch.setattr(varlen, "_FAV", (_fav_fwd, _fav_bwd))
    torch.use_deterministic_algorithms(True)
    try:
        calls, docs = _run_fake(torch.bfloat16, (9, 0), monkeypatch)
    finally:
        torch.use_deterministic_algorithms(False)
    assert calls == []  # no torch kernel
    cu, mx, causal, scale = _fav_fwd.args
    assert (cu.dtype, mx, causal, scale) == (torch.int32, docs.max_length, True, 0.25)
    assert _fav_bwd.args == ((N, docs.total), (docs.total, KV, D), True)


# --- fake CUDA: the packed paths of every attention core, end to end ---------------------------

def test_packed_cores_run_end_to_end_on_fake_cuda_bf16(monkeypatch):
    """tp_sp/ulysses' pack attention (autograd through the primitive) and the ring/metp core
    (``ring_forward``, ``step_backward`` over a p = 2 pack layout, each rank's steps fed as the
    ring feeds them) on fake CUDA bf16 tensors. colossal computes explicit scores (no attention
    kernel) and is not covered here."""
    _caps(monkeypatch, (9, 0))
    docs = _docs((40, 3, 21))
    layout = PackedLayout(2, docs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        e = lambda h, s: torch.empty(1, h, s, D, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, dout = (e(h, docs.total) for h in (N, KV, KV, N))
        assert varlen.document_attention(q, k, v, 0.25, docs).shape == q.shape  # VarlenAttention's forward
        # what it saves and its backward, called directly (autograd's engine aborts on fake CUDA)
        out, lse = varlen.forward(q, k, v, docs, 0.25)
        dq, dk, dv = varlen.backward(dout, q, k, v, out, lse, docs, 0.25)
        assert (out.shape, dq.shape, dk.shape) == (q.shape, q.shape, k.shape)
        kvs = {r: (e(KV, layout.count(r)), e(KV, layout.count(r))) for r in range(2)}
        for rank in range(2):
            qr, dout = e(N, layout.count(rank)), e(N, layout.count(rank))
            order = [rank, 1 - rank]
            out, lse = ring.ring_forward(qr, ((s, kvs[s]) for s in order), layout, rank, 0.25)
            out = out.to(torch.bfloat16)
            dq = torch.zeros_like(qr, dtype=torch.float32)
            for s in order:
                blocks = ring.step_blocks(layout, rank, s, qr)
                ring.step_backward(dout, qr, out, lse, dq, *kvs[s], blocks, 0.25)
            assert out.shape == qr.shape and lse.shape == (1, N, layout.count(rank)) and dq.shape == qr.shape


# --- kernel selection: fallback order by device properties ------------------------------------

def _families(cap, dtype, head_dim=64, flash_attn=False):
    return S.candidates(S.Call("cuda", cap, dtype, head_dim), flash_attn)


def test_fallback_order_follows_device_properties():
    ALL = [S.TORCH_FLASH, S.TORCH_EFFICIENT, S.MATH]
    assert _families((9, 0), torch.bfloat16) == ALL
    assert _families((9, 0), torch.bfloat16, flash_attn=True) == [S.FLASH_ATTN] + ALL
    assert _families((8, 0), torch.float32) == [S.TORCH_EFFICIENT, S.MATH]
    assert _families((7, 5), torch.bfloat16, flash_attn=True) == [S.MATH]  # no bf16 kernel before sm80
    assert _families((7, 5), torch.float16) == [S.TORCH_EFFICIENT, S.MATH]
    assert _families((9, 0), torch.bfloat16, head_dim=72) == ALL
    assert _families((9, 0), torch.bfloat16, head_dim=264) == [S.TORCH_EFFICIENT, S.MATH]
    assert _families((9, 0), torch.bfloat16, head_dim=36) == [S.MATH]
    assert _families((9, 0), torch.float32, head_dim=6) == [S.MATH]
    assert S.candidates(S.Call("cpu", None, torch.float32, 36), True) == [S.CPU_FLASH, S.MATH]


def test_dense_and_varlen_paths_follow_the_order(monkeypatch):
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, N, 64, D, device="cuda", dtype=torch.bfloat16)
        _caps(monkeypatch, (7, 5))
        assert (K.kernel_path(q), K.native_gqa(q), varlen.kernel_path(q)) == ("math", False, "per document (math)")
        _caps(monkeypatch, (8, 6))
        assert (K.kernel_path(q), K.native_gqa(q), varlen.kernel_path(q)) == (
            "torch flash", True, "torch flash varlen")
        monkeypatch.setattr(K, "_FA", (object(), object()))
        assert K.kernel_path(q).startswith("flash-attn")


def test_a_kernel_that_raises_falls_back_and_is_remembered(monkeypatch, caplog):
    c = S.Call("cuda", (9, 0), torch.bfloat16, 64)
    tried = []

    def broken(*a):
        tried.append("flash")
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    kernels = {S.TORCH_FLASH: broken, S.TORCH_EFFICIENT: lambda *a: tried.append("efficient") or "ok",
               S.MATH: lambda *a: "math"}
    with caplog.at_level(logging.WARNING, logger=S.__name__):
        assert S.run(c, S.candidates(c, False), kernels) == "ok"
    assert "torch flash failed" in caplog.text and "Ampere" in caplog.text
    assert S.candidates(c, False) == [S.TORCH_EFFICIENT, S.MATH]  # not tried again
    assert S.run(c, S.candidates(c, False), kernels) == "ok" and tried == ["flash", "efficient", "efficient"]


def test_out_of_memory_is_not_a_fallback():
    c = S.Call("cuda", (9, 0), torch.bfloat16, 64)

    def oom(*a):
        raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        S.run(c, [S.TORCH_FLASH, S.MATH], {S.TORCH_FLASH: oom, S.MATH: lambda *a: "math"})


@pytest.mark.parametrize("causal", [True, False])
def test_math_kernel_matches_the_cpu_flash_kernel(causal):
    """The last fallback gives the fused kernels' out, lse and gradients (given global out/lse)."""
    from megatron_paradyse.parallel import math_attention as M

    g = torch.Generator().manual_seed(1)
    sq, sk = (24, 24) if causal else (16, 40)
    q, dout = (torch.randn(2, 4, sq, D, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 4, sk, D, generator=g) for _ in range(2))
    out, lse = M.forward(q, k, v, causal, 0.3)
    ref_out, ref_lse = K._fwd_cpu(q, k, v, causal, 0.3)
    assert (out - ref_out).abs().max() < 1e-5 and (lse - ref_lse).abs().max() < 1e-5
    got = M.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
    ref = K._bwd_cpu(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() < 1e-4


def test_colossal_packed_path_runs_on_fake_cuda_bf16(monkeypatch):
    """colossal's ring self-attention (explicit scores, no attention kernel) over a p = 2 pack
    layout, forward and backward, each rank's ring steps fed as its ring would feed them."""
    from megatron_paradyse.parallel.strategies import colossal

    docs = _docs((40, 3, 21))
    layout = PackedLayout(2, docs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for rank in range(2):
            e = lambda h, s: torch.empty(1, h, s, D, device="cuda", dtype=torch.bfloat16)  # noqa: E731

            def ring_steps(block, group, lay, visit, grad=False, rank=rank):
                own = None
                for src in (rank, 1 - rank):
                    blk = block if src == rank else e(KV, lay.count(src))
                    blocks = lay.score_blocks(rank, src)
                    g = visit(src, blk, blocks) if blocks else None
                    own = g if src == rank else own
                return own if grad else None
            monkeypatch.setattr(colossal, "_ring", ring_steps)
            ring = types.SimpleNamespace(position=rank, size=2)
            ctx = types.SimpleNamespace(save_for_backward=lambda *t: setattr(ctx, "saved_tensors", t))
            n = layout.count(rank)
            q, k, v = e(N, n), e(KV, n), e(KV, n)
            out = colossal.RingSelfAttention.forward(ctx, q, k, v, ring, 0.25, layout)
            dq, dk, dv = colossal.RingSelfAttention.backward(ctx, e(N, n))[:3]
            assert (out.shape, dq.shape, dk.shape, dv.shape) == (q.shape, q.shape, k.shape, v.shape)
