"""Static SASS of the int8 decode stage 1 for sm_90, compiled here without a GPU.

The timings come from ``bench/bench_kernels.py`` on the H200; this says what the compiled loop does. It
compiles the Gluon stage 1 (``--kernel gluon``, the default; ``gluon_decode.decode_stage1_gluon`` with its
register caps from ``LAUNCH``) or the Triton one (``--kernel triton``; ``triton_kernels.decode_stage1`` at
``LAUNCH``'s tile, warps and stages) at the benchmark's shape (Qwen2.5-7B: 4 KV heads of 7 query heads, D 128,
G 32, 8-bit dithers, fp16 query), disassembles it with the ``nvdisasm`` that Triton ships, and prints per variant the
instructions of the whole kernel and of the token loop alone (one iteration per 128-token tile), the
registers, the local-memory spill stores (all, and those in the loop), the most frequent opcodes and,
with ``--by-line`` and ``--by-function``, which source lines and functions the loop's instructions come
from; ``--by-pipe`` counts them per issuing pipe, and ``--tail`` those after PV's last MMA (the stretch before
the next tile's wait and barrier, where a warp has no MMA work left to overlap with). ``--maxnreg`` compiles the
Gluon stage 1 at another register cap, ``--stage1 FILE`` another version of it (a ``bench/lab/whatif_stage1.py``
output; ``whatif_stage1.py none --rev REV`` writes commit REV's).

Use the device's Triton version for figures that match its binaries (3.6 in 2026-12):
``pip install --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH=/tmp/t36 python bench/lab/count_sass.py``.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import triton

from witcert.kernels.launch import LAUNCH

# bench/ for bench_kernels; tests/ for sass, the compile-and-disassemble helper that CI's SASS tests use too.
_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT / "bench"), str(_ROOT / "tests")]
from bench_kernels import load_stage1  # noqa: E402
from sass import compile_cubin, profile  # noqa: E402


def enclosing_function(path: str, line: int) -> str:
    """The ``def`` a source line belongs to (the nearest one above it), or the file's name."""
    if not Path(path).exists():
        return Path(path).name
    lines = Path(path).read_text().splitlines()[:line]
    for text in reversed(lines):
        if match := re.match(r"def (\w+)", text):
            return match.group(1)
    return Path(path).name


# Which execution pipe of an sm_90 scheduler issues each opcode, as far as the loop uses them. The ALU pipe
# takes a warp instruction every other cycle, the FMA pipe's float and f16x2 side every cycle; IMAD runs
# on its heavy half only (every other cycle). Everything else is counted as "other".
PIPES = {
    "alu": "LOP3 PRMT SEL FSEL ISETP FSETP FMNMX VIMNMX VIMNMX3 IMNMX IADD3 LEA SHF PLOP3 P2R R2P MOV BMSK".split(),
    "fma": "FFMA FMUL FADD HFMA2 HADD2 HMUL2".split(),
    "imad": ["IMAD"],
    "tensor": ["HMMA"],
    "mufu": ["MUFU"],
    "memory": "LDS STS SHFL LDGSTS LDG LDL STL BAR".split(),
}


def by_function(lines: collections.Counter[tuple[str, int]]) -> collections.Counter[str]:
    """Instructions per source line summed per enclosing function."""
    functions: collections.Counter[str] = collections.Counter()
    for (path, line), n in lines.items():
        functions[enclosing_function(path, line)] += n
    return functions


def by_pipe(opcodes: collections.Counter[str]) -> dict[str, int]:
    """The loop's instructions per issuing pipe (``PIPES``), the rest as ``other``."""
    counts = {pipe: sum(opcodes[op] for op in ops) for pipe, ops in PIPES.items()}
    counts["other"] = sum(opcodes.values()) - sum(counts.values())
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--kernel", choices=["gluon", "triton", "extend"], default="gluon",
        help="which stage 1 (default gluon; extend: the tiled extend kernel, fp16 or bf16 queries only)",
    )  # fmt: skip
    parser.add_argument("--v-dither", action="store_true", help="the dithered-V variant (default: V nearest)")
    parser.add_argument(
        "--offsets-64", action="store_true", help="the variant for pools of 2**31 code bytes or more (64-bit addresses)"
    )
    parser.add_argument("--q-dtype", choices=["fp16", "bf16"], default="fp16", help="the queries' dtype")
    parser.add_argument("--top", type=int, default=10, help="most frequent opcodes to list")
    parser.add_argument("--by-line", type=int, default=0, metavar="N", help="also list the N heaviest source lines")
    parser.add_argument("--by-function", type=int, default=0, metavar="N", help="also list the N heaviest functions")
    parser.add_argument("--maxnreg", type=int, help="the Gluon stage 1's register cap (default: LAUNCH's)")
    parser.add_argument("--by-pipe", action="store_true", help="also count the loop's instructions per issuing pipe")
    parser.add_argument("--tail", type=int, default=0, metavar="N", help="also count the loop's instructions after its "
                        "last fp16 MMA (PV's), with the N heaviest functions among them")  # fmt: skip
    parser.add_argument("--stage1", type=Path, metavar="FILE", help="compile this version of kernels/gluon_decode.py "
                        "instead (--kernel gluon)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.stage1 and args.kernel != "gluon":
        parser.error("--stage1 replaces the Gluon stage 1 (--kernel gluon)")
    gluon_module = load_stage1(args.stage1) if args.stage1 else None
    if args.v_dither and args.kernel == "extend":
        parser.error("the tiled extend kernel has no dithered-V variant (--kernel gluon or triton)")
    if args.maxnreg is not None:
        if args.kernel != "gluon":
            parser.error("--maxnreg sets the Gluon stage 1's cap (the Triton one's is LAUNCH.maxnreg)")
        LAUNCH.gluon_maxnreg = LAUNCH.gluon_maxnreg_nocert = args.maxnreg
    print(f"Triton {triton.__version__}, sm_90, {args.kernel} stage 1, launch {LAUNCH}, "
          f"V {'dithered' if args.v_dither else 'nearest'}{', 64-bit offsets' if args.offsets_64 else ''}")  # fmt: skip
    for certificate in (True, False):
        cubin = compile_cubin(
            kernel_name=args.kernel,
            certificate=certificate,
            v_dither=args.v_dither,
            offsets_64=args.offsets_64,
            q_dtype=args.q_dtype,
            gluon_module=gluon_module,
        )
        result = profile(cubin)
        opcodes = result.opcodes
        print(
            f"\n{'with' if certificate else 'without'} certificate: {sum(opcodes.values())} instructions, "
            f"{result.loop_length} in the token loop ({result.loop_opcodes['BAR']} CTA barriers), {result.registers} "
            f"registers, {opcodes['STL']} spill stores ({result.loop_opcodes['STL']} in the loop)"
        )
        print("  " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(args.top)))
        if args.by_pipe:
            print("  loop by pipe: " + ", ".join(f"{pipe} {n}" for pipe, n in by_pipe(result.loop_opcodes).items()))
        for (path, line), n in result.loop_lines.most_common(args.by_line):
            text = Path(path).read_text().splitlines()[line - 1].strip() if Path(path).exists() else ""
            print(f"  {n:5d}  {Path(path).name}:{line}  {text[:90]}")
        for name, n in by_function(result.loop_lines).most_common(args.by_function):
            print(f"  {n:5d}  {name}")
        if args.tail:
            tail = result.tail_opcodes
            print(f"  after PV's last MMA: {sum(tail.values())} instructions (SHFL {tail['SHFL']}, BRA {tail['BRA']}, "
                  f"BAR {tail['BAR']}, HMMA {tail['HMMA']})")  # fmt: skip
            for name, n in by_function(result.tail_lines).most_common(args.tail):
                print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main()
