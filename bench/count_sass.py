"""Static SASS of the int8 decode stage 1 for sm_90, compiled here without a GPU.

The int8 kernels are limited by instruction issue and registers, not memory (docs/KERNELS.md), so the
instructions per 128-token tile are the quantity to drive down; the timings come from
``bench/bench_kernels.py`` on the H200. This compiles the Gluon stage 1 (``--kernel gluon``, the
default; ``gluon_decode._decode_stage1_gluon`` with its register caps from ``LAUNCH``) or the Triton
one (``--kernel triton``; ``triton_kernels._decode_stage1`` at ``LAUNCH``'s tile, warps and stages) at
the benchmark's shape (Qwen2.5-7B: 4 KV heads of 7 query heads, D 128, G 32, 8-bit dithers, fp16
query), disassembles it with the ``nvdisasm`` that Triton ships, and prints per variant the
instructions of the whole kernel and of the token loop alone (one iteration per 128-token tile), the
registers, the local-memory spill stores, the most frequent opcodes and, with ``--by-line``, which
source lines the loop's instructions come from.

Use the device's Triton version for figures that match its binaries (3.6 in 2026-12):
``pip install --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH=/tmp/t36 python bench/count_sass.py``.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from witcert.kernels import triton_kernels
from witcert.kernels.attention import LAUNCH

_POINTERS = dict(
    Q="fp16", KCodes="i8", KScales="fp16", KOutliers="fp16", VCodes="i8", VScales="fp16", VOutliers="fp16",
    OutlierIndex="i32", OutlierChannels="i32", KvStart="i32", KvLen="i32", KvIndices="i32", Skip="i8",
    PartOut="fp32", PartLse="fp32", PartMax="fp32", PartA1="fp32", PartB="fp32", PartURest="fp32",
    PartPRest="fp32", PartU="fp32",
)  # fmt: skip
_SCALARS = dict(
    num_slots="i32", num_kv_indices="i32", stride_qb="i32", stride_qh="i32", sm_scale="fp32",
    log_two_over_delta="fp32", beta="fp32", seed="i64", layer="i32",
)  # fmt: skip
_SHAPE = dict(
    NUM_KV_HEADS=4, KV_GROUP=7, BLOCK_H=8, HEAD_DIM=128, GROUP_SIZE=32, DITHER_BITS=8, HAS_OUTLIERS=False,
    OUTLIERS_PAD=2, NUM_OUTLIERS=1, HAS_SKIP=False, OFFSETS_64=False, NUM_SPLITS=4, INTERPRETED=False,
)  # fmt: skip
_GLUON_SHAPE = dict(NUM_KV_HEADS=4, KV_GROUP=7, HAS_SKIP=False, NUM_SPLITS=4)
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)(.*)")
_SOURCE = re.compile(r'//## File "(.*)", line (\d+)')
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")


def compile_cubin(*, kernel_name: str, certificate: bool, v_dither: bool) -> bytes:
    """The stage 1 at the benchmark's shape and ``LAUNCH`` config, as an sm_90 cubin."""
    if kernel_name == "gluon":
        from triton.experimental.gluon._runtime import GluonASTSource

        from witcert.kernels import gluon_decode

        kernel, source_type = gluon_decode._decode_stage1_gluon, GluonASTSource
        constants = dict(_GLUON_SHAPE, CERTIFICATE=certificate)
        cap = LAUNCH.gluon_maxnreg if certificate else LAUNCH.gluon_maxnreg_nocert
        options = {"num_warps": gluon_decode.NUM_WARPS, **({"maxnreg": cap} if cap else {})}
    else:
        kernel, source_type = triton_kernels._decode_stage1, ASTSource
        constants = dict(_SHAPE, BLOCK_N=LAUNCH.block_n, CERTIFICATE=certificate, V_DITHER=v_dither)
        options = {"num_warps": LAUNCH.num_warps, "num_stages": LAUNCH.num_stages}
        if LAUNCH.maxnreg:
            options["maxnreg"] = LAUNCH.maxnreg
    scalars = dict(_SCALARS, seed_lo="i32", seed_hi="i32")
    signature = {
        name: "constexpr" if name in constants else ("*" + _POINTERS[name] if name in _POINTERS else scalars[name])
        for name in kernel.arg_names
    }
    index = kernel.arg_names.index
    aligned = {(index(k),): [["tt.divisibility", 16]] for k in signature if k in _POINTERS or k.startswith("stride")}
    source = source_type(
        fn=kernel, signature=signature, constexprs={(index(k),): v for k, v in constants.items()}, attrs=aligned
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def _tool(name: str, *args: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(_BIN / name), *args, file.name], capture_output=True, text=True, check=True).stdout


def profile(cubin: bytes) -> tuple[collections.Counter[str], collections.Counter[tuple[str, int]], int, int]:
    """Opcode counts of the kernel, instructions per source line in the token loop, the loop's length
    (the longest backward branch's span), and registers per thread."""
    instructions: list[tuple[str, str, tuple[str, int]]] = []
    labels: dict[str, int] = {}
    where = ("?", 0)
    for text in _tool("nvdisasm", "-c", "-g", cubin=cubin).splitlines():
        if label := _LABEL.match(text):
            labels[label.group(1)] = len(instructions)
        elif source := _SOURCE.search(text):
            where = (source.group(1), int(source.group(2)))
        elif instruction := _INSTRUCTION.match(text):
            instructions.append((instruction.group(1).split(".")[0], instruction.group(2), where))
    loop = (0, len(instructions))
    for position, (opcode, operands, _) in enumerate(instructions):
        target = re.search(r"\.(L_x_\d+)", operands) if opcode == "BRA" else None
        if target and labels.get(target.group(1), position) < position:
            start = labels[target.group(1)]
            if loop == (0, len(instructions)) or position - start > loop[1] - loop[0]:
                loop = (start, position + 1)
    opcodes = collections.Counter(opcode for opcode, _, _ in instructions)
    lines = collections.Counter(where for _, _, where in instructions[loop[0] : loop[1]])
    registers = int(re.search(r"REG:(\d+)", _tool("cuobjdump", "-res-usage", cubin=cubin)).group(1))
    return opcodes, lines, loop[1] - loop[0], registers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", choices=["gluon", "triton"], default="gluon", help="which stage 1 (default gluon)")
    parser.add_argument(
        "--v-dither", action="store_true", help="the dithered-V variant, Triton only (default: V nearest)"
    )
    parser.add_argument("--top", type=int, default=10, help="most frequent opcodes to list")
    parser.add_argument("--by-line", type=int, default=0, metavar="N", help="also list the N heaviest source lines")
    args = parser.parse_args(argv)
    if args.v_dither and args.kernel == "gluon":
        parser.error("the Gluon stage 1 has no dithered-V variant (--kernel triton)")
    print(f"Triton {triton.__version__}, sm_90, {args.kernel} stage 1, launch {LAUNCH}, "
          f"V {'dithered' if args.v_dither else 'nearest'}")  # fmt: skip
    for certificate in (True, False):
        cubin = compile_cubin(kernel_name=args.kernel, certificate=certificate, v_dither=args.v_dither)
        opcodes, lines, loop, registers = profile(cubin)
        print(
            f"\n{'with' if certificate else 'without'} certificate: {sum(opcodes.values())} instructions, "
            f"{loop} in the token loop, {registers} registers, {opcodes['STL']} spill stores"
        )
        print("  " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(args.top)))
        for (path, line), n in lines.most_common(args.by_line):
            text = Path(path).read_text().splitlines()[line - 1].strip() if Path(path).exists() else ""
            print(f"  {n:5d}  {Path(path).name}:{line}  {text[:90]}")


if __name__ == "__main__":
    main()
