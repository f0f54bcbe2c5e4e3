"""Static SASS of the int8 stage-1 kernels for sm_90 (Hopper), compiled without a GPU.

``test_kernels_sass.py`` checks with it what the compiled Gluon token loop does (its copies, barriers, MMAs and
spills) and that the tiled extend reaches the tensor cores; ``bench/lab/count_sass.py`` reports the loop's
instructions per 128-token tile. The shape is the benchmark's: Qwen2.5-7B decode (4 KV heads of 7 query heads,
D 128, G 32, 8-bit dithers, fp16 queries). Figures match the H200's binaries only with the device's Triton
version.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from witcert.kernels import triton_kernels
from witcert.kernels.launch import LAUNCH

_POINTERS = dict(
    Q="fp16", KCodes="u8", KScales="fp16", KOutliers="fp16", VCodes="u8", VScales="fp16", VOutliers="fp16",
    KAlpha="fp32", VAlpha="fp32", OutlierIndex="i32", OutlierChannels="i32", KvStart="i32", KvEnd="i32",
    KvIndices="i32", Skip="i8",
    PartOut="fp32", PartLse="fp32", PartMax="fp32", PartA1="fp32", PartB="fp32", PartURest="fp32",
    PartPRest="fp32", PartU="fp32",
)  # fmt: skip
# beta: the name of kappa's argument in the stage 1s before the certificate's cells, which bench/lab/count_sass.py
# compiles from bench/lab/whatif_stage1.py's what-ifs of those commits.
_SCALARS = dict(
    num_slots="i32", num_kv_indices="i32", stride_qb="i32", stride_qh="i32", sm_scale="fp32",
    log_two_over_delta="fp32", kappa="fp32", beta="fp32", seed="i64", layer="i32",
)  # fmt: skip
_SHAPE = dict(
    NUM_KV_HEADS=4, KV_GROUP=7, BLOCK_H=8, HEAD_DIM=128, GROUP_SIZE=32, DITHER_BITS=8, HAS_OUTLIERS=False,
    OUTLIERS_PAD=2, NUM_OUTLIERS=1, HAS_SKIP=False, OFFSETS_64=False, NUM_SPLITS=4, INTERPRETED=False,
)  # fmt: skip
_GLUON_SHAPE = dict(NUM_KV_HEADS=4, KV_GROUP=7, HAS_SKIP=False, OFFSETS_64=False, NUM_SPLITS=4, V_DITHER=False)
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)(.*)")
_SOURCE = re.compile(r'//## File "(.*)", line (\d+)')
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")


def compile_cubin(
    *,
    kernel_name: str,
    certificate: bool,
    v_dither: bool = False,
    offsets_64: bool = False,
    q_dtype: str = "fp16",
    gluon_module: ModuleType | None = None,
) -> bytes:
    """The stage 1 (``"gluon"`` or ``"triton"``, or extend's tiled kernel, ``"extend"``) at the benchmark's
    shape and ``LAUNCH`` config, as an sm_90 cubin (``offsets_64``: the variant for pools of 2**31 code bytes
    or more; ``q_dtype``: ``"fp16"`` or ``"bf16"`` queries; ``gluon_module``: another version of
    ``gluon_decode`` to compile in its place); compiling needs no GPU."""
    if kernel_name == "extend":
        return _compile_extend(q_dtype, certificate)
    if kernel_name == "gluon":
        from triton.experimental.gluon._runtime import GluonASTSource

        from witcert.kernels import gluon_decode, gluon_tiles

        kernel, source_type = (gluon_module or gluon_decode).decode_stage1_gluon, GluonASTSource
        constants = dict(_GLUON_SHAPE, CERTIFICATE=certificate, OFFSETS_64=offsets_64, V_DITHER=v_dither)
        cap = LAUNCH.gluon_maxnreg if certificate else LAUNCH.gluon_maxnreg_nocert
        options = {"num_warps": gluon_tiles.NUM_WARPS, **({"maxnreg": cap} if cap else {})}
    else:
        kernel, source_type = triton_kernels.decode_stage1, ASTSource
        constants = dict(
            _SHAPE, BLOCK_N=LAUNCH.block_n, CERTIFICATE=certificate, V_DITHER=v_dither, OFFSETS_64=offsets_64
        )
        options = {"num_warps": LAUNCH.num_warps, "num_stages": LAUNCH.num_stages}
        if LAUNCH.maxnreg:
            options["maxnreg"] = LAUNCH.maxnreg
    return _sm90_cubin(kernel, source_type, dict(_POINTERS, Q=q_dtype), _SCALARS, constants, options)


def _sm90_cubin(
    kernel: object, source_type: type, pointers: dict, scalars: dict, constants: dict, options: dict
) -> bytes:
    """Compile ``kernel`` for sm_90 with these argument types (pointers and strides 16-byte aligned)."""
    signature = {
        name: "constexpr" if name in constants else ("*" + pointers[name] if name in pointers else scalars[name])
        for name in kernel.arg_names
    }
    index = kernel.arg_names.index
    aligned = {(index(k),): [["tt.divisibility", 16]] for k in signature if k in pointers or k.startswith("stride")}
    source = source_type(
        fn=kernel, signature=signature, constexprs={(index(k),): v for k, v in constants.items()}, attrs=aligned
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def _compile_extend(q_dtype: str, certificate: bool) -> bytes:
    """The tiled extend kernel (``triton_extend``) at the benchmark's shape and ``LAUNCH``."""
    from witcert.kernels import triton_extend

    kernel = triton_extend.extend_stage1
    pointers = dict(
        Q=q_dtype, KCodes="u8", KScales="fp16", VCodes="u8", VScales="fp16", KAlpha="fp32", QoIndptr="i32",
        KvIndptr="i32", KvIndices="i32", BlockSequence="i32", BlockFirst="i32", PartOut="fp32", PartLse="fp32",
        PartMax="fp32", PartA1="fp32", PartB="fp32", PartURest="fp32", PartPRest="fp32", PartU="fp32",
    )  # fmt: skip
    scalars = dict(
        num_sequences="i32", num_slots="i32", num_kv_indices="i32", stride_qt="i32", stride_qh="i32",
        sm_scale="fp32", log_two_over_delta="fp32", kappa="fp32",
    )  # fmt: skip
    block_h = _SHAPE["BLOCK_H"]
    constants = dict(
        NUM_KV_HEADS=_SHAPE["NUM_KV_HEADS"], KV_GROUP=_SHAPE["KV_GROUP"], BLOCK_H=block_h,
        BLOCK_M=LAUNCH.extend_rows // block_h, BLOCK_N=LAUNCH.extend_block_n, HEAD_DIM=_SHAPE["HEAD_DIM"],
        GROUP_SIZE=_SHAPE["GROUP_SIZE"], OFFSETS_64=False, NUM_SPLITS=4, CERTIFICATE=certificate, INTERPRETED=False,
    )  # fmt: skip
    return _sm90_cubin(kernel, ASTSource, pointers, scalars, constants, {"num_warps": LAUNCH.extend_num_warps})


def _tool(name: str, *args: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(_BIN / name), *args, file.name], capture_output=True, text=True, check=True).stdout


@dataclass
class SassProfile:
    """One cubin's static SASS: opcode counts of the whole kernel and of its token loop (the longest
    backward branch's span, one iteration per tile), the loop's instructions per source line, registers, and the
    loop's tail: its instructions after the last fp16 MMA (``HMMA.16816``, PV's last), by opcode and source line."""

    opcodes: collections.Counter[str]
    loop_opcodes: collections.Counter[str]
    loop_lines: collections.Counter[tuple[str, int]]
    loop_length: int
    registers: int
    tail_opcodes: collections.Counter[str]
    tail_lines: collections.Counter[tuple[str, int]]


def disassemble(cubin: bytes) -> tuple[list[tuple[str, str, tuple[str, int]]], dict[str, int]]:
    """``cubin``'s instructions in order, each ``(mnemonic, operands, (source file, line))``, and its branch labels
    (the index of the instruction each precedes), by Triton's own ``nvdisasm``."""
    instructions: list[tuple[str, str, tuple[str, int]]] = []
    labels: dict[str, int] = {}
    where = ("?", 0)
    for text in _tool("nvdisasm", "-c", "-g", cubin=cubin).splitlines():
        if label := _LABEL.match(text):
            labels[label.group(1)] = len(instructions)
        elif source := _SOURCE.search(text):
            where = (source.group(1), int(source.group(2)))
        elif instruction := _INSTRUCTION.match(text):
            instructions.append((instruction.group(1), instruction.group(2), where))
    return instructions, labels


def profile(cubin: bytes) -> SassProfile:
    """Disassemble ``cubin`` (Triton's own ``nvdisasm`` and ``cuobjdump``) into a ``SassProfile``."""
    instructions, labels = disassemble(cubin)
    loop = (0, len(instructions))
    for position, (mnemonic, operands, _) in enumerate(instructions):
        target = re.search(r"\.(L_x_\d+)", operands) if _opcode(mnemonic) == "BRA" else None
        if target and labels.get(target.group(1), position) < position:
            start = labels[target.group(1)]
            if loop == (0, len(instructions)) or position - start > loop[1] - loop[0]:
                loop = (start, position + 1)
    body = instructions[loop[0] : loop[1]]
    fp16_mmas = [position for position, (mnemonic, _, _) in enumerate(body) if mnemonic.startswith("HMMA.16816")]
    tail = body[fp16_mmas[-1] + 1 :] if fp16_mmas else []
    return SassProfile(
        opcodes=collections.Counter(_opcode(mnemonic) for mnemonic, _, _ in instructions),
        loop_opcodes=collections.Counter(_opcode(mnemonic) for mnemonic, _, _ in body),
        loop_lines=collections.Counter(where for _, _, where in body),
        loop_length=len(body),
        registers=int(re.search(r"REG:(\d+)", _tool("cuobjdump", "-res-usage", cubin=cubin)).group(1)),
        tail_opcodes=collections.Counter(_opcode(mnemonic) for mnemonic, _, _ in tail),
        tail_lines=collections.Counter(where for _, _, where in tail),
    )


def _opcode(mnemonic: str) -> str:
    """``HMMA.16816.F32`` -> ``HMMA``."""
    return mnemonic.split(".")[0]


def loop_counts(kernel_name: str) -> dict[str, dict[str, int]]:
    """The token loop's opcode counts of ``kernel_name`` (``"gluon"`` or ``"extend"``): both certificate variants
    for fp16 and bf16 queries, keyed ``"<q dtype> <certificate>"``, and for the Gluon stage 1 also with a dithered
    V and fp16 queries (``"fp16 <certificate> vdither"``)."""
    variants = [(q_dtype, certificate, False) for q_dtype in ("fp16", "bf16") for certificate in (True, False)]
    if kernel_name == "gluon":
        variants += [("fp16", certificate, True) for certificate in (True, False)]
    return {
        f"{q_dtype} {certificate}" + (" vdither" if v_dither else ""): dict(
            profile(
                compile_cubin(kernel_name=kernel_name, certificate=certificate, q_dtype=q_dtype, v_dither=v_dither)
            ).loop_opcodes
        )
        for q_dtype, certificate, v_dither in variants
    }


def main() -> None:
    """``python tests/sass.py KERNEL...``: ``loop_counts`` of each kernel named, as one JSON line keyed by kernel.
    Run in a fresh process: under ``TRITON_INTERPRET=1`` (CPU tests) Triton's library functions are interpreted,
    and a Gluon kernel cannot call them."""
    import json
    import sys

    print(json.dumps({kernel_name: loop_counts(kernel_name) for kernel_name in sys.argv[1:] or ["gluon"]}))


if __name__ == "__main__":
    main()
