"""Context parallelism (CP) across nodes composed with the switching group: a cost model.

Megatron's CP of size C cuts a sequence of ``s`` tokens into 2C chunks; CP rank c (one node)
holds chunks c and 2C-1-c (the balanced order), ``s/C`` local tokens, sequence-sharded over
the node's p TP ranks. Every layer runs an in-node ParaDySe strategy on those local tokens,
and attention also covers the other CP ranks' keys:

* ``tp_sp`` and ``ulysses`` (heads/p of all local tokens after their in-node gather or
  all-to-all): their K/V ring over the CP group, C-1 hops forward; backward the K/V ring
  again and a travelling dK/dV accumulator, C hops; every hop crosses nodes;
* ``ring``, ``colossal``, ``metp`` (s/(Cp) tokens, all heads): a ring over the C*p ranks
  that replaces their in-node ring of p-1 hops, in one of two forms (``ring=``): two-level
  (the default, ``parallel/ring_comm.TwoLevelRing``'s): an outer ring over the C nodes whose every
  step runs the in-node ring, C-1 inter-node and C*(p-1) in-node hops per pass; flat: one
  ring in node-major order, C*p-1 hops per pass, C of the links of every hop crossing nodes,
  so each hop takes the inter-node link's time.

A K/V hop carries ``s/(C p) * 2 * kv_heads * head_dim * elt`` bytes from every rank (the
same for both families); a dK/dV hop the same tokens in fp32. :class:`CPCostModel` prices a
layer at the GLOBAL length as the in-node model's layer at ``s/C`` plus the work and bytes CP
adds (its docstring). Weights are replicated over CP ranks (megatron reduces gradients over
DP x CP), so static memory does not change with C. Every number is a model's, not a
measurement; ``bench/simulate_cp.py`` uses it at 64-512 GPUs.
"""
from __future__ import annotations

import dataclasses

from ..layout import ParallelDims
from ..parallel.packing import PackShape
from ..parallel.plans import split_entry
from . import analytic, packs
from .base import CostModel, LayerCost
from .fitted import rates_predict
from .shape import ModelShape

RING_FAMILY = ("ring", "colossal", "metp")   # sequence-sharded inside the node: one ring over C x p
RING_FORMS = ("two_level", "flat")           # the ring family's ring over C x p ranks (CPCostModel.ring_seconds)


@dataclasses.dataclass(frozen=True)
class Links:
    """Two alpha-beta link classes: inside a node (between TP ranks) and between nodes (one
    NIC per GPU). Bandwidth in bytes/s per direction per rank, alpha in seconds per step.
    :meth:`from_config` names them from ``configs/interconnects.json``; the constructor takes
    explicit numbers (a single-device profile's, or a simulation's own rates)."""

    intra_bandwidth: float
    intra_alpha: float
    inter_bandwidth: float
    inter_alpha: float
    intra_name: str = "explicit"
    inter_name: str = "explicit"

    def __post_init__(self):
        if min(self.intra_bandwidth, self.inter_bandwidth) <= 0 or min(self.intra_alpha, self.inter_alpha) < 0:
            raise ValueError(f"link bandwidths must be > 0 and alphas >= 0: {self}")

    @classmethod
    def from_config(cls, intra: str = "nvlink4", inter: str = "ib_ndr", path: str | None = None) -> "Links":
        """The two classes by name from ``configs/interconnects.json`` (or ``path``);
        ``cpu_gloo`` is this project's CPU loopback."""
        nets = analytic.load_config("interconnects.json", path)
        known = sorted(k for k in nets if not k.startswith("_"))
        for name in (intra, inter):
            if name not in nets:
                raise ValueError(f"unknown interconnect {name!r} (known: {known})")
        a, e = nets[intra], nets[inter]
        return cls(float(a["bandwidth"]), float(a["alpha"]), float(e["bandwidth"]), float(e["alpha"]), intra, inter)

    def hop(self, nbytes: float, inter: bool) -> float:
        """Seconds of one ring hop of ``nbytes`` per rank on the inter- or in-node class."""
        if inter:
            return self.inter_alpha + nbytes / self.inter_bandwidth
        return self.intra_alpha + nbytes / self.intra_bandwidth


class CPCostModel(CostModel):
    """A :class:`CostModel` for CP of size ``cp`` over nodes whose in-node costs are ``base``'s.

    :meth:`layer` takes the GLOBAL length ``s`` (priced padded to a multiple of ``2 * cp * p``) and
    returns one rank's cost: the base's layer at ``s/cp``, plus

    * attention work: per rank, balanced causal attention over the global sequence is ``cp``
      times the base's at ``s/cp`` (``(s/cp)**2 / p`` per rank against ``s**2 / (cp p)``), so
      ``(cp-1)`` times the base's attention seconds are added (:meth:`attention_seconds`);
    * the CP ring's time (:meth:`ring_seconds`), times ``1 - overlap`` (the fraction hidden
      behind compute; 0 by default: the repository's models add their terms);
    * the CP ring's buffers (:meth:`ring_bytes`, transient): the visiting K/V blocks the pool
      holds (``min(2, cp - 1)``) of ``tp_sp`` / ``ulysses``'s ring and of the ring family's
      outer ring, which also keeps an fp32 dK/dV accumulator (``metp``'s blocks hold one head
      group; a flat ring moves blocks of the size its in-node ring already holds: nothing
      added); ``colossal``'s score rows span all ``s`` keys: ``cp`` times the base's rows.

    A recomputed entry (``st:rc``, where the base prices it) runs the forward K/V ring once
    more and keeps none of the additions (they become transient, as the base's recompute
    turns its saved bytes into transient). ``nonlayer``, ``pool`` and the resident bytes are
    the base's at ``s/cp``; ``static_bytes``, ``update_seconds`` (no DP x CP gradient
    reduction unless the base has one), ``recomputes`` and ``device_kind`` are the base's.
    ``cp = 1`` returns the base's numbers exactly.

    A pack (``PackShape``, b = 1; :meth:`pack_layer`) is padded to a multiple of ``2*cp*p`` by a
    trailing padding document and cut as one sequence (``parallel/context.py``): CP rank c holds
    chunks c and 2cp-1-c, its documents' pieces there (:meth:`local_packs`). Priced per rank and
    the largest of each term taken (so seconds and peaks bound every rank's): the base's layer on
    the rank's local pack, plus the attention pairs its queries have with keys outside their own
    piece (same document, other chunks) at the base's attention seconds per pair at the local
    length, plus the ring and its buffers as for one sequence of the padded length, except
    that ``tp_sp`` / ``ulysses``'s ring makes only the hops the runtime makes
    (:meth:`pack_reach`: none when no document crosses CP ranks). Upper bounds: the ring
    family's ring priced as if every block travelled every hop (the runtime skips hops no
    later rank needs, ``RingComm.reach``), the ring's buffers as one sequence's, and
    ``colossal``'s score rows as if they spanned all keys.
    """

    def __init__(self, base: CostModel, cp: int, links: Links, shape: ModelShape | None = None,
                 overlap: float = 0.0, hardware: str | None = None, ring: str = "two_level"):
        if isinstance(cp, bool) or int(cp) != cp or cp < 1:
            raise ValueError(f"cp must be an integer >= 1, got {cp!r}")
        if not 0.0 <= float(overlap) <= 1.0:
            raise ValueError(f"overlap is the fraction of the CP ring's time hidden, in [0, 1]: got {overlap!r}")
        if ring not in RING_FORMS:
            raise ValueError(f"ring must be one of {RING_FORMS}, got {ring!r}")
        self.ring = ring
        self.base, self.cp, self.links, self.overlap = base, int(cp), links, float(overlap)
        self.shape = shape if shape is not None else base.shape
        self.strategies = tuple(base.strategies)
        self.num_layers = base.num_layers
        self.attention_rate = self._fallback_rate(hardware)
        self._memo: dict = {}

    # ------------------------------------------------------------------ delegated
    def static_bytes(self) -> float:
        return self.base.static_bytes()

    def recomputes(self) -> bool:
        return self.base.recomputes()

    def recompute_kinds(self) -> tuple:
        return tuple(self.base.recompute_kinds())

    def update_seconds(self) -> float:
        return self.base.update_seconds()

    def device_kind(self) -> str:
        return self.base.device_kind()

    def nonlayer(self, s, b: int) -> LayerCost:
        """The embedding, output layer and loss of the node's local tokens."""
        return self.base.nonlayer(self.local(s, b), b)

    def resident_bytes(self, s, b: int) -> float:
        return self.base.resident_bytes(self.local(s, b), b)

    def pool(self, strategy: str, s, b: int) -> dict:
        if self.cp > 1 and packs.is_pack(s):  # every CP rank's, each buffer at its largest
            got: dict = {}
            for local in self.local_packs(self.padded(s, b)):
                for k, v in self.base.pool(strategy, local, 1).items():
                    got[k] = max(got.get(k, 0.0), float(v))
            return got
        return self.base.pool(strategy, self.local(s, b), b)

    def step(self, plan, s, b: int):
        """The base's step at cp = 1 (exactly its numbers), else ``CostModel.step``."""
        if self.cp == 1:
            return self.base.step(plan, s, b)
        return super().step(plan, s, b)

    # ------------------------------------------------------------------ the layer
    def padded(self, s, b: int) -> int:
        """``s`` rounded up to a multiple of ``2*cp*p``, as the data path pads it (the 2*cp chunks
        of p ranks); ValueError for a pack, a length < 1 or b < 1 (cp = 1: ``s`` as given)."""
        if self.cp == 1:
            return s
        unit = ParallelDims(tp=self.shape.p, cp=self.cp).seq_divisor
        if packs.is_pack(s):
            if b != 1:
                raise ValueError(f"a pack is one row of the micro-batch: b must be 1, got b={b}")
            return s.padded(unit)
        if isinstance(s, bool) or int(s) != s or s < 1 or b < 1:
            raise ValueError(f"CP of size {self.cp} needs a length >= 1 and b >= 1 (got s={s}, b={b})")
        return -(-int(s) // unit) * unit

    def local(self, s, b: int):
        """The node's local length: the padded ``s`` / ``cp`` (:meth:`padded`); a pack: CP rank
        0's local pack (every rank holds as many tokens)."""
        if self.cp > 1 and packs.is_pack(s):
            return self.local_packs(self.padded(s, b))[0]
        return s if self.cp == 1 else self.padded(s, b) // self.cp

    def local_packs(self, s: PackShape) -> tuple:
        """Per CP rank, the pieces of the (padded) pack ``s``'s documents in its two chunks, as
        a pack (the in-node layout's documents, ``context.local_documents``)."""
        return tuple(PackShape(tuple(b - a for a, b, _ in pieces)) for pieces in _rank_pieces(s.lengths, self.cp))

    def layer(self, strategy: str, s, b: int) -> LayerCost:
        """One rank's layer under the plan entry ``strategy`` at the global length ``s``."""
        if self.cp == 1:
            return self.base.layer(strategy, s, b)
        s = self.padded(s, b)
        key = (strategy, s, b)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self.pack_layer(strategy, s) if packs.is_pack(s) else self._layer(strategy, s, b)
        return got

    def pack_layer(self, entry: str, s: PackShape) -> LayerCost:
        """One rank's layer on the padded pack ``s`` (the class docstring): each term the
        largest over the CP ranks."""
        name, rc = split_entry(entry)
        T = s.tokens
        L = T // self.cp
        per_pair = self.attention_seconds(entry, L, 1) / (L * (L + 1) / 2)
        hops = None if name in RING_FAMILY else self.pack_reach(s)
        ring = (1.0 - self.overlap) * self.ring_seconds(entry, T, 1, hops)
        saved, transient = self.ring_bytes(name, T, 1)
        if rc in ("layer", "attn"):
            saved, transient = 0.0, saved + transient
        worst = [0.0, 0.0, 0.0]
        for local, pieces in zip(self.local_packs(s), _rank_pieces(s.lengths, self.cp)):
            own = self.base.layer(entry, local, 1)
            extra = sum(_pairs(a - o, b - o) - (b - a) * (b - a + 1) / 2 for a, b, o in pieces)
            got = (own.seconds + extra * per_pair + ring, own.saved_bytes + saved, own.transient_bytes + transient)
            worst = [max(x, y) for x, y in zip(worst, got)]
        return LayerCost(*worst)

    def _layer(self, entry: str, s: int, b: int) -> LayerCost:
        """The class docstring's sum, not memoized."""
        name, rc = split_entry(entry)
        L = self.local(s, b)
        own = self.base.layer(entry, L, b)
        seconds = own.seconds + (self.cp - 1) * self.attention_seconds(entry, L, b) \
            + (1.0 - self.overlap) * self.ring_seconds(entry, s, b)
        saved, transient = self.ring_bytes(name, s, b)
        if rc in ("layer", "attn"):  # the recompute rebuilds what the plain attention keeps: transient
            saved, transient = 0.0, saved + transient
        return LayerCost(seconds, own.saved_bytes + saved, own.transient_bytes + transient)

    # ------------------------------------------------------------------ the terms
    def attention_seconds(self, entry: str, L: int, b: int) -> float:
        """The base's causal attention seconds of one layer at the local length ``L``.

        A base with a rate time model (``analytic.time_features`` times rates: the roofline's
        ``rates``, a fitted model's ``physics`` rates) is split by those rates: the attention
        term's share of the rate curve at ``L`` times the base's layer seconds (so a fitted
        model's measured correction and a recompute's extra scale both parts alike). A base
        without one: the analytic attention FLOPs (``analytic.flops_parts``) at the attention
        FLOP rate of ``configs/hardware.json``, times the base's recompute factor."""
        name, rc = split_entry(entry)
        total = self.base.layer(entry, L, b).seconds
        rates = self._rates(name)
        if rates is not None:
            feats = analytic.time_features(name, self.shape, L, b)
            curve = rates_predict(rates, feats)
            return total * rates.get("attn_flops", 0.0) * feats["attn_flops"] / curve if curve > 0 else 0.0
        att = analytic.flops_parts(name, self.shape, L, b)[1] / self.attention_rate
        if rc in ("layer", "attn"):
            plain = self.base.layer(name, L, b).seconds
            att *= total / plain if plain > 0 else 1.0
        return att

    def block_bytes(self, strategy: str, s: int, b: int) -> float:
        """Bytes one rank sends per K/V hop: K and V of ``s/(cp p)`` tokens x ``kv_heads``
        (``tp_sp`` / ``ulysses``: heads/p of all ``s/cp`` tokens, the same unless a rank holds
        a replicated K/V group, kv_heads < p)."""
        sh = self.shape
        kv = sh.query_groups * sh.head_dim
        if strategy not in RING_FAMILY:
            kv = max(sh.query_groups, sh.p) * sh.head_dim
        return s * b / (self.cp * sh.p) * 2 * kv * sh.elt

    def pack_reach(self, s: PackShape) -> int:
        """The most hops a K/V block of ``tp_sp`` / ``ulysses``'s CP ring travels on the padded
        pack ``s``: the runtime's ``RingComm.reach`` (``context.cp_layout``'s ``last_hops``);
        0 when no document crosses CP ranks."""
        from ..parallel.context import cp_layout
        from ..parallel.packing import Documents

        bounds = [0]
        for d in s.lengths:
            bounds.append(bounds[-1] + d)
        return max(cp_layout(self.cp, s.tokens // self.cp, Documents(tuple(bounds))).last_hops())

    def ring_seconds(self, entry: str, s: int, b: int, hops: int | None = None) -> float:
        """Seconds the CP ring adds to one layer (before ``overlap``). K/V passes: forward and
        backward (``metp``: 3, its backward recomputes attention; a recomputed entry: one more),
        plus one pass of fp32 dK/dV. ``tp_sp`` / ``ulysses``: C-1 K/V hops per pass and C
        dK/dV hops, all inter-node (``hops`` given, a pack's :meth:`pack_reach`: that many K/V
        hops per pass and one more dK/dV hop, none at 0). The ring family
        (:meth:`family_ring_seconds`): its ring over the C*p ranks, less the in-node ring of p-1
        (and p) hops on the in-node link that the base already priced at ``s/cp`` (blocks of the
        same size)."""
        name, rc = split_entry(entry)
        kv = self.block_bytes(name, s, b)
        dkv = kv * 4 / self.shape.elt
        passes = (3 if name == "metp" else 2) + (1 if rc in ("layer", "attn") else 0)
        if name in RING_FAMILY:
            return self.family_ring_seconds(passes, kv, dkv)
        hop, h = self.links.hop, self.cp - 1 if hops is None else int(hops)
        return passes * h * hop(kv, True) + (h + 1 if h else 0) * hop(dkv, True)

    def family_ring_seconds(self, passes: int, kv: float, dkv: float) -> float:
        """The ring family's added ring time: ``flat``, C*p-1 K/V hops per pass and C*p dK/dV
        hops, each on the inter-node link; ``two_level``, per pass C-1 inter-node hops and C
        in-node rings of p-1 hops (dK/dV: C inter-node hops, C in-node rings of p hops); less
        the base's in-node ring."""
        hop, C, p = self.links.hop, self.cp, self.shape.p
        inner = passes * (p - 1) * hop(kv, False) + p * hop(dkv, False) if p > 1 else 0.0
        if self.ring == "flat":
            n = C * p
            return passes * (n - 1) * hop(kv, True) + n * hop(dkv, True) - inner
        outer = passes * (C - 1) * hop(kv, True) + C * hop(dkv, True)
        return outer + (C - 1) * inner

    def ring_bytes(self, strategy: str, s: int, b: int) -> tuple:
        """``(saved, transient)`` bytes the CP ring adds to one plain layer: the visiting K/V
        blocks the pool holds, ``min(2, cp - 1)`` (the ring's double buffer); for the ring
        family's two-level ring also the outer ring's fp32 dK/dV accumulator (the in-node ring's
        are the base's), ``metp``'s blocks holding one head group (1/p of the heads);
        ``colossal``'s score rows over all s keys. Measured on CPU at cp = 2, 7056 tokens, the
        demo shape at p = 2 (model memory at cp = 2 minus cp = 1 at s/2): ``tp_sp:rc`` and
        ``metp:rc`` +1.8 MiB (one block is 1.7 MiB), ``ring:rc`` +3.9 MiB."""
        saved = transient = 0.0
        if strategy == "colossal":
            saved = transient = (self.cp - 1) * analytic.basis(self.shape, s // self.cp, b)["rows"]
        kv = self.block_bytes(strategy, s, b) * min(2, self.cp - 1)
        if strategy in RING_FAMILY:
            if self.ring != "two_level":
                return saved, transient
            kv = (kv + self.block_bytes(strategy, s, b) * 4 / self.shape.elt) / (self.shape.p if strategy == "metp" else 1)
        return saved, transient + kv

    # ------------------------------------------------------------------ rates
    def _rates(self, strategy: str) -> dict | None:
        """The base's time rates per ``analytic.time_features`` unit, or None: the roofline's
        ``rates``, a fitted model's ``physics`` rates of ``strategy`` (format 2)."""
        rates = getattr(self.base, "rates", None)
        if isinstance(rates, dict) and "attn_flops" in rates:
            return rates
        meta = getattr(self.base, "meta", None)
        if isinstance(meta, dict):
            phys = ((meta.get("targets") or {}).get(strategy) or {}).get("seconds", {}).get("physics", {})
            if phys.get("kind") == "rates":
                return phys["rates"]
        return None

    def _fallback_rate(self, hardware: str | None) -> float:
        """FLOP/s of attention for a base without rates: ``hardware.json``'s entry ``hardware``
        (default: the analytic base's own, else ``cpu`` or ``h100`` by the base's device)."""
        table = analytic.load_config("hardware.json")
        if hardware is None:
            own = getattr(self.base, "hardware", None)
            hardware = own if own in table else ("cpu" if self.base.device_kind() == "cpu" else "h100")
        if hardware not in table:
            known = sorted(k for k in table if not k.startswith("_"))
            raise ValueError(f"unknown hardware {hardware!r} (known: {known})")
        return float(table[hardware]["flops"][self.shape.dtype])


def _pairs(lo: int, hi: int) -> float:
    """Causal pairs of the queries at in-document positions ``[lo, hi)`` over their document's
    keys: sum of (i + 1)."""
    return (hi * (hi + 1) - lo * (lo + 1)) / 2


def _rank_pieces(lengths: tuple, cp: int) -> list:
    """Per CP rank, ``(start, stop, document start)`` (global positions) of the document pieces
    in its chunks c and 2cp-1-c of a pack of ``lengths`` (its total a multiple of 2cp)."""
    bounds = [0]
    for d in lengths:
        bounds.append(bounds[-1] + d)
    half = bounds[-1] // (2 * cp)
    out = []
    for c in range(cp):
        pieces = []
        for k in (c, 2 * cp - 1 - c):
            lo, hi = k * half, (k + 1) * half
            for o, e in zip(bounds, bounds[1:]):
                if o < hi and e > lo:
                    pieces.append((max(o, lo), min(e, hi), o))
        out.append(pieces)
    return out
