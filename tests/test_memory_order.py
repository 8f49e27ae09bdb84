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
