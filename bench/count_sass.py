"""Static SASS of the int8 decode kernel (``_decode_stage1``) for sm_90, compiled here without a GPU.

The kernel is limited by instruction issue, not memory (docs/KERNELS.md), so the instructions per
tile are the quantity to drive down; the timings come from ``bench/bench_kernels.py`` on the H200.
This compiles the kernel at the benchmark's shape (Qwen2.5-7B: 4 KV heads of 7 query heads, D 128,
G 32, 8-bit dithers, fp16 query) and launch config (``LAUNCH``: ``BLOCK_N`` 128, 4 warps, 2 stages),
disassembles it with the ``nvdisasm`` that Triton ships, and prints per variant the instruction count
of the whole kernel (the token loop runs once per ``BLOCK_N`` tokens; prologue and epilogue are a few
percent), the registers, the local-memory spill stores, the most frequent opcodes and, with
``--by-line``, which source lines the instructions come from.

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
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)")
_SOURCE = re.compile(r'//## File "(.*)", line (\d+)')


def compile_cubin(*, certificate: bool, v_dither: bool) -> bytes:
    """``_decode_stage1`` at the benchmark's shape and ``LAUNCH`` config, as an sm_90 cubin."""
    kernel = triton_kernels._decode_stage1
    constants = dict(_SHAPE, BLOCK_N=LAUNCH.block_n, CERTIFICATE=certificate, V_DITHER=v_dither)
    signature = {
        name: "constexpr" if name in constants else ("*" + _POINTERS[name] if name in _POINTERS else _SCALARS[name])
        for name in kernel.arg_names
    }
    index = kernel.arg_names.index
    aligned = {(index(k),): [["tt.divisibility", 16]] for k in signature if k in _POINTERS or k.startswith("stride")}
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(index(k),): v for k, v in constants.items()}, attrs=aligned
    )
    options = {"num_warps": LAUNCH.num_warps, "num_stages": LAUNCH.num_stages}
    if LAUNCH.maxnreg:
        options["maxnreg"] = LAUNCH.maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def _tool(name: str, *args: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(_BIN / name), *args, file.name], capture_output=True, text=True, check=True).stdout


def profile(cubin: bytes) -> tuple[collections.Counter[str], collections.Counter[tuple[str, int]], int]:
    """Opcode counts, instruction counts per source line, and registers per thread."""
    opcodes: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[tuple[str, int]] = collections.Counter()
    where = ("?", 0)
    for text in _tool("nvdisasm", "-c", "-g", cubin=cubin).splitlines():
        if source := _SOURCE.search(text):
            where = (source.group(1), int(source.group(2)))
        elif instruction := _INSTRUCTION.match(text):
            opcodes[instruction.group(1).split(".")[0]] += 1
            lines[where] += 1
    registers = int(re.search(r"REG:(\d+)", _tool("cuobjdump", "-res-usage", cubin=cubin)).group(1))
    return opcodes, lines, registers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--v-dither", action="store_true", help="the dithered-V variant (default: V nearest)")
    parser.add_argument("--top", type=int, default=10, help="most frequent opcodes to list")
    parser.add_argument("--by-line", type=int, default=0, metavar="N", help="also list the N heaviest source lines")
    args = parser.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_90, launch {LAUNCH}, V {'dithered' if args.v_dither else 'nearest'}")
    for certificate in (True, False):
        opcodes, lines, registers = profile(compile_cubin(certificate=certificate, v_dither=args.v_dither))
        print(
            f"\n{'with' if certificate else 'without'} certificate: {sum(opcodes.values())} instructions, "
            f"{registers} registers, {opcodes['STL']} spill stores"
        )
        print("  " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(args.top)))
        for (path, line), n in lines.most_common(args.by_line):
            text = Path(path).read_text().splitlines()[line - 1].strip() if Path(path).exists() else ""
            print(f"  {n:5d}  {Path(path).name}:{line}  {text[:90]}")


if __name__ == "__main__":
    main()
