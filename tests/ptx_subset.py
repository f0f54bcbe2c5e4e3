"""A reader of the few PTX instructions the Gluon kernel's operand-building asm blocks use, on 32-bit words.

Enough to check those blocks' text against what ``tests/gluon_emulation.py`` says they compute (the GPU runs
the same text compiled): ``mov.b32``, ``prmt.b32`` (default mode), and the ``f16x2`` instructions ``add.rn``,
``sub.rn``, ``mul.rn``, ``fma.rn`` and ``neg``, each half rounded once to nearest even as the hardware does.
Registers are ``$n`` operands and ``.reg .b32`` names; anything else raises.
"""

from __future__ import annotations

import numpy as np


def prmt(a: int, b: int, selector: int) -> int:
    """``prmt.b32`` in its default mode: result byte i is byte ``selector[i] & 7`` of ``{b, a}``, or that byte's
    sign replicated where ``selector[i] & 8``."""
    source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    word = 0
    for i in range(4):
        nibble = (selector >> 4 * i) & 0xF
        byte = source[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        word |= byte << 8 * i
    return word


def halves(word: int) -> np.ndarray:
    """The two fp16 values of an ``f16x2`` word, low half first, as float64."""
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)


def word(values: np.ndarray) -> int:
    """Two values rounded to fp16 (nearest even), low half first, as one ``f16x2`` word."""
    low, high = np.asarray(values, dtype=np.float64).astype(np.float16).view(np.uint16).tolist()
    return low | (high << 16)


_F16X2 = {
    "add.rn.f16x2": lambda a, b: a + b,
    "sub.rn.f16x2": lambda a, b: a - b,
    "mul.rn.f16x2": lambda a, b: a * b,  # fp16 x fp16 is exact in float64
    "fma.rn.f16x2": lambda a, b, c: a * b + c,  # and so is the sum: one rounding, as fma
    "neg.f16x2": lambda a: -a,
}


def run(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run ``asm`` (an inline-asm block's text) on ``inputs`` (``{"$2": word, ...}``); returns every register."""
    registers = dict(inputs)

    def read(operand: str) -> int:
        return registers[operand] if operand in registers else int(operand, 0)

    for statement in asm.split(";"):
        statement = statement.replace("{", " ").replace("}", " ").strip()
        if not statement or statement.startswith(".reg"):
            continue
        opcode, operands = statement.split(None, 1)
        target, *sources = (operand.strip() for operand in operands.split(","))
        values = [read(source) for source in sources]
        if opcode == "mov.b32":
            registers[target] = values[0]
        elif opcode == "prmt.b32":
            registers[target] = prmt(*values)
        elif opcode in _F16X2:
            registers[target] = word(_F16X2[opcode](*(halves(value) for value in values)))
        else:
            raise NotImplementedError(f"ptx_subset: {opcode}")
    return registers
