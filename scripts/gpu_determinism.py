"""On a GPU: is each attention kernel's backward bitwise repeatable under
torch.use_deterministic_algorithms(True)? Runs the plugin's dense block kernels and its
variable-length primitive once per kernel family the device takes (kernel_select.only), twice
each, and prints whether dq/dk/dv came out bitwise equal."""
import torch

from megatron_paradyse.parallel import kernel_select, varlen
from megatron_paradyse.parallel import attention_kernels as K
from megatron_paradyse.parallel.kernel_check import kernel_families
from megatron_paradyse.parallel.packing import Documents

torch.use_deterministic_algorithms(True)
g = torch.Generator(device="cuda").manual_seed(0)
lengths = [700, 1, 300, 2000, 95, 1000]
bounds = [0]
for n in lengths:
    bounds.append(bounds[-1] + n)
docs = Documents(tuple(bounds))
for dtype in (torch.bfloat16, torch.float32):
    q, dout = (torch.randn(1, 16, docs.total, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 4, docs.total, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    for family in kernel_families("cuda", dtype):
        with kernel_select.only(family):
            out, lse = K.attn_forward(q, k, v, True, 0.125)
            a = K.attn_backward(dout, q, k, v, out, lse, True, 0.125)
            b = K.attn_backward(dout, q, k, v, out, lse, True, 0.125)
            dense = all(torch.equal(x, y) for x, y in zip(a, b))
            out, lse = varlen.forward(q, k, v, docs, 0.125)
            a = varlen.backward(dout, q, k, v, out, lse, docs, 0.125)
            b = varlen.backward(dout, q, k, v, out, lse, docs, 0.125)
            packed = all(torch.equal(x, y) for x, y in zip(a, b))
            print(f"{str(dtype)[6:]:9} {family:16} dense [{K.kernel_path(q)}] repeatable={dense}  "
                  f"pack [{varlen.kernel_path(q)}] repeatable={packed}", flush=True)
