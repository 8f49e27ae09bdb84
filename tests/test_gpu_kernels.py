"""The CUDA paths of the block attention kernels, checked on a CPU-only machine.

Fake CUDA tensors (``FakeTensorMode``) run the kernels' shape functions; a recording stub in
place of ``torch.ops.aten`` checks the arguments the meta kernels ignore (undefined
cumulative lengths select torch's dense flash backward; the RNG state; the layouts); fake
flash-attn modules check the signature detection. The ring's block computation itself runs
on CPU against float64 (``kernel_check``).
"""
import logging
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_paradyse.parallel import attention_kernels as K
from megatron_paradyse.parallel.kernel_check import ring_blocks_selfcheck

B, D = 2, 64
SHAPES = [  # (query heads, KV heads, sq, sk, causal)
    (8, 8, 64, 64, True), (8, 2, 64, 64, True), (8, 2, 48, 80, False), (4, 4, 33, 70, False)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def torch_kernels(monkeypatch):
    """The torch CUDA kernels, even where flash-attn is installed."""
    monkeypatch.setattr(K, "_FA", None)


def _cuda(n, kv, sq, sk, dtype):
    """Fake CUDA q, k, v, dout (call inside a FakeTensorMode)."""
    e = lambda h, s: torch.empty(B, h, s, D, device="cuda", dtype=dtype)  # noqa: E731
    return e(n, sq), e(kv, sk), e(kv, sk), e(n, sq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,kv,sq,sk,causal", SHAPES)
def test_fake_cuda_forward_backward(torch_kernels, dtype, n, kv, sq, sk, causal):
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, dout = _cuda(n, kv, sq, sk, dtype)
        out, lse = K.attn_forward(q, k, v, causal, D ** -0.5)
        dq, dk, dv = K.attn_backward(dout, q, k, v, out, lse, causal, D ** -0.5)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, dtype, "cuda")
    assert (lse.shape, lse.dtype, lse.device.type) == ((B, n, sq), torch.float32, "cuda")
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert (grad.shape, grad.dtype, grad.device.type) == (like.shape, dtype, "cuda")


class _Recorder:
    """Stands in for ``torch.ops.aten``: records the backward kernels' arguments and returns
    gradients shaped like their inputs."""

    def __init__(self):
        self.calls = {}

    def __getattr__(self, name):
        if not name.endswith("_backward"):
            return getattr(torch.ops.aten, name)

        def kernel(*args, **kwargs):
            self.calls[name] = (args, kwargs)
            grads = tuple(torch.empty_like(x) for x in args[1:4])
            return grads if "flash" in name else grads + (None,)
        return kernel


def _record(dtype, n=8, kv=2, sq=40, sk=72):
    """Run attn_backward on fake CUDA tensors with the aten stub, with the forward's lse and an
    ``out`` in ``[b, h, s, d]`` memory (as the ring passes it); returns (name, q, k, args, kwargs)."""
    rec = _Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, dout = _cuda(n, kv, sq, sk, dtype)
        lse = K.attn_forward(q, k, v, False, 0.125)[1]
        out = torch.empty_like(dout)
        K.aten, real = rec, K.aten
        try:
            K.attn_backward(dout, q, k, v, out, lse, False, 0.125)
        finally:
            K.aten = real
    (name, (args, kwargs)), = rec.calls.items()
    return name, q, k, args, kwargs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_flash_backward_arguments(torch_kernels, dtype):
    name, q, k, args, kwargs = _record(dtype)
    assert name == "_scaled_dot_product_flash_attention_backward"
    assert args[2].shape == k.shape  # GQA: K/V go in with their own heads
    assert args[6] is None and args[7] is None  # undefined: the dense kernel, not varlen
    assert args[8:12] == (40, 72, 0.0, False) and kwargs == {"scale": 0.125}
    seed, offset = args[12:14]  # as the forward returns them; read only with dropout
    assert (seed.shape, seed.dtype, seed.device) == ((2,), torch.uint64, q.device)
    assert (offset.shape, offset.dtype, offset.device) == ((), torch.uint64, q.device)
    assert args[5].is_contiguous()


def test_torch_efficient_backward_arguments(torch_kernels):
    name, q, k, args, kwargs = _record(torch.float32)
    assert name == "_scaled_dot_product_efficient_attention_backward"
    assert args[2].shape[1] == q.shape[1]  # no GQA in this kernel: K/V expanded
    out, lse, seed, offset = args[5:9]
    assert out.transpose(1, 2).is_contiguous()  # [b, s, h, d] memory, as o_strideM assumes
    assert lse.shape == (B, 8, 64) and lse.is_contiguous()  # rows padded to a multiple of 32
    for t in (seed, offset):
        assert (t.shape, t.dtype, t.device) == ((), torch.int64, q.device)
    assert args[9:12] == (0.0, [True, True, True, False], False)


# --- flash-attn: signature detection and the call -------------------------------------------

def _fa_28_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
               softcap, alibi_slopes, return_softmax):
    b, s, h, _ = q.shape
    return torch.empty_like(q), torch.empty(b, h, s, device=q.device), None, None


def _fa_28_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
               window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _fa_28_bwd.args = (dout, q, k, v, dq, dk, dv)
    _fa_28_bwd.deterministic = deterministic


def _fa_26_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    raise AssertionError("not to be called")


def _fa_26_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
               window_size, softcap, alibi_slopes, deterministic, rng_state=None):
    raise AssertionError("not to be called")


class _CustomOp:
    """Like torch.library.custom_op's object (flash-attn >= 2.7): signature (*args, **kwargs),
    the function in ``_init_fn``."""

    def __init__(self, fn):
        self._init_fn = fn

    def __call__(self, *args, **kwargs):
        return self._init_fn(*args, **kwargs)


def _fake_flash_attn(monkeypatch, version, fwd, bwd):
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward, iface._flash_attn_backward = fwd, bwd
    pkg = types.ModuleType("flash_attn")
    pkg.__version__, pkg.flash_attn_interface = version, iface
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    return iface


@pytest.mark.parametrize("wrap", [lambda f: f, _CustomOp])
def test_flash_attn_compatible_signature(monkeypatch, caplog, wrap):
    fwd, bwd = wrap(_fa_28_fwd), wrap(_fa_28_bwd)
    _fake_flash_attn(monkeypatch, "2.8.3", fwd, bwd)
    with caplog.at_level(logging.WARNING):
        assert K._load_flash_attn() == ((fwd, bwd), "2.8.3")
    assert not caplog.records


def test_flash_attn_incompatible_signature(monkeypatch, caplog):
    _fake_flash_attn(monkeypatch, "2.6.3", _fa_26_fwd, _fa_26_bwd)
    with caplog.at_level(logging.WARNING):
        assert K._load_flash_attn() == (None, None)
    (record,) = caplog.records
    assert "2.6.3" in record.getMessage() and "torch's attention kernels" in record.getMessage()
    with caplog.at_level(logging.WARNING):  # a module without the private kernels
        assert K.flash_attn_kernels(types.ModuleType("flash_attn_interface"), "3.0") is None


def test_flash_attn_call(monkeypatch):
    """flash-attn gets [b, s, h, d] views (no copies), K/V with their own heads; the backward's
    in-place dq/dk/dv are views of the returned gradients."""
    monkeypatch.setattr(K, "_FA", (_fa_28_fwd, _fa_28_bwd))
    monkeypatch.setattr(K, "FLASH_ATTN_VERSION", "2.8.3")
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, dout = _cuda(8, 2, 64, 64, torch.bfloat16)
        assert K.kernel_path(q) == "flash-attn 2.8.3" and K.native_gqa(q)
        out, lse = K.attn_forward(q, k, v, True, 0.125)
        dq, dk, dv = K.attn_backward(dout, q, k, v, out, lse, True, 0.125)
        args = _fa_28_bwd.args
        assert args[1]._base is q and args[2]._base is k and args[2].shape == (B, 64, 2, D)
        assert args[4]._base is dq and args[5]._base is dk and args[6]._base is dv
    assert out.shape == q.shape and lse.shape == (B, 8, 64)
    assert dk.shape == k.shape and dv.shape == v.shape


def test_flash_attn_backward_follows_torchs_deterministic_setting(monkeypatch):
    """flash-attn's backward is deterministic exactly when torch's global setting asks for it
    (Megatron-LM's --deterministic-mode calls torch.use_deterministic_algorithms(True))."""
    monkeypatch.setattr(K, "_FA", (_fa_28_fwd, _fa_28_bwd))
    was = torch.are_deterministic_algorithms_enabled()
    seen = []
    try:
        for on in (False, True):
            torch.use_deterministic_algorithms(on)
            with FakeTensorMode(allow_non_fake_inputs=True):
                q, k, v, dout = _cuda(8, 2, 64, 64, torch.bfloat16)
                out, lse = K.attn_forward(q, k, v, True, 0.125)
                K.attn_backward(dout, q, k, v, out, lse, True, 0.125)
            seen.append(_fa_28_bwd.deterministic)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [False, True]


def test_kernel_paths(torch_kernels):
    assert K.kernel_path(torch.empty(1, 2, 4, 8)) == "cpu flash"
    assert not K.native_gqa(torch.empty(1, 2, 4, 8, dtype=torch.bfloat16))
    with FakeTensorMode():
        for dtype, path, native in ((torch.bfloat16, "torch flash", True), (torch.float16, "torch flash", True),
                                    (torch.float32, "torch efficient", False)):
            q = torch.empty(1, 2, 4, 8, device="cuda", dtype=dtype)
            assert (K.kernel_path(q), K.native_gqa(q)) == (path, native)


# --- GQA on CPU and the ring's blocks against float64 ---------------------------------------

def test_cpu_gqa_expands():
    """On CPU the kernels take GQA K/V and expand them: the same numbers as expanded K/V."""
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(1, 8, 24, 16, generator=g), torch.randn(1, 8, 24, 16, generator=g)
    k, v = torch.randn(1, 2, 24, 16, generator=g), torch.randn(1, 2, 24, 16, generator=g)
    out, lse = K.attn_forward(q, k, v, True, 0.25)
    ref_out, ref_lse = K.attn_forward(q, K.expand_kv(k, 4), K.expand_kv(v, 4), True, 0.25)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    grads = K.attn_backward(dout, q, k, v, out, lse, True, 0.25)
    ref = K.attn_backward(dout, q, K.expand_kv(k, 4), K.expand_kv(v, 4), out, lse, True, 0.25)
    assert torch.equal(grads[0], ref[0])
    assert torch.equal(grads[1], K.reduce_kv(ref[1], 4)) and torch.equal(grads[2], K.reduce_kv(ref[2], 4))


def test_ring_blocks_selfcheck_cpu():
    res = ring_blocks_selfcheck("cpu", torch.float32)
    assert res["path"] == "cpu flash" and res["native_gqa"] is False
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert res[name] < 1e-5, res
