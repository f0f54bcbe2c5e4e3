"""An extend batch's offsets on the host, checked once per batch, and the SDPA path's calls planned from them.

An engine knows a batch's ``qo_indptr`` and ``kv_indptr`` once per batch, while ``extend_attention`` runs
once per layer. ``ExtendBounds`` checks the offsets against each other when it is made and plans the SDPA
path's calls (``equal_runs``) the first time they are needed, so each layer call only checks that the
offsets belong to its tensors (``check_against``). A plain ``(qo, kv)`` pair of lists still works; it is
checked on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import NamedTuple


class EqualRun(NamedTuple):
    """``count`` consecutive sequences, each with ``new`` query rows over ``seen`` keys, the first at rows
    ``q_start`` of q and ``kv_start`` of the gathered keys."""

    q_start: int
    kv_start: int
    count: int
    new: int
    seen: int


def equal_runs(qo_indptr: list[int], kv_indptr: list[int]) -> list[EqualRun]:
    """The batch as runs of consecutive sequences of equal shape, skipping sequences without new tokens:
    one SDPA call each. A batch of equal prompts is one run; the offsets must be valid (checked)."""
    runs: list[EqualRun] = []
    start = count = new = seen = 0  # the open run: its sequences' first key, number and shape
    for b in range(len(qo_indptr) - 1):
        b_new, b_seen = qo_indptr[b + 1] - qo_indptr[b], kv_indptr[b + 1] - kv_indptr[b]
        if b_new == 0:
            continue
        # An idle sequence's keys between two equal ones break the run: they would be read as theirs.
        if count and (b_new, b_seen) == (new, seen) and start + count * seen == kv_indptr[b]:
            count += 1
            continue
        if count:
            runs.append(EqualRun(qo_indptr[b] - count * new, start, count, new, seen))
        start, count, new, seen = kv_indptr[b], 1, b_new, b_seen
    if count:
        runs.append(EqualRun(qo_indptr[-1] - count * new, start, count, new, seen))
    return runs


def check_kv_indptr(kv: list[int]) -> None:
    """``kv_indptr`` on its own: starts at 0 or later, never decreases (its end is checked per call)."""
    if not kv:
        raise ValueError("kv_indptr must have B + 1 entries")
    if kv[0] < 0:
        raise ValueError("kv_indptr[0] must be >= 0")
    if any(b < a for a, b in pairwise(kv)):
        raise ValueError("kv_indptr must be non-decreasing")


def check_kv_end(kv: list[int], num_indices: int) -> None:
    if kv[-1] > num_indices:
        raise ValueError(f"kv_indptr[-1] = {kv[-1]} exceeds len(kv_indices) = {num_indices}")


@dataclass(frozen=True)
class ExtendBounds:
    """``qo_indptr`` and ``kv_indptr`` of one extend batch as host lists, checked against each other: ``qo``
    starts at 0, neither decreases, and every sequence has at least as many KV slots as new tokens."""

    qo_indptr: list[int]
    kv_indptr: list[int]

    def __post_init__(self) -> None:
        qo, kv = list(map(int, self.qo_indptr)), list(map(int, self.kv_indptr))
        object.__setattr__(self, "qo_indptr", qo)
        object.__setattr__(self, "kv_indptr", kv)
        if len(qo) != len(kv) or not qo:
            raise ValueError("qo_indptr and kv_indptr must both have B + 1 entries")
        check_kv_indptr(kv)
        if qo[0] != 0 or any(b < a for a, b in pairwise(qo)):
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        if any(k1 - k0 < q1 - q0 for (q0, q1), (k0, k1) in zip(pairwise(qo), pairwise(kv), strict=True)):
            raise ValueError("every sequence needs at least as many KV slots as new tokens (they are written first)")

    def check_against(self, num_sequences: int, rows: int, num_indices: int) -> None:
        """That these offsets are those of a call with ``num_sequences`` sequences, ``rows`` query rows and
        ``num_indices`` slots in ``kv_indices``."""
        if len(self.qo_indptr) != num_sequences + 1:
            raise ValueError("bounds must hold qo_indptr and kv_indptr (B + 1 entries each)")
        if self.qo_indptr[-1] != rows:
            raise ValueError(f"qo_indptr[-1] = {self.qo_indptr[-1]} must equal the number of query rows {rows}")
        check_kv_end(self.kv_indptr, num_indices)

    def chunks(self, max_keys: int) -> list[tuple[int, int]]:
        """The sequences as consecutive ranges ``[first, end)`` whose keys number at most ``max_keys`` each (a
        sequence with more is a range of its own): the SDPA path gathers one range's K/V at a time."""
        kv = self.kv_indptr
        if kv[-1] - kv[0] <= max_keys:
            return [(0, len(kv) - 1)]
        ranges, first = [], 0
        for end in range(1, len(kv)):
            if kv[end] - kv[first] > max_keys and end - 1 > first:
                ranges.append((first, end - 1))
                first = end - 1
        return [*ranges, (first, len(kv) - 1)]

    def part(self, first: int, end: int) -> ExtendBounds:
        """Sequences ``first`` to ``end - 1`` on their own, their offsets counted from their first row and key."""
        qo, kv = self.qo_indptr[first : end + 1], self.kv_indptr[first : end + 1]
        return ExtendBounds([x - qo[0] for x in qo], [x - kv[0] for x in kv])

    @cached_property
    def runs(self) -> list[EqualRun]:
        """The SDPA path's calls (``equal_runs``)."""
        return equal_runs(self.qo_indptr, self.kv_indptr)

    @cached_property
    def longest(self) -> tuple[int, int]:
        """The most new tokens and the most keys of any sequence (FlashAttention's varlen maxima)."""
        return (
            max(b - a for a, b in pairwise(self.qo_indptr)) if len(self.qo_indptr) > 1 else 0,
            max(b - a for a, b in pairwise(self.kv_indptr)) if len(self.kv_indptr) > 1 else 0,
        )
