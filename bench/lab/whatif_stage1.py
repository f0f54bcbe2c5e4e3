"""Write a what-if version of the Gluon stage 1 for timing only: what a change of the contract or the code would buy.

Each variant edits the Gluon stage 1's text (``kernels/gluon_tiles.py`` followed by ``kernels/gluon_decode.py``, one
module that imports neither) and writes the result to ``--output``; time it against the real kernel in one run with
``bench/bench_kernels.py --baseline-stage1 FILE`` (its ``base_*`` columns). A what-if edits the working tree's stage 1
unless it names the commit whose text it edits (``DEFAULT_REV``; ``--rev`` or ``--source`` choose another): the
certificate what-ifs and ``gpv`` edit the per-token certificate of ``dddfc61`` (the kernel before the certificate's
cells, which ``momentsends`` prototyped), ``qkahead`` and ``pipelined`` the copy by channel group of ``b0958e7``,
``threadarg`` the single-file stage 1 of ``9e7d36d``.

``blockradius``, ``moments``, ``noheld``, ``first``, ``ends``, ``momentsnoheld``, ``momentsfirst``, ``momentsends``,
``halfpv``, ``all`` and ``copyonly`` compute something other than what THEORY.md and the contract tests ask
(certificates or outputs that differ from the reference, or nothing); the code changes (``nobranch``, ``qkahead``,
``pipelined``, ``threadarg``, ``radiusearly``, ``certearly``, ``gpv``, ``scalesearly``, ``qshared``) compute what the
kernel they edit does, which ``bash bench/lab/device_session.sh whatif_tests NAME`` checks by running the GPU contract
tests on one compiled in the kernel's place, and ``python bench/lab/emulate_whatif.py NAME`` by the emulated ones on the
CPU (both against the working tree's reference: the what-ifs of an earlier commit fail them). CI does not test them.
None runs outside a benchmark:

* ``none``: the stage 1 as it is; with ``--rev REV``, commit REV's, the baseline of an A/B between commits (and of a
  what-if read at its ``DEFAULT_REV``);
* ``blockradius``: one radius per warp, head and 32-token tile, the largest of its tokens' (sound but
  looser; removes ``g`` and the radius-weighted sums per token, keeps the per-token radius itself);
* ``moments``: the certificate from per-thread moments (``bench/lab/certificate_variants.py``'s ``moments_thread``,
  sound and as tight as the kernel's on SmolLM2): the radius' MMA gives ``sigma^2`` per token and head, its bias MMA
  goes, and per thread and tile two square roots and ``h`` replace a square root, ``g`` and two products per token
  and head (``h`` as a short series, without the branch the design needs for large radii);
* ``noheld``: no token held apart (``certificate_variants.py``'s ``no_held``): no argmax, no fold, the sums over
  every token; the held token's radius stays 0, so stage 2's T4 and PA reduce to T1 and P (sound, ``min(T1, P)``);
* ``first``: ``noheld`` holding the sequence's first token apart (``held_first``), without an argmax;
* ``ends``: the argmax held apart over the sequence's first and last tiles only (``held_ends``): those two tiles run
  the kernel's argmax and fold, every other tile ``noheld``'s sums, behind a branch on the tile's start;
* ``momentsnoheld``: ``noheld`` with ``moments``' per-thread sums;
* ``momentsfirst``: ``momentsnoheld`` holding the sequence's first token apart, without an argmax;
* ``momentsends``: ``moments`` with ``ends``' branch: the argmax and its fold on the first and last tiles, the tiles
  between them ``momentsnoheld``'s sums;
* ``halfpv``: the output as half-precision attention computes it (cuDNN's contract, not THEORY.md's 1e-5):
  ``s * code`` (exact in fp16: V's scales have 4 significant bits) against ``fp16(2**14 p)`` in one MMA per channel
  half, without the ``p_hi + p_mid`` split (two MMAs). The certificate is unchanged; the output rounds as
  half-precision attention does;
* ``all``: ``blockradius`` and ``halfpv`` together, the cheapest kernel these contract changes allow;
* ``nobranch`` (a code change; computes what the real kernel does): the output's rescale by ``alpha`` as a
  plain multiply, without the branch that skips it where no max moved. The branch splits the loop into
  blocks that the scheduler cannot interleave; this asks whether it pays;
* ``qkahead`` (a code change; computes what the real kernel does): QK one tile ahead of the softmax.
  Iteration i computes tile i + 1's logits first, then tile i's softmax, PV and certificate, so that one
  tile's MMA and reduction latencies overlap the other's work (what FlashAttention-3 calls intra-warpgroup
  pipelining); K's codes are double-buffered and its scales triple-buffered, 16 KB more shared memory. It edits
  the four group buffers that K was copied into before its copy by rows (``b0958e7``);
* ``pipelined``: ``qkahead`` and ``nobranch`` together: without the branch the whole iteration is one block
  that the scheduler can interleave (tile i + 1's QK with tile i's softmax, PV with the certificate); like
  ``qkahead``, on ``b0958e7``;
* ``threadarg`` (a code change; computes what the real kernel does, but for which of two tokens with equal
  logits is held apart, each choice a sound certificate): each thread holds apart its own running argmax
  among its four tokens per tile, so the loop's certificate needs no lane exchange (the real kernel finds
  each warp's tile argmax and its radius by two reductions over the lanes, 12 shuffles per tile); the held
  tokens meet once, after the loop. It edits the loop and the split's stores together, which later kernels keep
  in separate functions (``certificate_tile``, ``store_split``): it applies to ``9e7d36d``'s single file;
* ``radiusearly``, ``certearly`` (code changes; compute what the real kernel does, in another order): where the
  certificate's work sits against PV. The kernel computes the tile's ``sigma^2`` right after V's wait, beside PV's
  MMAs (with V rounded), and the rest after PV's last MMA; ``radiusearly`` computes ``sigma^2`` before V's wait
  (one more CTA barrier), ``certearly`` the whole certificate before V's wait (while V's copy is in flight, none of
  it beside PV);
* ``gpv`` (a code change of ``dddfc61``'s per-token certificate): the radii's ``g`` computed with the radius,
  beside PV, rather than in ``certificate_tile`` after PV's last MMA, where it was the larger part of what remained
  there;
* ``scalesearly``: ``radiusearly`` with the tile's scales for ``sigma^2`` read from shared memory before the next
  tile's copies are issued: read after them, as in ``radiusearly``, they cost the loop a fifth CTA barrier; here 4
  scale registers stay live through the softmax instead;
* ``qshared`` (a code change; computes what the real kernel does): the certified loop reads q's MMA operands from
  shared memory with fp16 queries and V rounded too, as the other certified loops do; the 16 registers a thread
  this frees let it compile at a cap of 128 (four programs per SM, against three at 168) with 6 spill stores in
  the loop instead of 20. Time it at that cap: ``bench_kernels.py --baseline-maxnreg 128``;
* ``copyonly`` (computes nothing): the loop keeps its slot reads, copies and waits and drops QK, softmax,
  PV and the certificate. Its time is the memory side of the kernel alone, with the same gather, pipeline
  and occupancy; against ``bench_kernels.py --resident-slots`` (the full kernel with its reads served by the
  L2) it tells how much of the full kernel's time the loads and the arithmetic overlap.

An edit whose anchor text is missing (the kernel changed since) stops with an error naming it, rather than
writing a file that would time something else.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def current_source(rev: str | None = None) -> str:
    """The Gluon stage 1 as one module: ``gluon_tiles.py``, then ``gluon_decode.py`` less its docstring, its
    ``from __future__`` line and its import of ``gluon_tiles`` (the names it imports are the module's own); as in
    the working tree, or at commit ``rev`` (``gluon_decode.py`` alone at a commit that has no ``gluon_tiles.py``)."""

    def read(name: str) -> str:
        if rev is None:
            return (KERNELS / name).read_text()
        shown = subprocess.run(
            ["git", "show", f"{rev}:kernels/{name}"], cwd=KERNELS.parent, capture_output=True, text=True
        )
        if shown.returncode:
            raise SystemExit(f"whatif_stage1: git show {rev}:kernels/{name} failed: {shown.stderr.strip()}")
        return shown.stdout

    kernel = read("gluon_decode.py")
    has_tiles = ["git", "cat-file", "-e", f"{rev}:kernels/gluon_tiles.py"]
    if rev is not None and subprocess.run(has_tiles, cwd=KERNELS.parent, capture_output=True).returncode:
        return kernel
    tiles = read("gluon_tiles.py")
    kernel = re.sub(r'\A""".*?"""\n', "", kernel, flags=re.S).replace("from __future__ import annotations\n", "")
    kernel = re.sub(r"from witcert\.kernels\.gluon_tiles import \(.*?\)\n", "", kernel, flags=re.S)
    return tiles + "\n\n" + kernel


_BLOCKRADIUS = [
    (
        "    is_arg = _token_index() == tile_arg[:, None, :]\n",
        "    u_block_max = gl.max(radius, axis=1)\n"
        "    g_block_max = g_of(u_block_max, True)\n"
        "    is_arg = _token_index() == tile_arg[:, None, :]\n",
    ),
    (
        "    u_arg = gl.sum(gl.where(is_arg, radius, 0.0), axis=1)\n    g_arg = g_of(u_arg, True)\n",
        "    u_arg = u_block_max\n    g_arg = g_block_max\n",
    ),
    (
        "    tile_b = inf_where_nan(_thread_sum(rest_weights * _g_of_radii(radius)))\n"
        "    b_rest = _rescaled_fold(weighted(rest_alpha, b_rest), tile_b, fold_row, fold_b)\n"
        "    u_rest = _rescaled_fold(u_rest * rest_alpha, _thread_sum(rest_weights * radius), fold_row, fold_u)\n"
        "    w_rest = _rescaled_fold(w_rest * rest_alpha, _thread_sum(rest_weights), fold_row, fold_w)\n",
        "    tile_w = _thread_sum(rest_weights)\n"
        "    rest_block: gl.constexpr = gl.SliceLayout(1, tile_w.type.layout)\n"
        "    g_block = gl.convert_layout(g_arg, rest_block)[:, None, :]\n"
        "    u_block = gl.convert_layout(u_arg, rest_block)[:, None, :]\n"
        "    b_rest = _rescaled_fold(weighted(rest_alpha, b_rest), weighted(tile_w, g_block), fold_row, fold_b)\n"
        "    u_rest = _rescaled_fold(u_rest * rest_alpha, tile_w * u_block, fold_row, fold_u)\n"
        "    w_rest = _rescaled_fold(w_rest * rest_alpha, tile_w, fold_row, fold_w)\n",
    ),
]


# moments: the certificate from per-thread weighted moments of sigma^2 (bench/lab/certificate_variants.py's
# moments_thread): the radius' tf32 MMA gives sigma^2 per token and head, its bias MMA goes, and per thread and tile
# two square roots and h replace a square root, g and two products per token and head. ``tail`` stands for c + kappa
# (per head in the design; one scalar here, which times the same). The setup: the radius' MMA gives sigma^2 alone,
# and certificate_tile takes the tail multiplier.
_MOMENTS_SETUP = [
    (
        '    sigma_sq = mma_v2(scales, radius_ops[0].load(_RADIUS_B), zero, input_precision="tf32")\n'
        '    bias = mma_v2(scales, radius_ops[1].load(_RADIUS_B), zero, input_precision="tf32")\n'
        "    return tail * gl.sqrt(sigma_sq) + bias\n",
        '    return mma_v2(scales, radius_ops[0].load(_RADIUS_B), zero, input_precision="tf32")\n',
    ),
    (
        "@gluon.jit\ndef certificate_tile(\n",
        "@gluon.jit\ndef _h_of(u):\n    return 0.5 + u * (0.16666667 + u * (0.041666668 + u * 0.0087))\n\n\n"
        "@gluon.jit\ndef certificate_tile(\n    tail,\n",
    ),
    (
        "            b_rest, u_rest, w_rest, u_max, g_max = certificate_tile(\n",
        "            b_rest, u_rest, w_rest, u_max, g_max = certificate_tile(\n                tail,\n",
    ),
]
# Per thread: W and S = sum w sigma^2 over its four tokens, u = tail * sqrt(max sigma^2), U += tail sqrt(W S),
# B += tail^2 h(u) S.
_MOMENT_SUMS = (
    "    tile_w = _thread_sum({w})\n"
    "    tile_s = _thread_sum({w} * radius)\n"
    "    u_top = tail * gl.sqrt(gl.max(gl.reshape(radius, [4, 4, 8, 8]), axis=1))\n"
    "    tile_b = inf_where_nan(tail * tail * _h_of(u_top) * tile_s)\n"
    "    tile_u = tail * gl.sqrt(tile_w * tile_s)\n"
)
_MOMENTS = [
    *_MOMENTS_SETUP,
    (
        "    u_arg = gl.sum(gl.where(is_arg, radius, 0.0), axis=1)\n",
        "    u_arg = tail * gl.sqrt(gl.sum(gl.where(is_arg, radius, 0.0), axis=1))\n",
    ),
    (
        "    tile_b = inf_where_nan(_thread_sum(rest_weights * _g_of_radii(radius)))\n"
        "    b_rest = _rescaled_fold(weighted(rest_alpha, b_rest), tile_b, fold_row, fold_b)\n"
        "    u_rest = _rescaled_fold(u_rest * rest_alpha, _thread_sum(rest_weights * radius), fold_row, fold_u)\n"
        "    w_rest = _rescaled_fold(w_rest * rest_alpha, _thread_sum(rest_weights), fold_row, fold_w)\n",
        _MOMENT_SUMS.format(w="rest_weights")
        + "    b_rest = _rescaled_fold(weighted(rest_alpha, b_rest), tile_b, fold_row, fold_b)\n"
        "    u_rest = _rescaled_fold(u_rest * rest_alpha, tile_u, fold_row, fold_u)\n"
        "    w_rest = _rescaled_fold(w_rest * rest_alpha, tile_w, fold_row, fold_w)\n",
    ),
]


# noheld: no token held apart (certificate_variants.py's no_held): no argmax, no fold, the sums over every token.
# u_max and g_max stay 0, so stage 2's T4 and PA reduce to T1 and P: the certificate is min(T1, P).
_NOHELD_SUMS = (
    "    b_rest = weighted(rest_alpha, b_rest) + inf_where_nan(_thread_sum(weights * _g_of_radii(radius)))\n"
    "    u_rest = u_rest * rest_alpha + _thread_sum(weights * radius)\n"
    "    w_rest = w_rest * rest_alpha + _thread_sum(weights)\n"
)
_NOHELD_SPANS = [
    (
        "            tile_arg = tile_argmax(logits, tile_max)\n",
        "        async_copy.wait_group(1)  # this tile's V\n",
        "            tile_arg = tile_max\n",
    ),
    (
        "    is_arg = _token_index() == tile_arg[:, None, :]\n",
        "    return b_rest, u_rest, w_rest, u_max, g_max\n",
        _NOHELD_SUMS,
    ),
]
# Without a fold: the tile's moment sums added to the rescaled ones.
_MOMENT_FOLDS = (
    "    b_rest = weighted(rest_alpha, b_rest) + tile_b\n"
    "    u_rest = u_rest * rest_alpha + tile_u\n"
    "    w_rest = w_rest * rest_alpha + tile_w\n"
)
# momentsnoheld: noheld's sums from moments_thread's per-thread bounds.
_MOMENTS_NOHELD = [
    *_MOMENTS_SETUP,
    (
        _NOHELD_SUMS,
        _MOMENT_SUMS.format(w="weights") + _MOMENT_FOLDS,
    ),
]


# first: noheld holding the sequence's first token apart (certificate_variants.py's held_first), the per-token sums
# kept: no argmax; a tile that starts the sequence leaves its first tokens out of the sums (here each warp's first,
# which times the same; the held token's radius and weight, once per split, are not timed).
_FIRST_TOKEN = (
    "            tile_arg = tile_max\n",
    "            tile_arg = gl.where(start == 0, 0, TOKENS) + gl.zeros_like(tile_max).to(gl.int32)\n",
)
_FIRST_WEIGHTS = "    rest_weights = gl.where(_token_index() == tile_arg[:, None, :], 0.0, weights)\n"
_FIRST = [
    _FIRST_TOKEN,
    (_NOHELD_SUMS, _FIRST_WEIGHTS + _NOHELD_SUMS.replace("(weights", "(rest_weights")),
]
# momentsfirst: momentsnoheld holding the sequence's first token apart (certificate_variants.py's
# moments_thread_held_first), as first does.
_MOMENTS_FIRST = [
    *_MOMENTS_SETUP,
    _FIRST_TOKEN,
    (_NOHELD_SUMS, _FIRST_WEIGHTS + _MOMENT_SUMS.format(w="rest_weights") + _MOMENT_FOLDS),
]

# ends: the argmax held apart over the sequence's first and last tiles only (certificate_variants.py's held_ends):
# those tiles run dddfc61's argmax and fold, every other tile adds all its tokens to the sums, as noheld does, behind a
# branch on the tile's start (a scalar: the whole program takes the same side). What it times: the loop's usual
# tile without the argmax, and the branch. The held token's own logit (which the design tracks apart from the running
# max, since tiles between the ends move the max without changing the held token) is not kept: it times the same.
_ENDS_TEST = "(start == 0) | (start + BLOCK_N >= seq_len)"


def _ends(other_tiles: str, tail: bool = False) -> list[tuple[str, str]]:
    """``ends``' edits: the argmax and the certificate's tile behind the branch, ``other_tiles`` (the sums, indented
    as ``certificate_tile``'s body is) on every other tile; ``tail`` where ``moments`` gave the call its first
    argument."""
    call = ["tail,\n"] if tail else []
    return [
        (
            "            tile_arg = tile_argmax(logits, tile_max)\n",
            f"            if {_ENDS_TEST}:\n"
            "                tile_arg = tile_argmax(logits, tile_max)\n"
            "            else:\n"
            "                tile_arg = gl.zeros_like(tile_max).to(gl.int32) + TOKENS\n",
        ),
        (
            "            b_rest, u_rest, w_rest, u_max, g_max = certificate_tile(\n"
            + "".join(" " * 16 + line for line in call)
            + "                tile_arg, tile_max, running_max, shift, alpha, rest_alpha, weights, radius, fold_row, "
            "b_rest, u_rest,\n"
            "                w_rest, u_max, g_max,\n"
            "            )  # fmt: skip\n",
            f"            if {_ENDS_TEST}:\n"
            "                b_rest, u_rest, w_rest, u_max, g_max = certificate_tile(\n"
            + "".join(" " * 20 + line for line in call)
            + "                    tile_arg, tile_max, running_max, shift, alpha, rest_alpha, weights, radius, "
            "fold_row, b_rest,\n"
            "                    u_rest, w_rest, u_max, g_max,\n"
            "                )  # fmt: skip\n"
            "            else:\n" + "\n".join(" " * 12 + line for line in other_tiles.splitlines()) + "\n",
        ),
    ]


_ENDS = _ends(_NOHELD_SUMS)
# momentsends: moments, with ends' branch: the tiles between the ends add momentsnoheld's sums.
_MOMENTS_ENDS = _ends(_MOMENT_SUMS.format(w="weights") + _MOMENT_FOLDS, tail=True)

# halfpv: p_mid goes, and with it one MMA of two (V is one exact fp16 operand already).
_HALFPV = [
    ("    p_mid = (weights - p_hi.to(gl.float32)).to(gl.float16)\n", ""),
    ("    p_mid = _p_operand(p_mid)\n", ""),
    (
        "            acc0 = mma_v2(v, p_hi, acc0)\n            acc0 = mma_v2(v, p_mid, acc0)\n",
        "            acc0 = mma_v2(v, p_hi, acc0)\n",
    ),
    (
        "            acc1 = mma_v2(v, p_hi, acc1)\n            acc1 = mma_v2(v, p_mid, acc1)\n",
        "            acc1 = mma_v2(v, p_hi, acc1)\n",
    ),
]

_NOBRANCH = [
    (
        "    return gl.inline_asm_elementwise(\n"
        "        _RESCALE_ASM, _RESCALE_CONSTRAINTS, [acc, alpha], dtype=gl.float32, is_pure=True, pack=16\n"
        "    )\n",
        "    return acc * alpha\n",
    ),
]

# Spans of the token loop that copyonly drops: (first line dropped, first line kept after, replacement).
_COPYONLY_SPANS = [
    (
        "        logits = qk_tile(k_tiles, tile_scales, q_ops, q_alpha_sums, Q_IN_REGISTERS, True)\n",
        "        _copy_k(k_rows, KCodes, next_base, offs + BLOCK_N, hi, OFFSETS_64)\n",
        "",
    ),
    (
        "        logits, tile_max, new_max, shift, rest_alpha, weights, running_sum, first, second, acc0, acc1 = "
        "softmax_tile(\n",
        "        async_copy.wait_group(1)  # this tile's V\n",
        "",
    ),
    (
        "        # With V rounded, sigma^2 beside PV's MMAs",
        "        _copy_v(v_tiles, VCodes, next_v_bases, next_v, hi, OFFSETS_64)\n",
        "",
    ),
    (
        "        # The rest of the certificate after PV",
        "        slots = next_slots\n",
        "",
    ),
]

_QKAHEAD_HELPERS = """@gluon.jit
def _k_set(k_tiles, stage):
    \"\"\"The four group buffers of one stage of the double-buffered K codes.\"\"\"
    return (k_tiles[0].index(stage), k_tiles[1].index(stage), k_tiles[2].index(stage), k_tiles[3].index(stage))


"""
_QKAHEAD = [
    ("@gluon.jit\ndef decode_stage1_gluon(\n", _QKAHEAD_HELPERS + "@gluon.jit\ndef decode_stage1_gluon(\n"),
    # K's codes in two stages, its scales in three.
    (
        "    k_tiles = (\n" + "        gl.allocate_shared_memory(gl.uint8, [4, 32, 32], ROW_MAJOR),\n" * 4 + "    )\n",
        "    k_tiles = (\n"
        + "        gl.allocate_shared_memory(gl.uint8, [2, 4, 32, 32], ROW_MAJOR),\n" * 4
        + "    )\n",
    ),
    (
        "    k_scales = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, 4], ROW_MAJOR_2D)\n",
        "    k_scales = gl.allocate_shared_memory(gl.float16, [3, BLOCK_N, 4], ROW_MAJOR_2D)\n",
    ),
    # The prologue copies K(0) and K(1), then V(0), and computes tile 0's logits.
    (
        "    _copy_k(k_tiles, KCodes, slot_row(slots, num_slots, NUM_KV_HEADS, kv_head), lo + tok_t, hi, OFFSETS_64)\n"
        "    rows = _token_base(KvIndices, kv_start, lo + tok_ks, hi, num_slots, NUM_KV_HEADS, kv_head)\n"
        "    _copy_scales(k_scales.index(0), KScales, rows, lo + tok_ks, hi, groups_ks)\n"
        "    async_copy.commit_group()\n",
        "    first_base = slot_row(slots, num_slots, NUM_KV_HEADS, kv_head)\n"
        "    _copy_k(_k_set(k_tiles, 0), KCodes, first_base, lo + tok_t, hi, OFFSETS_64)\n"
        "    rows = _token_base(KvIndices, kv_start, lo + tok_ks, hi, num_slots, NUM_KV_HEADS, kv_head)\n"
        "    _copy_scales(k_scales.index(0), KScales, rows, lo + tok_ks, hi, groups_ks)\n"
        "    async_copy.commit_group()\n"
        "    next_slots = gl.load(KvIndices + kv_start + gl.minimum(lo + BLOCK_N + tok_t, hi - 1))\n"
        "    next_base = slot_row(next_slots, num_slots, NUM_KV_HEADS, kv_head)\n"
        "    _copy_k(_k_set(k_tiles, 1), KCodes, next_base, lo + BLOCK_N + tok_t, hi, OFFSETS_64)\n"
        "    rows = _token_base(KvIndices, kv_start, lo + BLOCK_N + tok_ks, hi, num_slots, NUM_KV_HEADS, kv_head)\n"
        "    _copy_scales(k_scales.index(1), KScales, rows, lo + BLOCK_N + tok_ks, hi, groups_ks)\n"
        "    async_copy.commit_group()\n",
    ),
    (
        "    stage = 0\n    for start in range(lo, hi, BLOCK_N):\n",
        "    # what-if qkahead: iteration i computes tile i + 1's logits first, then tile i's softmax, PV and\n"
        "    # certificate. Commits: K(0), K(1), V(0), then per iteration K(i + 2), V(i + 1).\n"
        "    async_copy.wait_group(2)  # K(0)\n"
        "    next_logits = qk_tile(_k_set(k_tiles, 0), k_scales.index(0), q_ops, q_alpha_sums, Q_IN_REGISTERS)\n"
        "    k_stage = 0\n"
        "    s_stage = 0\n"
        "    for start in range(lo, hi, BLOCK_N):\n",
    ),
    # Tile i + 2's slots for its K copies; tile i + 1's (loaded one iteration ago) give V's rows.
    (
        "        # The next tile's rows, for its copies (loaded now, used after this tile's QK and PV).\n"
        "        next_slots = gl.load(KvIndices + kv_start + gl.minimum(offs + BLOCK_N, hi - 1))\n",
        "        raw_logits = next_logits\n"
        "        ahead_slots = gl.load(KvIndices + kv_start + gl.minimum(offs + 2 * BLOCK_N, hi - 1))\n"
        "        ahead_base = slot_row(ahead_slots, num_slots, NUM_KV_HEADS, kv_head)\n",
    ),
    (
        "        next_k_scale_rows = _token_base(\n"
        "            KvIndices, kv_start, start + BLOCK_N + tok_ks, hi, num_slots, NUM_KV_HEADS, kv_head\n"
        "        )\n",
        "        ahead_k_scale_rows = _token_base(\n"
        "            KvIndices, kv_start, start + 2 * BLOCK_N + tok_ks, hi, num_slots, NUM_KV_HEADS, kv_head\n"
        "        )\n",
    ),
    (
        "        async_copy.wait_group(1)  # this tile's K\n"
        "        tile_scales = k_scales.index(stage)\n"
        "        logits = qk_tile(k_tiles, tile_scales, q_ops, q_alpha_sums, Q_IN_REGISTERS)\n"
        "        _copy_k(k_tiles, KCodes, next_base, offs + BLOCK_N, hi, OFFSETS_64)\n"
        "        _copy_scales(k_scales.index(1 - stage), KScales, next_k_scale_rows, start + BLOCK_N + tok_ks, hi, "
        "groups_ks)\n"
        "        async_copy.commit_group()\n",
        "        next_k = 1 - k_stage\n"
        "        next_s = (s_stage + 1) % 3\n"
        "        ahead_s = (s_stage + 2) % 3\n"
        "        async_copy.wait_group(1)  # K(i + 1)\n"
        "        next_logits = qk_tile(\n"
        "            _k_set(k_tiles, next_k), k_scales.index(next_s), q_ops, q_alpha_sums, Q_IN_REGISTERS\n"
        "        )\n"
        "        _copy_k(_k_set(k_tiles, k_stage), KCodes, ahead_base, offs + 2 * BLOCK_N, hi, OFFSETS_64)\n"
        "        ahead_tokens = start + 2 * BLOCK_N + tok_ks\n"
        "        _copy_scales(k_scales.index(ahead_s), KScales, ahead_k_scale_rows, ahead_tokens, hi, groups_ks)\n"
        "        async_copy.commit_group()\n"
        "        tile_scales = k_scales.index(s_stage)\n"
        "        logits = raw_logits\n",
    ),
    (
        "        slots = next_slots\n        stage = 1 - stage\n",
        "        slots = next_slots\n        next_slots = ahead_slots\n"
        "        k_stage = next_k\n        s_stage = next_s\n",
    ),
]
_THREADARG_INIT = """\
    # what-if threadarg: each thread holds apart its own running argmax (per head, the largest logit among
    # its tokens so far, in base-2 units) with that token's u and g; its rest sums take every other token.
    # After the loop the largest held logit is the split's argmax, and the other held tokens join the rest.
    held_z = gl.full([4, 8, 8], -_FP32_INF, gl.float32, rest_l)
    held_u = gl.zeros([4, 8, 8], gl.float32, rest_l)
    held_g = gl.zeros([4, 8, 8], gl.float32, rest_l)
"""
_THREADARG_LOOP = """\
            radius = gl.where(token_ok[:, :, None], _radius(tile_scales, radius_ops, tail), 0.0)
            # [warp, the thread's 4 tokens, token % 8, head]: axis 1 is in registers, so no lane exchange.
            logits4 = gl.reshape(logits, [4, 4, 8, 8])
            radius4 = gl.reshape(radius, [4, 4, 8, 8])
            weights4 = gl.reshape(weights, [4, 4, 8, 8])
            l4: gl.constexpr = logits4.type.layout
            own = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
            own = own[None, :, None, None]
            thread_max = gl.max(logits4, axis=1)
            thread_arg = gl.min(gl.where(logits4 == thread_max[:, None, :, :], own, 4), axis=1)
            is_arg = own == thread_arg[:, None, :, :]
            u_arg = gl.sum(gl.where(is_arg, radius4, 0.0), axis=1)
            g_arg = g_of(u_arg, True)
            # Strictly larger: on a tie the token held first stays held. A token past the end or skipped has
            # logit -inf and is never held.
            moved = thread_max > held_z
            live4 = gl.reshape(token_ok[:, :, None].broadcast_to(4, 32, 8), [4, 4, 8, 8])
            rest = live4 & ~(is_arg & moved[:, None, :, :])
            # The token that stops being held apart, in this tile's frame (weight 0 where none was held).
            shift_t = gl.convert_layout(shift, gl.SliceLayout(1, rest_l))[:, None, :]
            weight_old = _exp2(held_z - shift_t)
            fold_b = gl.where(moved, weighted(weight_old, held_g), 0.0)
            fold_u = gl.where(moved, weight_old * held_u, 0.0)
            fold_w = gl.where(moved, weight_old, 0.0)
            tile_b = inf_where_nan(gl.sum(weights4 * gl.where(rest, g_of(radius4, True), 0.0), axis=1))
            b_rest = weighted(rest_alpha, b_rest) + tile_b + fold_b
            u_rest = u_rest * rest_alpha + gl.sum(gl.where(rest, weights4 * radius4, 0.0), axis=1) + fold_u
            w_rest = w_rest * rest_alpha + gl.sum(gl.where(rest, weights4, 0.0), axis=1) + fold_w
            held_z = gl.where(moved, thread_max, held_z)
            held_u = gl.where(moved, u_arg, held_u)
            held_g = gl.where(moved, g_arg, held_g)

"""
_THREADARG_MERGE = """\
    if CERTIFICATE:
        # The split's argmax: the first thread (warp, then lane row) holding the largest logit, top. Every
        # other held token joins the rest sums with its weight in the split's frame.
        rest_heads: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, rest_l))
        holder = (
            gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, rest_l)))[:, None, None] * 8
            + gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, rest_l)))[None, :, None]
        )
        top_held = gl.convert_layout(top, rest_heads)[None, None, :]
        first = gl.min(gl.min(gl.where(held_z == top_held, holder, 32), axis=1), axis=0)
        winner = holder == gl.convert_layout(first, rest_heads)[None, None, :]
        held_weight = _exp2(held_z - gl.convert_layout(top_shift, rest_heads)[None, None, :])
        thread_weight = gl.convert_layout(warp_weight, gl.SliceLayout(1, rest_l))[:, None, :]
        # U_rest's terms take no `0 * inf` rule in the loop (it would spill): a weight that underflowed beside a
        # radius that overflowed makes the sum NaN, and a NaN stays NaN through every later scaling and sum,
        # so it is read here as the reference's +inf (``mul_nonneg``).
        u_rest = inf_where_nan(u_rest)
        b_terms = mul_nonneg(thread_weight, b_rest) + gl.where(winner, 0.0, mul_nonneg(held_weight, held_g))
        u_terms = weighted(thread_weight, u_rest) + gl.where(winner, 0.0, weighted(held_weight, held_u))
        p_terms = thread_weight * w_rest + gl.where(winner, 0.0, held_weight)
        b = gl.convert_layout(gl.sum(gl.sum(b_terms, axis=1), axis=0), heads_l)
        u = gl.convert_layout(gl.sum(gl.sum(u_terms, axis=1), axis=0), heads_l)
        p = gl.convert_layout(gl.sum(gl.sum(p_terms, axis=1), axis=0), heads_l)
        u_top = gl.convert_layout(gl.sum(gl.sum(gl.where(winner, held_u, 0.0), axis=1), axis=0), heads_l)
"""
# (first line replaced, first line kept after, replacement)
_THREADARG_SPANS = [
    ("    fold_row = gl.arange(0, 8,", "    slot_max = _thread_max(", _THREADARG_INIT),
    ("            radius = gl.where(token_ok[:, :, None], _radius(", "        running_max = new_max", _THREADARG_LOOP),
    ("    if CERTIFICATE:\n        live = running_sum > 0\n", "        gl.store(PartMax + part_row", _THREADARG_MERGE),
]


def _replace(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"whatif_stage1: the Gluon stage 1 changed; this anchor is not there once:\n{old}")
    return text.replace(old, new)


def _replace_span(text: str, first: str, after: str, new: str) -> str:
    """``text`` with the lines from ``first`` up to (not including) ``after`` replaced by ``new``."""
    start = _replace(text, first, first).index(first)
    stop = _replace(text, after, after).index(after)
    if stop <= start:
        raise SystemExit(f"whatif_stage1: the Gluon stage 1 changed; this span is out of order:\n{first}")
    return text[:start] + new + text[stop:]


def _replacing(edits: list[tuple[str, str]]) -> Callable[[str], str]:
    return lambda text: functools.reduce(lambda done, edit: _replace(done, *edit), edits, text)


def _replacing_spans(spans: list[tuple[str, str, str]]) -> Callable[[str], str]:
    return lambda text: functools.reduce(lambda done, span: _replace_span(done, *span), spans, text)


# Each what-if's edit of the source; the composite ones apply others in turn.
# The kernel computes the tile's sigma^2 right after V's wait, beside PV, with V rounded, and after PV with V
# dithered; these move it, or the whole certificate, before V's wait in both.
_SIGMA_CALL = "sigma_sq = tile_sigma_sq(tile_scales, sigma_op, token_ok)\n"
_SIGMA_OFF_PV = (
    "        if CERTIFICATE and not V_DITHER:\n            " + _SIGMA_CALL + "        acc0, acc1 = pv_tokens(",
    "        acc0, acc1 = pv_tokens(",
)
_TILE_ARGMAX = "        if CERTIFICATE:\n            tile_arg = end_tile_argmax(end_tile, logits, tile_max)\n"
_RADIUSEARLY = [
    _SIGMA_OFF_PV,
    ("        if CERTIFICATE:\n            if V_DITHER:\n                " + _SIGMA_CALL, "        if CERTIFICATE:\n"),
    (_TILE_ARGMAX, _TILE_ARGMAX + "            " + _SIGMA_CALL),
]
_CERTIFICATE_CALL = """            rest, held = tile_certificate(
                end_tile, tile_arg, tile_max, shift, rest_alpha, weights, sigma_sq, chat, fold_row, rest, held
            )
"""
_CERTEARLY = [
    _SIGMA_OFF_PV,
    (
        "        # The rest of the certificate after PV, so that none of V's registers is live through it.\n"
        "        if CERTIFICATE:\n            if V_DITHER:\n                " + _SIGMA_CALL + _CERTIFICATE_CALL,
        "",
    ),
    (_TILE_ARGMAX, _TILE_ARGMAX + "            " + _SIGMA_CALL + _CERTIFICATE_CALL),
]

_QSHARED = [
    (
        "Q_IN_REGISTERS: gl.constexpr = not (CERTIFICATE and (V_DITHER or Q.dtype.element_ty == gl.bfloat16))",
        "Q_IN_REGISTERS: gl.constexpr = not CERTIFICATE",
    )
]

# gpv (on dddfc61's per-token certificate): the radii's g (``_g_of_radii``, 99 of the 208 instructions after PV's last
# MMA) computed with the radius, beside PV, and passed to certificate_tile.
_RADIUS_CALL = "radius = tile_radius(tile_scales, radius_ops, tail, token_ok)\n"
_GPV = [
    (
        "weights, radius, fold_row, b_rest, u_rest, w_rest,\n    u_max",
        "weights, radius, radius_g, fold_row, b_rest, u_rest,\n    w_rest, u_max",
    ),
    ("_thread_sum(rest_weights * _g_of_radii(radius))", "_thread_sum(rest_weights * radius_g)"),
    (
        "rest_alpha, weights, radius, fold_row, b_rest, u_rest,\n                w_rest",
        "rest_alpha, weights, radius, radius_g, fold_row, b_rest,\n                u_rest, w_rest",
    ),
    *(
        (indent + _RADIUS_CALL + after, indent + _RADIUS_CALL + indent + "radius_g = _g_of_radii(radius)\n" + after)
        for indent, after in ((" " * 12, "        acc0, acc1 = pv_tokens("), (" " * 16, "            b_rest"))
    ),
]

_SCALESEARLY = [
    (
        "    s = gl.maximum(gl.reshape(tile_scales.load(_RADIUS_SCALES).to(gl.float32), [4, 32, 4]), _MIN_NORMAL)",
        "    s = gl.maximum(gl.reshape(tile_scales.to(gl.float32), [4, 32, 4]), _MIN_NORMAL)",
    ),
    (
        "        tile_scales = k_scales.index(stage)\n",
        "        tile_scales = k_scales.index(stage)\n"
        "        if CERTIFICATE:\n            radius_scales = tile_scales.load(_RADIUS_SCALES)\n",
    ),
    (
        _TILE_ARGMAX + " " * 12 + _SIGMA_CALL,
        _TILE_ARGMAX + " " * 12 + _SIGMA_CALL.replace("tile_sigma_sq(tile_scales,", "tile_sigma_sq(radius_scales,"),
    ),
]

_EDITS = {
    "none": lambda text: text,
    "blockradius": _replacing(_BLOCKRADIUS),
    "moments": _replacing(_MOMENTS),
    "noheld": _replacing_spans(_NOHELD_SPANS),
    "momentsnoheld": lambda text: _replacing(_MOMENTS_NOHELD)(_replacing_spans(_NOHELD_SPANS)(text)),
    "ends": _replacing(_ENDS),
    "momentsends": lambda text: _replacing(_MOMENTS_ENDS)(_replacing(_MOMENTS)(text)),
    "first": lambda text: _replacing(_FIRST)(_replacing_spans(_NOHELD_SPANS)(text)),
    "momentsfirst": lambda text: _replacing(_MOMENTS_FIRST)(_replacing_spans(_NOHELD_SPANS)(text)),
    "halfpv": _replacing(_HALFPV),
    "nobranch": _replacing(_NOBRANCH),
    "copyonly": _replacing_spans(_COPYONLY_SPANS),
    "qkahead": _replacing(_QKAHEAD),
    "threadarg": _replacing_spans(_THREADARG_SPANS),
    "radiusearly": _replacing(_RADIUSEARLY),
    "certearly": _replacing(_CERTEARLY),
    "gpv": _replacing(_GPV),
    "qshared": _replacing(_QSHARED),
    "scalesearly": lambda text: _replacing(_SCALESEARLY)(_replacing(_RADIUSEARLY)(text)),
}
_COMPOSITES = {"all": "blockradius+halfpv", "pipelined": "nobranch+qkahead"}
VARIANTS = (*_EDITS, *_COMPOSITES)
# The commit whose stage 1 a what-if edits, where it is not the working tree's: the per-token certificate before its
# cells (the certificate what-ifs, gpv), K copied by channel group (qkahead), the single-file kernel (threadarg).
_PER_TOKEN_CERTIFICATE = "dddfc61"
DEFAULT_REV = {
    **dict.fromkeys(
        ("blockradius", "moments", "noheld", "first", "ends", "momentsnoheld", "momentsfirst", "momentsends", "gpv"),
        _PER_TOKEN_CERTIFICATE,
    ),
    "all": _PER_TOKEN_CERTIFICATE,
    "qkahead": "b0958e7",
    "pipelined": "b0958e7",
    "threadarg": "9e7d36d",
}


def default_rev(name: str) -> str | None:
    """The commit whose stage 1 the what-if ``name`` (``a+b`` too) edits by default: None for the working tree's."""
    revs = {DEFAULT_REV.get(part) for part in name.split("+")}
    if len(revs) > 1:
        raise SystemExit(f"whatif_stage1: {name} joins what-ifs of different commits; name one with --rev or --source")
    return revs.pop()


def variant(name: str, text: str) -> str:
    """``text`` (the Gluon stage 1's source) with the what-if ``name`` applied; ``a+b`` applies ``a``, then
    ``b`` (each must leave the other's anchors in place, or the second stops with an error naming it)."""
    for part in name.split("+"):
        for edit in _COMPOSITES.get(part, part).split("+"):
            text = _EDITS[edit](text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", help=f"one of {', '.join(VARIANTS)}, or several joined by + (nobranch+radiusearly)")
    parser.add_argument("--output", type=Path, required=True, help="where to write the edited stage 1")
    origin = parser.add_mutually_exclusive_group()
    origin.add_argument("--source", type=Path, help="the stage 1 to edit, one module (default: the working tree's, "
                        "or the what-if's DEFAULT_REV)")  # fmt: skip
    origin.add_argument("--rev", help="edit the stage 1 of this commit (gluon_tiles.py and gluon_decode.py "
                        "as one module; default: the what-if's DEFAULT_REV, else the working tree's); with the "
                        "variant none, an A/B baseline (--baseline-stage1)")  # fmt: skip
    args = parser.parse_args()
    if unknown := [part for part in args.variant.split("+") if part not in VARIANTS]:
        parser.error(f"unknown what-if {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.source:
        text, origin_text = args.source.read_text(), str(args.source)
    else:
        rev = args.rev or default_rev(args.variant)
        text, origin_text = current_source(rev), f"commit {rev}" if rev else "the working tree"
    args.output.write_text(variant(args.variant, text))
    print(f"wrote {args.output} ({args.variant} on {origin_text}); time it with bench/bench_kernels.py "
          f"--baseline-stage1 {args.output}")  # fmt: skip


if __name__ == "__main__":
    main()
