"""The Gluon stage 1's K buffer (``gluon_tiles.K_ROWS_SHARED``) serves both of its accesses at the shared memory's
full rate: each copy instruction (``K_ROWS``, 8 bytes a lane) gathers 2 whole token rows and writes them in 2
wavefronts, and each of QK's 64-bit reads of one group (``_K_GROUP_SLICE``) takes 2 wavefronts, the least 256 bytes
can take. Computed from the layouts' bases, as the hardware maps addresses to its 32 banks of 4 bytes."""

from __future__ import annotations

import collections
import functools
import itertools

import pytest

pytest.importorskip("triton.experimental.gluon")

from gluon_emulation import linear_coordinate  # noqa: E402

from witcert.kernels import gluon_tiles  # noqa: E402

BANKS, BANK_BYTES = 32, 4


@functools.cache
def _byte_offsets() -> dict[tuple[int, ...], int]:
    """Each ``[group, warp, token, byte]`` of the buffer -> its byte offset (the inverse of the layout's map)."""
    bases = gluon_tiles.K_ROWS_SHARED.value.offset_bases
    offsets = {linear_coordinate(bases, offset): offset for offset in range(1 << len(bases))}
    assert len(offsets) == 4 * 4 * 32 * 32, "the layout is not one-to-one"
    return offsets


def _instructions(layout: object, vector_bits: int) -> list[list[tuple[int, ...]]]:
    """Per warp instruction of a load or copy in ``layout``: the coordinates its 32 lanes touch. A thread's first
    ``vector_bits`` register bits are the bytes of one access; the other register bits and the warp pick the
    instruction."""
    registers, lanes, warps = layout.reg_bases, layout.lane_bases, layout.warp_bases
    instructions = []
    for warp, access in itertools.product(range(1 << len(warps)), range(1 << (len(registers) - vector_bits))):
        touched = []
        for lane, byte in itertools.product(range(1 << len(lanes)), range(1 << vector_bits)):
            parts = (
                linear_coordinate(registers, byte | access << vector_bits),
                linear_coordinate(lanes, lane),
                linear_coordinate(warps, warp),
            )
            touched.append(tuple(a ^ b ^ c for a, b, c in zip(*parts, strict=True)))
        instructions.append(touched)
    return instructions


def _wavefronts(offsets: list[int]) -> int:
    """Shared-memory wavefronts of one instruction: the most distinct 4-byte words that fall in one bank."""
    words = collections.defaultdict(set)
    for offset in offsets:
        words[offset // BANK_BYTES % BANKS].add(offset // BANK_BYTES)
    return max(len(w) for w in words.values())


def test_k_copy_gathers_two_whole_rows_per_instruction_without_bank_conflicts():
    offsets = _byte_offsets()
    instructions = _instructions(gluon_tiles.K_ROWS.value, vector_bits=3)
    assert len(instructions) == 4 * 16  # 16 copies of 8 bytes a thread
    for touched in instructions:
        rows = {(warp, token) for _, warp, token, _ in touched}
        assert len(rows) == 2 and len(touched) == 2 * 128, "a copy instruction gathers other than 2 whole rows"
        assert _wavefronts([offsets[c] for c in touched]) == 2


@pytest.mark.parametrize("group", range(4))
def test_qk_reads_a_group_of_8_tokens_without_bank_conflicts(group):
    offsets = _byte_offsets()
    for touched in _instructions(gluon_tiles._K_GROUP_SLICE.value, vector_bits=3):
        tokens = {(warp, token) for _, warp, token, _ in touched}
        assert len(tokens) == 8 and len(touched) == 256
        assert _wavefronts([offsets[(group, *c[1:])] for c in touched]) == 2


def test_without_the_rotation_the_group_reads_would_conflict():
    """The rotation is what spreads them: the same reads in a buffer of plain rows take 8 wavefronts."""

    def plain(group: int, warp: int, token: int, byte: int) -> int:
        return ((warp * 32 + token) * 4 + group) * 32 + byte

    touched = _instructions(gluon_tiles._K_GROUP_SLICE.value, vector_bits=3)[0]
    assert _wavefronts([plain(0, *c[1:]) for c in touched]) == 8
