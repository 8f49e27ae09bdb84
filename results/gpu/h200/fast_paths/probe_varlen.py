"""Probe on a GPU: varlen kernels (aten flash with cum_seq, aten efficient with cu_seqlens,
torch.nn.attention.varlen), their LSE shapes, exactness against per-document SDPA, timing of
200 short documents per-document vs varlen, determinism behaviour, device properties."""
import time, torch, torch.nn.functional as F
aten = torch.ops.aten
dev = "cuda"
p = torch.cuda.get_device_properties(0)
print("props", p.name, p.major, p.minor, "sm", p.multi_processor_count)
print("torch", torch.__version__)
try:
    import torch.nn.attention.varlen as V
    print("varlen module:", [n for n in dir(V) if not n.startswith("_")])
except Exception as e:
    print("varlen module: absent", type(e).__name__, e)
torch.manual_seed(0)
def docs_of(n, L):
    lens = torch.randint(L // 2, L * 3 // 2, (n,)).tolist(); return lens
def run(dtype, lens, H=16, KV=8, D=64, reps=5):
    T = sum(lens); cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q = torch.randn(T, H, D, device=dev, dtype=dtype); k = torch.randn(T, KV, D, device=dev, dtype=dtype); v = torch.randn_like(k)
    do = torch.randn_like(q); sc = D ** -0.5; mx = max(lens)
    def per_doc():
        outs = []
        for a, b in zip(cu.tolist(), cu.tolist()[1:]):
            outs.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None], is_causal=True, scale=sc, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs)
    ref = per_doc().float()
    res = {}
    if dtype != torch.float32:
        out, lse, rng, unused, _ = aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=sc)
        res["flash lse"] = tuple(lse.shape)
        res["flash err"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        dq, dk, dv = aten._flash_attention_backward(do, q, k, v, out, lse, cu, cu, mx, mx, 0.0, True, rng, unused, scale=sc)
        res["flash bwd"] = (tuple(dq.shape), tuple(dk.shape))
        def fl():
            o, l, r, u, _ = aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=sc)
            aten._flash_attention_backward(do, q, k, v, o, l, cu, cu, mx, mx, 0.0, True, r, u, scale=sc)
        kk, vv = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    else:
        kk, vv = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1); fl = None
    o, l, s0, s1, _, _ = aten._efficient_attention_forward(q[None], kk[None], vv[None], None, cu, cu, mx, mx, 0.0, 1, True, scale=sc)
    res["eff lse"] = tuple(l.shape)
    res["eff err"] = ((o[0].float() - ref).abs().max() / ref.abs().max()).item()
    g = aten._efficient_attention_backward(do[None], q[None], kk[None], vv[None], None, o, cu, cu, mx, mx, l, 0.0, s0, s1, 1, False, scale=sc)
    res["eff bwd"] = tuple(g[0].shape)
    def ef():
        o, l, s0, s1, _, _ = aten._efficient_attention_forward(q[None], kk[None], vv[None], None, cu, cu, mx, mx, 0.0, 1, True, scale=sc)
        aten._efficient_attention_backward(do[None], q[None], kk[None], vv[None], None, o, cu, cu, mx, mx, l, 0.0, s0, s1, 1, False, scale=sc)
    qq, kr, vr = q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()
    def pd():
        outs = []
        for a, b in zip(cu.tolist(), cu.tolist()[1:]):
            outs.append(F.scaled_dot_product_attention(qq[a:b].transpose(0, 1)[None], kr[a:b].transpose(0, 1)[None].repeat_interleave(H // KV, 1), vr[a:b].transpose(0, 1)[None].repeat_interleave(H // KV, 1), is_causal=True, scale=sc)[0].transpose(0, 1))
        torch.cat(outs).backward(do)
    def tm(f):
        f(); torch.cuda.synchronize(); ts = []
        for _ in range(reps):
            t = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2] * 1e3
    res["ms per-doc fwd+bwd"] = round(tm(pd), 3)
    res["ms eff varlen fwd+bwd"] = round(tm(ef), 3)
    if fl: res["ms flash varlen fwd+bwd"] = round(tm(fl), 3)
    return res
for dtype in (torch.bfloat16, torch.float32):
    for n, L in ((200, 64), (20, 1024)):
        print(dtype, n, "docs of ~", L, run(dtype, docs_of(n, L)))
# determinism
torch.use_deterministic_algorithms(True)
q = torch.randn(1, 8, 256, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
for name, dt in (("flash bf16", torch.bfloat16), ("efficient fp32", torch.float32)):
    x = torch.randn(1, 8, 256, 64, device=dev, dtype=dt, requires_grad=True)
    try:
        F.scaled_dot_product_attention(x, x, x, is_causal=True).sum().backward(); print("deterministic", name, "ok")
    except Exception as e:
        print("deterministic", name, type(e).__name__, str(e)[:200])
import warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    x = torch.randn(1, 8, 256, 64, device=dev, dtype=torch.float32, requires_grad=True)
    o, l = aten._scaled_dot_product_efficient_attention(x, x, x, None, True, 0.0, True)[:2]
    print("warnings", [str(i.message)[:150] for i in w])
