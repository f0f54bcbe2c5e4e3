"""Gating policy and the certified decode step of every engine (THEORY.md section 6).

``CertifiedDecode`` is one layer's decode step as both engine integrations run it: the fused kernel
(``witcert.kernels.decode_attention``) with its certificate, in gate mode merged with the exact part over the
(slot, KV head) pairs repaired at earlier steps, every row with a head still above ``tau`` recomputed on the
repair path, and the step's certificates handed to the telemetry's ``StepReport``. An engine supplies its
batch's paging (``DecodePaging``) and where exact K/V come from (``ExactFetch``, its host backup); the rest is
written here once.

A head whose certificate exceeds ``tau`` is repaired: the bound decomposes over tokens
(``A1 = sum_t p~_t expm1(u_t)``), exact tokens have ``u_t = 0``, so paging in a block of exact K/V
removes that block's share. ``certified_decode_rows`` repairs a batch of rows in rounds: each round pages
in, for every (row, KV head) read by a head above ``tau``, its blocks of largest share (1, 1, 2, 4, ...: as
many as it already has), all in one fetch, then recomputes the certificates once, until none exceeds
``tau``. Repaired (slot, KV head) pairs are handed back to the caller to keep: a request pays for each
slot at most once.

Later steps read those pairs exactly without the per-row path: the fused kernel skips them, the exact
part over them is computed for the whole batch at once (``exact_attention``), and ``merge_exact``
combines the two softmax parts and their certificate accumulators. The repair path is plain torch: it runs on
the rows whose merged certificate exceeds tau, once per group of rows of equal length.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from witcert.integrations.telemetry.step_report import StepReport
from witcert.kernels import KVPool, decode_attention, reference

_log = logging.getLogger("witcert.integrations")


class GateMode(StrEnum):
    """What the cache does with the certificates it computes."""

    OFF = "off"  # int8 cache, certificates neither reported nor acted on
    OBSERVE = "observe"  # certificates reported to the aggregator, never acted on
    GATE = "gate"  # reported, and every head above tau is repaired from exact K/V


class CachePolicy(BaseModel):
    """Every knob of the certified int8 KV cache, validated once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: GateMode = GateMode.GATE
    tau: float = Field(0.05, gt=0.0, lt=1.0, description="repair any head whose certificate exceeds this TV bound")
    outlier_pairs: int = Field(0, ge=0, description="m: RoPE pairs per head stored exactly (lowest frequencies)")
    outlier_file: Path | None = Field(
        None, description="exact RoPE pairs per (layer, KV head) from `witcert calibrate`; excludes outlier_pairs"
    )
    group_size: int = Field(32, gt=0, description="channels sharing one fp16 scale")
    dither_bits: Literal[8, 16, 24] = 8
    v_dither: bool = Field(
        False,
        description="dither V too: only the output-error bound's stochastic term uses it, and it costs decode speed",
    )
    seed: int | None = Field(
        None, ge=0, lt=2**64, description="Philox key of the dither streams; None: drawn at random for each pool"
    )
    delta_req: float = Field(1e-2, gt=0.0, lt=1.0, description="failure probability of a whole request")
    horizon: int = Field(256, gt=0, description="T: decode steps the union bound covers")
    repair_block: int = Field(16, gt=0, description="tokens per block paged in from the exact backup")
    stride: int = Field(1, gt=0, description="the aggregator keeps raw samples every stride-th step")

    @model_validator(mode="after")
    def _one_outlier_source(self) -> CachePolicy:
        if self.outlier_file is not None and self.outlier_pairs:
            raise ValueError("give outlier_pairs (the lowest-frequency pairs) or outlier_file, not both")
        return self

    def exact_pairs(self) -> int:
        """``m``: the RoPE pairs per (layer, KV head) stored exactly (reads the outlier file, if one is named)."""
        if self.outlier_file is None:
            return self.outlier_pairs
        from witcert.kernels.outliers import OutlierFile

        return OutlierFile.load(self.outlier_file).m

    def outlier_channels(self, num_layers: int, kv_heads: int, head_dim: int, model: str | None = None):
        """What ``KVPool(outlier_channels=...)`` takes: the outlier file checked against this shape (and model, if
        named), the lowest-frequency ``outlier_pairs``, or ``None``."""
        from witcert.kernels.outliers import OutlierFile, lowest_frequency_pairs

        if self.outlier_file is not None:
            outliers = OutlierFile.load(self.outlier_file)
            outliers.check(
                num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim, model=model,
                source=str(self.outlier_file),
            )  # fmt: skip
            return outliers
        if self.outlier_pairs:
            return reference.rope_pair_channels(lowest_frequency_pairs(head_dim, self.outlier_pairs), head_dim)
        return None

    def delta_step(self, num_layers: int, num_q_heads: int) -> float:
        return reference.delta_step(num_layers, num_q_heads, delta_req=self.delta_req, horizon=self.horizon)


RowsFetch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``fetch(rows, positions, kv_heads) -> (k, v)``: the exact rows ``[n, D]`` of the (token, KV head) pairs
``(positions[i], kv_heads[i])`` of batch rows ``rows[i]``, from the host backup: one call per repair round."""


@dataclass
class RowsDecode:
    """A decode step of ``R`` sequences at one layer through the certified torch path: ``[R, H_q, ...]``."""

    out: torch.Tensor  # [R, H_q, D] float32
    certificate: torch.Tensor  # [R, H_q] float32, after any repair
    fallback: torch.Tensor  # [R, H_q] bool: this head was above tau at the start of some repair round
    repaired_bytes: torch.Tensor  # [R, H_q] int64: bytes paged in on this head's behalf
    # One entry per repair round: (rows, positions, kv_heads [n], k, v [n, D]) of the pairs paged in.
    repaired_pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def block_shares(
    probs: torch.Tensor, radius: torch.Tensor, block_of_position: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """Each block's share ``sum_{t in block} p~_t expm1(u_t)`` of T1, per head: ``[..., S]`` -> ``[..., num_blocks]``.

    An overflowed term (``0 * inf``) counts as +inf: such a block must be paged in first.
    """
    terms = torch.nan_to_num(probs * torch.expm1(radius), nan=math.inf)
    shares = torch.zeros(*terms.shape[:-1], num_blocks, dtype=terms.dtype, device=terms.device)
    return shares.index_add_(-1, block_of_position, terms)


def _largest_pending(
    shares: torch.Tensor,
    budget: torch.Tensor,
    exact_mask: torch.Tensor,
    block_of_position: torch.Tensor,
    num_blocks: int,
) -> torch.Tensor:
    """``[H_kv, num_blocks]``: for each KV head, its ``budget`` blocks of largest ``shares`` that still hold a
    quantized token (fewer if fewer are left). Ties go to the lower block, as ``argmax`` would pick."""
    pending = torch.zeros(exact_mask.shape[1], num_blocks, dtype=torch.int64, device=shares.device)
    pending = pending.index_add_(1, block_of_position, (~exact_mask).T.to(torch.int64)) > 0
    order = torch.where(pending, shares, -1.0).argsort(dim=-1, descending=True, stable=True)
    rank = torch.arange(num_blocks, device=shares.device)
    return torch.zeros_like(pending).scatter_(-1, order, (rank < budget[:, None]) & pending.gather(-1, order))


def certified_decode_rows(
    q: torch.Tensor,
    keys: Sequence[reference.QuantizedKV],
    values: torch.Tensor,
    exact_mask: torch.Tensor,
    exact_keys: torch.Tensor,
    exact_values: torch.Tensor,
    *,
    sm_scale: float,
    delta: float,
    tau: float | None,
    fetch: RowsFetch | None,
    block_size: int,
) -> RowsDecode:
    """Decode ``R`` sequences of ``S`` tokens each at one layer, with certificates, repairing heads above ``tau``.

    ``q`` ``[R, H_q, D]``; ``keys`` the quantized K of each row's ``S`` slots; ``values`` the dequantized V
    ``[R, S, H_kv, D]``; ``exact_mask`` ``[R, S, H_kv]`` marks tokens already repaired, whose exact rows are
    in ``exact_keys`` / ``exact_values`` ``[R, S, H_kv, D]`` (ignored elsewhere) and whose radius is zero.
    ``tau=None`` observes only. The inputs ``exact_*`` are updated in place with what gets paged in.

    Repair runs in rounds, over all rows at once. A round takes every (row, KV head) ``h`` read by a query
    head above ``tau`` (NaN counts as above), ranks the blocks of ``h`` that still hold a quantized token by
    their share of ``A1`` summed over those query heads, pages in the ``max(1, n_h)`` largest (``n_h``:
    blocks of ``h`` paged in by earlier rounds of this call) for all such ``h`` in one ``fetch``, and
    recomputes every certificate of their query heads. Every certificate returned is the one recomputed
    after the last round, and is ``<= tau``. Repairs only what it must, in this sense: a block of ``h`` is
    paged in only in a round that starts with a query head of ``h`` above ``tau``, and ``h`` gets at most
    ``max(1, 2 n)`` blocks, where ``n`` is the number paged in when ``h`` was last found above ``tau`` (at
    most twice the blocks shown to be too few). A call takes at most ``ceil(log2(num_blocks)) + 1``
    rounds. The bytes of the rows of ``h`` are charged to its first query head above ``tau`` in that round.
    Raises ``RuntimeError`` if a head stays above ``tau`` with all its tokens exact (only a NaN query can).
    """
    q = q.to(torch.float32)
    num_rows, num_q_heads, head_dim = q.shape
    _, num_tokens, num_kv_heads, _ = values.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if len(keys) != num_rows:
        raise ValueError(f"{num_rows} query rows but {len(keys)} key rows")
    if tau is not None and fetch is None:
        raise ValueError("gating needs a way to fetch exact K/V (fetch=None)")
    group_size = num_q_heads // num_kv_heads
    num_cells = num_rows * num_kv_heads  # cell c = (row c // H_kv, KV head c % H_kv); query row c * G + g reads it
    kv_of_q = torch.arange(num_q_heads, device=q.device) // group_size

    k_hat = torch.stack([row_keys.dequantize(torch.float32) for row_keys in keys])
    k_eff = torch.where(exact_mask[..., None], exact_keys.to(torch.float32), k_hat)
    # Grouped matmuls [R, H_kv, G, D] x [R, H_kv, D, S]: no copy of K per query head.
    logits = sm_scale * (q.view(num_rows, num_kv_heads, group_size, head_dim) @ k_eff.permute(0, 2, 3, 1))
    logits = logits.reshape(num_rows * num_q_heads, num_tokens)
    radius = torch.stack(
        [
            reference.logit_radius(q[r], keys[r], sm_scale=sm_scale, delta=delta, kv_head_of_query=kv_of_q)
            for r in range(num_rows)
        ]
    )
    exact_rows = exact_mask.transpose(1, 2)[:, kv_of_q].reshape(num_rows * num_q_heads, num_tokens)
    radius = radius.reshape(num_rows * num_q_heads, -1).masked_fill(exact_rows, 0.0)

    probs = torch.softmax(logits, dim=-1)
    certificate = reference.accumulate_certificate(probs, radius, exact_rows).certificate
    fallback = torch.zeros(num_rows * num_q_heads, dtype=torch.bool, device=q.device)
    repaired_bytes = torch.zeros(num_rows * num_q_heads, dtype=torch.int64, device=q.device)
    repaired: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    if tau is not None:
        block_of_position = torch.arange(num_tokens, device=q.device) // block_size
        num_blocks = (num_tokens + block_size - 1) // block_size
        cell_mask = exact_mask.permute(1, 0, 2).reshape(num_tokens, num_cells)  # view or copy: both updated
        q_rows = q.reshape(num_rows * num_q_heads, head_dim)
        paged = torch.zeros(num_cells, dtype=torch.int64, device=q.device)  # blocks paged in by this call
        first_head = torch.arange(num_cells, device=q.device) * group_size
        # Repairing one cell changes the softmax of every query head reading it, and a certificate is not
        # monotone in that change: re-check all heads after every round until none exceeds tau.
        while True:
            over = ~(certificate <= tau)  # NaN counts as over: repair rather than trust it
            over_cell = over.view(num_cells, group_size).any(-1)
            if not bool(over_cell.any()):
                break
            shares = block_shares(probs, radius, block_of_position, num_blocks)  # [R * H_q, blocks]
            shares = torch.where(over[:, None], shares, 0.0).view(num_cells, group_size, num_blocks).sum(1)
            budget = torch.where(over_cell, paged.clamp_min(1), 0)  # doubling: 1, 1, 2, 4, ... blocks per round
            chosen = _largest_pending(shares, budget, cell_mask, block_of_position, num_blocks)  # [cells, blocks]
            positions, cells = (chosen.T[block_of_position] & ~cell_mask).nonzero(as_tuple=True)
            if positions.numel() == 0:
                # Every token of an over-tau head is exact, so its radius is zero: only a NaN gets here.
                raise RuntimeError(f"heads {over.nonzero().squeeze(-1).tolist()} stay above tau with all K/V exact")
            rows, kv_heads = cells // num_kv_heads, cells % num_kv_heads
            k_exact, v_exact = fetch(rows, positions, kv_heads)
            cell_mask[positions, cells] = True
            exact_mask[rows, positions, kv_heads] = True
            exact_keys[rows, positions, kv_heads] = k_exact.to(exact_keys.dtype)
            exact_values[rows, positions, kv_heads] = v_exact.to(exact_values.dtype)
            repaired.append((rows, positions, kv_heads, k_exact, v_exact))
            paged += chosen.sum(-1)
            fallback |= over
            # Each cell's rows are charged to its first query head above tau in this round.
            row_bytes = (k_exact.element_size() + v_exact.element_size()) * head_dim
            charged = first_head + over.view(num_cells, group_size).to(torch.int8).argmax(-1)
            repaired_bytes.index_add_(0, charged[cells], torch.full_like(cells, row_bytes))

            readers = cells[:, None] * group_size + torch.arange(group_size, device=q.device)  # [n, G]
            logits[readers, positions[:, None]] = (
                sm_scale * (q_rows[readers] @ k_exact.to(torch.float32)[:, :, None])[..., 0]
            )
            radius[readers, positions[:, None]] = 0.0
            exact_rows[readers, positions[:, None]] = True
            heads = over_cell.repeat_interleave(group_size)
            probs[heads] = torch.softmax(logits[heads], dim=-1)
            certificate[heads] = reference.accumulate_certificate(
                probs[heads], radius[heads], exact_rows[heads]
            ).certificate

    v_eff = torch.where(exact_mask[..., None], exact_values.to(torch.float32), values.to(torch.float32))
    out = probs.view(num_rows, num_kv_heads, group_size, num_tokens) @ v_eff.permute(0, 2, 1, 3)
    shape = (num_rows, num_q_heads)
    return RowsDecode(
        out=out.reshape(num_rows, num_q_heads, head_dim),
        certificate=certificate.view(shape),
        fallback=fallback.view(shape),
        repaired_bytes=repaired_bytes.view(shape),
        repaired_pairs=repaired,
    )


class RepairedStore:
    """Exact K/V rows of one layer's repaired (slot, KV head) pairs, kept on the device.

    Entry ``n`` holds the exact ``keys[n]``, ``values[n]`` ``[D]`` of pair ``(slot[n], kv_head[n])``;
    entries are sorted by ``slot * H_kv + kv_head`` and name distinct pairs. The caller keeps the layer's
    mask ``repaired`` ``[num_slots, H_kv]`` of held pairs (the kernel's ``skip``) and marks the pairs it
    adds; an entry counts only while that mask holds its pair, so clearing the mask of a rewritten slot
    (SGLang's ``set_kv_buffer``) makes its entries dead, and ``add`` drops every dead entry before it
    appends. Between two ``add`` calls only the caller's marking after ``add`` sets the mask, so a live
    pair never has a stale entry beside it.

    Size: at most one entry per (slot, KV head) pair of the layer (``add`` deduplicates). Cost:
    ``2 * D * itemsize + 16`` device bytes per repaired pair and layer (exact K and V rows in the model's
    dtype, two int64 indices): 528 B for D = 128 in fp16, against the ``2 * (D + 2 D/G)`` = 272 B of its
    int8 cells (G = 32). ``add`` briefly holds the old and the new arrays together.
    """

    def __init__(self, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.kv_heads = kv_heads
        self.slot = torch.empty(0, dtype=torch.int64, device=device)
        self.kv_head = torch.empty(0, dtype=torch.int64, device=device)
        self.keys = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.values = torch.empty(0, head_dim, dtype=dtype, device=device)

    def __len__(self) -> int:
        return self.slot.shape[0]  # known on the host: no sync

    def live(self, repaired: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: the entries whose pair ``repaired`` (the layer's ``[num_rows, H_kv]`` mask) still holds."""
        return repaired[self.slot, self.kv_head]

    def add(
        self,
        repaired: torch.Tensor,
        slots: torch.Tensor,
        kv_heads: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Drop the dead entries, then keep the exact rows ``k``, ``v`` ``[n, D]`` of the pairs
        ``(slots[i], kv_heads[i])`` (a pair already held, or given twice, is kept once). ``repaired``: the
        layer's mask before these pairs are marked. Two host syncs (the sizes of what is kept)."""
        keep = self.live(repaired).nonzero().squeeze(-1)
        slot = torch.cat((self.slot[keep], slots.to(self.slot)))
        kv_head = torch.cat((self.kv_head[keep], kv_heads.to(self.kv_head)))
        key, order = (slot * self.kv_heads + kv_head).sort(stable=True)
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]
        order = order[first]
        self.slot, self.kv_head = slot[order], kv_head[order]
        self.keys = torch.cat((self.keys[keep], k.to(self.keys)))[order]
        self.values = torch.cat((self.values[keep], v.to(self.values)))[order]

    def dense(self, repaired: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``slots`` ``[P]`` (repeats allowed): which pairs are repaired ``[P, H_kv]`` (``repaired``: the
        layer's mask), and their exact K and V ``[P, H_kv, D]`` from this store (zero elsewhere). No host sync."""
        wanted = slots[:, None] * self.kv_heads + torch.arange(self.kv_heads, device=slots.device)
        if len(self) == 0:
            empty = torch.zeros(*wanted.shape, self.keys.shape[1], dtype=self.keys.dtype, device=slots.device)
            return torch.zeros_like(wanted, dtype=torch.bool), empty, empty.clone()
        key = self.slot * self.kv_heads + self.kv_head
        index = torch.searchsorted(key, wanted).clamp_max(len(self) - 1)
        # A dead entry (its slot rewritten) may still sit here: the mask decides, and names only held pairs.
        held = (key[index] == wanted) & repaired[slots]
        zero = torch.zeros((), dtype=self.keys.dtype, device=slots.device)
        return (
            held,
            torch.where(held[..., None], self.keys[index], zero),
            torch.where(held[..., None], self.values[index], zero),
        )


def repair_pool_rows(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    slots: torch.Tensor,
    store: RepairedStore,
    skip: torch.Tensor,
    fetch: RowsFetch,
    *,
    sm_scale: float,
    delta: float,
    tau: float,
    block_size: int,
) -> RowsDecode:
    """``certified_decode_rows`` over rows of ``pool``'s ``layer``: ``q`` ``[R, H_q, D]``, ``slots`` ``[R, S]``.

    Pairs held in ``store`` (marked in ``skip``, the layer's ``[num_slots, H_kv]`` mask) are read exactly
    from it; the pairs the repair pages in through ``fetch`` join ``store`` and are marked in ``skip``, so
    later steps read them through the kernel's skip and ``merge_exact``. One ``store.add`` per call.
    """
    num_rows, length = slots.shape
    mask, exact_k, exact_v = store.dense(skip, slots.reshape(-1))
    shape = (num_rows, length, pool.kv_heads)
    decoded = certified_decode_rows(
        q.float(),
        [pool.quantized(layer, row_slots, "k") for row_slots in slots],
        pool.dequantize(layer, slots.reshape(-1), "v").view(*shape, -1),
        mask.view(shape),
        exact_k.view(*shape, -1),
        exact_v.view(*shape, -1),
        sm_scale=sm_scale,
        delta=delta,
        tau=tau,
        fetch=fetch,
        block_size=block_size,
    )
    if decoded.repaired_pairs:
        rows, positions, kv_heads, k_exact, v_exact = (
            torch.cat(part) for part in zip(*decoded.repaired_pairs, strict=True)
        )
        store.add(skip, slots[rows, positions], kv_heads, k_exact, v_exact)
        skip[slots[rows, positions], kv_heads] = True
    return decoded


@dataclass
class ExactPart:
    """Attention over the exactly read (repaired) tokens alone: ``out`` ``[B, H_q, D]``, ``lse`` ``[B, H_q]``.

    A head with no such token has ``lse = -inf`` and ``out = 0``.
    """

    out: torch.Tensor
    lse: torch.Tensor  # natural log of sum_t exp(z_t) over the exact tokens


def exact_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    row_of: torch.Tensor,
    kv_head_of: torch.Tensor,
    *,
    num_kv_heads: int,
    sm_scale: float,
) -> ExactPart:
    """Attention of ``q`` ``[B, H_q, D]`` over ``N`` exact (token, KV head) pairs, all rows of the batch at once.

    Pair ``n`` holds the exact ``keys[n]``, ``values[n]`` ``[D]`` of one token of batch row ``row_of[n]``
    at KV head ``kv_head_of[n]``; every query head of that KV head reads it. Computes in float64 for a
    float64 ``q``, otherwise float32. No host sync, no Python loop over rows.
    """
    batch, num_q_heads, head_dim = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    cells = batch * num_kv_heads
    segment = row_of * num_kv_heads + kv_head_of  # [N]: the (row, KV head) cell of each pair
    q_cells = q.to(dtype).reshape(cells, group, head_dim)
    logits = sm_scale * (q_cells[segment] @ keys.to(dtype)[:, :, None]).squeeze(-1)  # [N, G]
    max_logit = torch.full((cells, group), -math.inf, dtype=dtype, device=q.device)
    max_logit.scatter_reduce_(0, segment[:, None].expand_as(logits), logits, reduce="amax")
    weights = torch.exp(logits - max_logit[segment])  # [N, G], each cell's largest is 1
    total = torch.zeros_like(max_logit).index_add_(0, segment, weights)
    weighted = torch.zeros(cells, group, head_dim, dtype=dtype, device=q.device)
    weighted.index_add_(0, segment, weights[:, :, None] * values.to(dtype)[:, None, :])
    live = total > 0
    safe_total = torch.where(live, total, 1.0)
    return ExactPart(
        out=(weighted / safe_total[:, :, None]).reshape(batch, num_q_heads, head_dim),
        lse=torch.where(live, max_logit + torch.log(safe_total), -math.inf).reshape(batch, num_q_heads),
    )


@dataclass
class MergedDecode:
    """The attention over all tokens of a row, quantized and exact: ``out`` ``[B, H_q, D]``, the rest ``[B, H_q]``."""

    out: torch.Tensor
    lse: torch.Tensor
    certificate: torch.Tensor


def merge_exact(
    out_q: torch.Tensor,
    lse_q: torch.Tensor,
    accumulators: reference.CertificateAccumulators,
    certificate_q: torch.Tensor,
    exact: ExactPart,
) -> MergedDecode:
    """Merge the kernel's part over the quantized tokens with the exact part over the repaired ones.

    ``out_q``, ``lse_q``, ``accumulators`` and ``certificate_q`` are the kernel's outputs over the tokens
    it read, normalized by its own ``lse_q``. The token held apart stays the kernel's (section 3
    holds for any held token, THEORY.md section 6): exact tokens have radius 0, so they add only their
    mass ``w_e`` to ``P_rest`` and nothing to the other rest sums, and the certificate is never looser
    than holding the overall argmax apart. A head with no quantized token gets certificate 0; a head with
    no exact token keeps the kernel's values. An overflowed (+inf) accumulator stays +inf, never NaN.
    """
    q_live = lse_q > -math.inf
    e_live = exact.lse > -math.inf
    lse = torch.logaddexp(lse_q, exact.lse)
    safe_lse = torch.where(lse > -math.inf, lse, 0.0)
    w_q = torch.where(q_live, torch.exp(lse_q - safe_lse), 0.0)
    w_e = torch.where(e_live, torch.exp(exact.lse - safe_lse), 0.0)
    out = w_q[..., None] * out_q + w_e[..., None] * exact.out

    zero = torch.zeros((), dtype=lse_q.dtype, device=lse_q.device)
    kernel = accumulators
    merged = reference.CertificateAccumulators(
        a1_rest=reference.mul_nonneg(w_q, kernel.a1_rest),
        b_rest=reference.mul_nonneg(w_q, kernel.b_rest),
        u_rest=reference.mul_nonneg(w_q, kernel.u_rest),
        p_rest=w_q * kernel.p_rest + w_e,
        p_max=w_q * kernel.p_max,
        u_max=kernel.u_max,
    ).certificate
    certificate = torch.where(e_live, torch.where(q_live, merged, zero), certificate_q)
    return MergedDecode(out=out, lse=lse, certificate=certificate)


ExactFetch = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``fetch(layer, slots, kv_heads) -> (k, v)``: the exact rows ``[n, D]`` of the (slot, KV head) pairs
``(slots[i], kv_heads[i])`` of the pool's ``layer``, on the pool's device, from the engine's host backup."""


@dataclass
class DecodePaging:
    """One decode batch's paging, shared by the layers of its step: row ``b`` reads the slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.

    Gate mode also needs ``indptr`` on the host (rows of equal length are repaired together) and, to pair the
    repaired pairs with the rows that read them, ``kv_indices`` sorted (``sorted_slots``, with each entry's row in
    ``sorted_rows``) and the most rows any slot is read by (``multiplicity``: more than 1 for a prefix shared
    through a radix cache).
    """

    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [T]
    indptr: list[int] | None = None
    sorted_slots: torch.Tensor | None = None  # [T]
    sorted_rows: torch.Tensor | None = None  # [T]
    multiplicity: int = 0

    @classmethod
    def build(
        cls,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        *,
        gate: bool,
        host: tuple[list[int], int] | None = None,
    ) -> DecodePaging:
        """The paging of a batch; with ``gate``, its host part too: ``host`` (``indptr`` and the multiplicity) where
        the engine knows them, else read from the device in one host sync."""
        if not gate:
            return cls(kv_indptr, kv_indices)
        total = kv_indices.numel()
        batch = kv_indptr.numel() - 1
        device = kv_indices.device
        rows = torch.repeat_interleave(torch.arange(batch, device=device), kv_indptr.diff(), output_size=total)
        sorted_slots, order = kv_indices.sort(stable=True)
        if host is None:
            runs = torch.searchsorted(sorted_slots, sorted_slots, right=True)
            runs -= torch.searchsorted(sorted_slots, sorted_slots)  # how many entries hold each entry's slot
            most = torch.cat((runs, runs.new_zeros(1))).max()  # 0 for an empty batch
            *indptr, multiplicity = torch.cat((kv_indptr, most[None])).tolist()
        else:
            indptr, multiplicity = host
        return cls(kv_indptr, kv_indices, list(indptr), sorted_slots, rows[order], int(multiplicity))

    def row_slots(self, rows: torch.Tensor, length: int) -> torch.Tensor:
        """``[R, length]``: the slots of batch rows ``rows``, all ``length`` tokens long."""
        return self.kv_indices[self.kv_indptr[rows][:, None] + torch.arange(length, device=self.kv_indices.device)]

    def equal_length_rows(self, rows: list[int]) -> dict[int, list[int]]:
        """``rows`` grouped by their length (needs ``indptr``)."""
        groups: dict[int, list[int]] = {}
        for row in rows:
            groups.setdefault(self.indptr[row + 1] - self.indptr[row], []).append(row)
        return groups


@dataclass
class CertifiedStep:
    """One layer's decode step: ``out`` ``[B, H_q, D]`` float32; with a certificate (observe and gate modes) its
    ``certificate`` ``[B, H_q]``; in gate mode ``fallback`` (bool: the head was above tau at the start of a repair
    round) and ``repaired_bytes`` (int64: bytes paged in on its behalf) ``[B, H_q]``, else None."""

    out: torch.Tensor
    certificate: torch.Tensor | None
    fallback: torch.Tensor | None
    repaired_bytes: torch.Tensor | None


class CertifiedDecode:
    """The certified decode step of one engine's pool, the same for every engine.

    ``pool``'s layer ``l`` keeps its repaired (slot, KV head) pairs in ``skip[l]`` (bool ``[num_slots, H_kv]``,
    the kernel's skip mask) and their exact rows in ``stores[l]``; new pairs come from ``fetch``. Gate mode needs
    all three. ``report`` (optional) gets every layer's certificates, fallbacks and repaired bytes; ``on_step``
    (optional) is called before it with ``(layer, query, step, sm_scale)``, the engine's own accounting and checks:
    if it raises, that layer stays out of the report.

    A call (``__call__``): the fused kernel over the batch, skipping the pairs held; in gate mode the exact part
    over them, computed for the whole batch at once (each pair goes to every row that reads its slot) and merged
    with the kernel's part, certificate included. A row whose merged certificate is within tau keeps that output,
    which the certificate covers; the others are recomputed on the repair path, rows of equal length together
    (``repair_pool_rows``), and their new pairs join ``skip`` and the store. Gate mode syncs with the host once
    per layer (which rows exceed tau); observe and off modes never. With a ``report``, the kernel writes the
    certificates into the report's buffer (``StepReport.destination``): a step's ``certificate`` is a view of it,
    valid until the same layer of the next step (copy it to keep it).
    """

    def __init__(
        self,
        pool: KVPool,
        policy: CachePolicy,
        delta_step: float,
        *,
        skip: Sequence[torch.Tensor] | None = None,
        stores: Sequence[RepairedStore] | None = None,
        fetch: ExactFetch | None = None,
        report: StepReport | None = None,
        on_step: Callable[[int, torch.Tensor, CertifiedStep, float], None] | None = None,
    ) -> None:
        if policy.mode is GateMode.GATE and (skip is None or stores is None or fetch is None):
            raise ValueError("gate mode needs the repaired pairs' masks, their stores and a fetch of exact K/V")
        self.pool, self.policy, self.delta_step = pool, policy, delta_step
        self.skip, self.stores, self.fetch, self.report, self.on_step = skip, stores, fetch, report, on_step

    def __call__(self, layer: int, query: torch.Tensor, paging: DecodePaging, sm_scale: float) -> CertifiedStep:
        """Layer ``layer``'s attention of ``query`` ``[B, H_q, D]`` (the pool's dtype) over ``paging``."""
        mode = self.policy.mode
        gate = mode is GateMode.GATE
        # The kernel writes the certificates into the report's buffer (no copy per layer); gating's merge and repair
        # replace or update them there before the report counts them.
        reported = self.report is not None and mode is not GateMode.OFF
        result = decode_attention(
            query,
            self.pool,
            layer,
            paging.kv_indptr,
            paging.kv_indices,
            sm_scale=sm_scale,
            delta_step=self.delta_step,
            certificate=mode is not GateMode.OFF,
            skip=self.skip[layer] if gate else None,
            certificate_out=self.report.destination(layer, query.shape[0]) if reported else None,
        )
        step = CertifiedStep(result.out, result.certificate, None, None)
        if mode is GateMode.OFF:
            return step
        if gate:
            step.fallback = torch.zeros(step.certificate.shape, dtype=torch.bool, device=query.device)
            step.repaired_bytes = torch.zeros(step.certificate.shape, dtype=torch.int64, device=query.device)
            exact = self._exact_part(layer, query, paging, sm_scale)
            if exact is not None:
                merged = merge_exact(step.out, result.lse, result.accumulators, step.certificate, exact)
                step.out, step.certificate = merged.out, merged.certificate
            self._repair(layer, query, paging, sm_scale, step)
        if self.on_step is not None:
            self.on_step(layer, query, step, sm_scale)
        if self.report is not None:
            self.report.record(layer, step.certificate, step.fallback, step.repaired_bytes)
        return step

    def _exact_part(self, layer: int, query: torch.Tensor, paging: DecodePaging, sm_scale: float) -> ExactPart | None:
        """Attention of the batch over its repaired pairs, from the layer's store: every entry is paired with each
        row that reads its slot (``multiplicity`` copies, the unused ones and the dead entries sent to an extra row
        that is then dropped). No host sync, no Python loop over rows; ``None`` when the store is empty."""
        store = self.stores[layer]
        copies = paging.multiplicity
        if len(store) == 0 or copies == 0:
            return None
        batch = query.shape[0]
        device = query.device
        sorted_slots = paging.sorted_slots
        first = torch.searchsorted(sorted_slots, store.slot)[:, None] + torch.arange(copies, device=device)
        at = first.clamp_max(sorted_slots.numel() - 1)  # [n, copies]
        hit = (first < sorted_slots.numel()) & (sorted_slots[at] == store.slot[:, None])
        hit &= store.live(self.skip[layer])[:, None]
        row = torch.where(hit, paging.sorted_rows[at], batch).reshape(-1)
        keys, values, kv_head = store.keys, store.values, store.kv_head
        if copies > 1:
            entry = torch.arange(len(store), device=device).repeat_interleave(copies)
            keys, values, kv_head = keys[entry], values[entry], kv_head[entry]
        exact = exact_attention(
            torch.cat((query, query.new_zeros(1, *query.shape[1:]))),
            keys,
            values,
            row,
            kv_head,
            num_kv_heads=self.pool.kv_heads,
            sm_scale=sm_scale,
        )
        return ExactPart(out=exact.out[:batch], lse=exact.lse[:batch])

    def _repair(
        self, layer: int, query: torch.Tensor, paging: DecodePaging, sm_scale: float, step: CertifiedStep
    ) -> None:
        """Recompute, in ``step``, every row with a head above tau from exact K/V paged in by blocks."""
        certificate = step.certificate
        # The one host sync of the layer: a flag per row (a nonzero() would add a sync of its own).
        over_rows = [row for row, over in enumerate((~(certificate <= self.policy.tau)).any(-1).tolist()) if over]
        if not over_rows:
            return
        if bool(certificate[over_rows].isnan().any()):
            # The repair path recomputes these rows in torch, so the report never sees this NaN.
            _log.error("decode returned a NaN certificate at layer %d (rows %s): recomputed", layer, over_rows)
        for length, rows in paging.equal_length_rows(over_rows).items():
            index = torch.tensor(rows, device=certificate.device)
            slots = paging.row_slots(index, length)  # [R, S]

            def fetch(
                cells: torch.Tensor, positions: torch.Tensor, kv_heads: torch.Tensor, slots: torch.Tensor = slots
            ) -> tuple[torch.Tensor, torch.Tensor]:
                return self.fetch(layer, slots[cells, positions], kv_heads)

            decoded = repair_pool_rows(
                query[index],
                self.pool,
                layer,
                slots,
                self.stores[layer],
                self.skip[layer],
                fetch,
                sm_scale=sm_scale,
                delta=self.delta_step,
                tau=self.policy.tau,
                block_size=self.policy.repair_block,
            )
            step.out[index] = decoded.out.to(step.out.dtype)
            certificate[index] = decoded.certificate
            step.fallback[index] = decoded.fallback
            step.repaired_bytes[index] = decoded.repaired_bytes
