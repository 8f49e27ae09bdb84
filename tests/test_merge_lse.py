"""The rings' log-sum-exp merge (``attention_kernels.merge_lse``) against one softmax over all
keys, and rows that saw no key: flash-attn 2 reports their LSE as +inf, flash-attn 3/4 and torch
as -inf (issue 37, item 3). Neither may turn a merged row into NaN."""
import pytest
import torch

from megatron_paradyse.parallel.attention_kernels import merge_lse


def _block(q, k, v):
    """``(out, lse)`` of softmax attention of ``q`` over the keys ``k`` (no mask), fp64."""
    scores = q @ k.transpose(-1, -2)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # a GPU host runs both


def _qkv(device="cpu", rows=5, keys=8, d=4):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, n, d, generator=g, dtype=torch.float64).to(device) for n in (rows, keys, keys))


@pytest.mark.parametrize("device", DEVICES)
def test_two_blocks_merge_to_one_softmax(device):
    q, k, v = _qkv(device)
    full_out, full_lse = _block(q, k, v)
    out, lse = merge_lse(None, None, *_block(q, k[:, :, :3], v[:, :, :3]))
    out, lse = merge_lse(out, lse, *_block(q, k[:, :, 3:], v[:, :, 3:]))
    assert torch.allclose(out.double(), full_out, atol=1e-6) and torch.allclose(lse.double(), full_lse, atol=1e-6)


@pytest.mark.parametrize("empty_lse", [float("inf"), float("-inf")], ids=["flash-attn 2: +inf", "fa3/torch: -inf"])
@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_keys_add_nothing_and_never_nan(empty_lse, device):
    q, k, v = _qkv(device)
    real_out, real_lse = _block(q, k, v)
    empty_out = torch.zeros_like(real_out)
    empty = torch.full_like(real_lse, empty_lse)
    empty[..., 0] = real_lse[..., 0]  # one row of the "empty" block did see keys: a mixed block
    empty_out[..., 0, :] = real_out[..., 0, :]
    for first, second in (((real_out, real_lse), (empty_out, empty)), ((empty_out, empty), (real_out, real_lse))):
        out, lse = merge_lse(None, None, *first)
        out, lse = merge_lse(out, lse, *second)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert torch.allclose(out[..., 1:, :].double(), real_out[..., 1:, :], atol=1e-6)
        assert torch.allclose(lse[..., 1:].double(), real_lse[..., 1:], atol=1e-6)
    # a row empty in every block so far stays empty (output 0, LSE -inf), then takes a real block
    out, lse = merge_lse(None, None, empty_out, empty)
    out, lse = merge_lse(out, lse, empty_out, empty)
    assert not torch.isnan(out).any() and (out[..., 1:, :] == 0).all() and torch.isneginf(lse[..., 1:]).all()
    out, lse = merge_lse(out, lse, real_out, real_lse)
    assert torch.allclose(out[..., 1:, :].double(), real_out[..., 1:, :], atol=1e-6)
