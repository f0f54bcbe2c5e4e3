"""Write a what-if version of the Gluon stage 1 for timing only: what a change of the contract would buy.

Each variant edits ``kernels/gluon_decode.py``'s text and writes the result to ``--output``; time it against
the real kernel in one run with ``bench/bench_kernels.py --baseline-stage1 FILE`` (its ``base_*`` columns).
None of them computes what THEORY.md asks (their dithers or certificates differ from the reference), so
they never run outside a benchmark:

* ``philox7``: Philox4x32 with 7 rounds instead of 10 (a cheaper stream from the same family);
* ``nophilox``: no Philox at all, each dither word one multiply or xor of the counters (no statistical
  value: the floor of what any cheaper dither stream could buy);
* ``blockradius``: one radius per warp, head and 32-token tile, the largest of its tokens' (sound but
  looser; removes ``g`` and the radius-weighted sums per token, keeps the per-token radius itself);
* ``both``: ``philox7`` and ``blockradius``.

An edit whose anchor text is missing (the kernel changed since) stops with an error naming it, rather than
writing a file that would time something else.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "gluon_decode.py"

_PHILOX7 = [
    ("    for round_index in range(10):", "    for round_index in range(7):"),
    ("        if round_index < 9:", "        if round_index < 6:"),
]

_NOPHILOX_START = "    for round_index in range(10):"
_NOPHILOX_END = '    lines += [f"mov.b32 ${4 * w + t}, c{t}_{w};" for t in calls for w in range(4)]'
_NOPHILOX_BODY = """    for t in calls:
        lines += [f"mul.lo.u32 c{t}_0, c{t}_0, 0xD2511F53;", f"xor.b32 c{t}_1, c{t}_1, c{t}_0;",
                  f"xor.b32 c{t}_2, c{t}_2, c{t}_0;", f"xor.b32 c{t}_3, c{t}_3, c{t}_1;"]
"""

_BLOCKRADIUS = [
    (
        "            radius = gl.where(token_ok[:, :, None], _radius(tile_scales, radius_ops, tail), 0.0)\n",
        "            radius = gl.where(token_ok[:, :, None], _radius(tile_scales, radius_ops, tail), 0.0)\n"
        "            u_block_max = gl.max(radius, axis=1)\n"
        "            g_block_max = g_of(u_block_max, True)\n",
    ),
    (
        "            u_arg = gl.sum(gl.where(is_arg, radius, 0.0), axis=1)\n            g_arg = g_of(u_arg, True)\n",
        "            u_arg = u_block_max\n            g_arg = g_block_max\n",
    ),
    (
        "            tile_b = inf_where_nan(_thread_sum(weights * gl.where(rest, g_of(radius, True), 0.0)))\n"
        "            b_rest = _rescaled_fold(weighted(rest_alpha, b_rest), tile_b, fold_row, fold_b)\n"
        "            u_rest = _rescaled_fold(\n"
        "                u_rest * rest_alpha, _thread_sum(gl.where(rest, weights * radius, 0.0)), fold_row, fold_u\n"
        "            )\n"
        "            w_rest = _rescaled_fold(w_rest * rest_alpha, _thread_sum(gl.where(rest, weights, 0.0)), "
        "fold_row, fold_w)\n",
        "            tile_w = _thread_sum(gl.where(rest, weights, 0.0))\n"
        "            rest_block: gl.constexpr = gl.SliceLayout(1, tile_w.type.layout)\n"
        "            g_block = gl.convert_layout(g_arg, rest_block)[:, None, :]\n"
        "            u_block = gl.convert_layout(u_arg, rest_block)[:, None, :]\n"
        "            b_rest = _rescaled_fold(weighted(rest_alpha, b_rest), weighted(tile_w, g_block), "
        "fold_row, fold_b)\n"
        "            u_rest = _rescaled_fold(u_rest * rest_alpha, tile_w * u_block, fold_row, fold_u)\n"
        "            w_rest = _rescaled_fold(w_rest * rest_alpha, tile_w, fold_row, fold_w)\n",
    ),
]


def _replace(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"whatif_stage1: kernels/gluon_decode.py changed; this anchor is not there once:\n{old}")
    return text.replace(old, new)


def variant(name: str, text: str) -> str:
    """``text`` (the Gluon stage 1's source) with the what-if ``name`` applied."""
    if name in ("philox7", "both"):
        for old, new in _PHILOX7:
            text = _replace(text, old, new)
    if name == "nophilox":
        start, end = text.find(_NOPHILOX_START), text.find(_NOPHILOX_END)
        if start < 0 or end < start:
            raise SystemExit("whatif_stage1: kernels/gluon_decode.py changed; the Philox rounds are not where expected")
        text = text[:start] + _NOPHILOX_BODY + text[end:]
    if name in ("blockradius", "both"):
        for old, new in _BLOCKRADIUS:
            text = _replace(text, old, new)
    return text


VARIANTS = ("philox7", "nophilox", "blockradius", "both")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--output", type=Path, required=True, help="where to write the edited stage 1")
    args = parser.parse_args()
    args.output.write_text(variant(args.variant, SOURCE.read_text()))
    print(f"wrote {args.output} ({args.variant}); time it with bench/bench_kernels.py --baseline-stage1 {args.output}")


if __name__ == "__main__":
    main()
