"""Memory behaves as the strategies promise (p = 4, one long sequence, CPU live-tensor bytes).

Activation memory is what the forward keeps for the backward. METP keeps only layer inputs;
ZeRO-style strategies keep local tokens at full width; TP+SP keeps full-sequence tensors of
width h/p plus the gathered inputs; Ring Self-Attention keeps quadratic score rows.
"""
import megatron_paradyse as mp
from benchmarks.memory_table import table


def test_activation_memory_order_at_p4():
    spec = dict(num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=128,
                max_seq_length=1024)
    res = table(spec, batch=1, seq=1024, p=4, names=list(mp.STRATEGIES), timeout=600)
    act = {n: r["activations"] for n, r in res.items()}
    peak = {n: r["peak"] for n, r in res.items()}
    print({n: round(v / 2**20, 2) for n, v in act.items()})
    assert all(act["metp"] < act[n] for n in act if n != "metp"), act
    assert all(peak["metp"] < peak[n] for n in peak if n != "metp"), peak
    flash_based = ("tp_sp", "ulysses", "ring")
    assert max(flash_based, key=act.get) == "tp_sp", act
    assert act["colossal"] > act["tp_sp"], act



def test_pass_memory_credits_what_the_backward_frees():
    """The backward frees saved tensors as it goes: a scratch buffer allocated after they are
    freed must not be stacked on top of them (one tracker spans forward and backward)."""
    import torch

    from megatron_paradyse.memory import pass_memory

    n = 1 << 18  # 1 MiB of fp32

    class Keep(torch.autograd.Function):  # runs last: saves 4 MiB, freed when its backward ends
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x.repeat(4))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Scratch(torch.autograd.Function):  # runs first: its backward needs 4 MiB of scratch
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g + torch.zeros(4 * n)[:n]

    x = torch.ones(n, requires_grad=True)

    def forward():
        return Keep.apply(Scratch.apply(x))

    def backward(out):
        out.backward(torch.ones_like(out))
        x.grad = None

    backward(forward())
    mem = pass_memory(forward, backward)
    mib = 4 * n
    assert mem["activations"] == 5 * mib, mem  # Keep's 4 MiB and the output
    # the scratch comes after Keep's 4 MiB are freed; stacking the backward's allocations
    # (gradients and the scratch) on all the saved bytes would give 12 MiB
    assert mem["peak"] <= 8 * mib, mem
