"""A reader of the few PTX instructions the Gluon kernel's asm blocks use, on 32-bit words.

Enough to check those blocks' text against what ``tests/gluon_emulation.py`` says they compute (the GPU runs
the same text compiled): ``mov.b32``, ``prmt.b32`` (default mode), and the ``f16x2`` instructions ``add.rn``,
``sub.rn``, ``mul.rn``, ``fma.rn`` and ``neg``, each half rounded once to nearest even as the hardware does; the
``f32`` instructions ``add.rn``, ``sub.rn``, ``mul.rn``, ``fma.rn`` (rounded once), ``max`` (a NaN operand gives the
other), ``setp.lt``, ``setp.ge`` and ``testp.notanumber`` into predicates, and ``ex2.approx.ftz`` and
``rcp.approx.ftz`` read as exact, with results below ``2**-126`` flushed to 0 (the hardware's are within 2 ulp);
instructions guarded by a predicate (``@p``, ``@!p``) and ``bra`` to a label in the block (``${:uid}`` in a name is
dropped). Registers are ``$n`` operands and ``.reg`` names, float immediates ``0fXXXXXXXX``; anything else raises.
"""

from __future__ import annotations

import re
from fractions import Fraction

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


def f32(word: int) -> np.float32:
    """The float32 value of a 32-bit word."""
    return np.array([word], dtype=np.uint32).view(np.float32)[0]


def f32_word(value: float) -> int:
    """A value rounded to float32 (nearest even) as a 32-bit word."""
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


_F16X2 = {
    "add.rn.f16x2": lambda a, b: a + b,
    "sub.rn.f16x2": lambda a, b: a - b,
    "mul.rn.f16x2": lambda a, b: a * b,  # fp16 x fp16 is exact in float64
    "fma.rn.f16x2": lambda a, b, c: a * b + c,  # and so is the sum: one rounding, as fma
    "neg.f16x2": lambda a: -a,
}


def _fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """``a b + c`` rounded once to float32: exactly in rationals where all three are finite."""
    if not all(np.isfinite(x) for x in (a, b, c)):
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    nearest = np.float32(float(exact))  # float() rounds the rational to float64, then to float32
    # Rounding twice can miss by one step: pick the float32 neighbour nearest to the exact value (ties to even).
    candidates = [np.nextafter(nearest, np.float32(-np.inf)), nearest, np.nextafter(nearest, np.float32(np.inf))]
    candidates = [x for x in candidates if np.isfinite(x)] or [nearest]
    return min(candidates, key=lambda x: (abs(Fraction(float(x)) - exact), f32_word(x) & 1))


def _flushed(x: np.float32) -> np.float32:
    return np.float32(0.0) if abs(x) < np.float32(2.0**-126) else x


def _ex2(a: np.float32) -> np.float32:
    with np.errstate(over="ignore", under="ignore"):
        return _flushed(np.exp2(_flushed(a)))


def _rcp(a: np.float32) -> np.float32:
    with np.errstate(divide="ignore", over="ignore"):
        return _flushed(np.float32(1.0) / _flushed(a))


def _max(a: np.float32, b: np.float32) -> np.float32:
    return b if np.isnan(a) else a if np.isnan(b) else max(a, b)


_F32 = {
    "add.rn.f32": lambda a, b: a + b,
    "sub.rn.f32": lambda a, b: a - b,
    "mul.rn.f32": lambda a, b: a * b,
    "fma.rn.f32": _fma,
    "max.f32": _max,
    "ex2.approx.ftz.f32": _ex2,
    "rcp.approx.ftz.f32": _rcp,
}
_COMPARE = {
    "setp.lt.f32": lambda a, b: bool(a < b),
    "setp.ge.f32": lambda a, b: bool(a >= b),
    "testp.notanumber.f32": lambda a: bool(np.isnan(a)),
}
_LABEL = re.compile(r"^(\w+):\s*")
_GUARD = re.compile(r"^@(!?)(\w+)\s+")


def _statements(asm: str) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
    """``asm`` as ``(guard, opcode, operands)`` statements and its labels (the index of the statement each
    precedes)."""
    statements: list[tuple[str, str, str]] = []
    labels: dict[str, int] = {}
    for statement in asm.replace("${:uid}", "").split(";"):
        statement = statement.replace("{", " ").replace("}", " ").strip()
        while label := _LABEL.match(statement):
            labels[label.group(1)] = len(statements)
            statement = statement[label.end() :]
        if not statement or statement.startswith(".reg"):
            continue
        guard = ""
        if match := _GUARD.match(statement):
            guard, statement = match.group(1) + match.group(2), statement[match.end() :]
        opcode, operands = statement.split(None, 1)
        statements.append((guard, opcode, operands))
    return statements, labels


def run(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run ``asm`` (an inline-asm block's text) on ``inputs`` (``{"$2": word, ...}``); returns every register (a
    predicate as 0 or 1)."""
    registers = dict(inputs)

    def read(operand: str) -> int:
        if operand in registers:
            return registers[operand]
        if operand.startswith("0f"):
            return int(operand[2:], 16)
        return int(operand, 0)

    statements, labels = _statements(asm)
    position = 0
    while position < len(statements):
        guard, opcode, operands = statements[position]
        position += 1
        if guard and bool(registers[guard.lstrip("!")]) == guard.startswith("!"):
            continue
        if opcode == "bra":
            position = labels[operands.strip()]
            continue
        target, *sources = (operand.strip() for operand in operands.split(","))
        values = [read(source) for source in sources]
        if opcode == "mov.b32":
            registers[target] = values[0]
        elif opcode == "prmt.b32":
            registers[target] = prmt(*values)
        elif opcode in _F16X2:
            registers[target] = word(_F16X2[opcode](*(halves(value) for value in values)))
        elif opcode in _F32:
            with np.errstate(over="ignore", invalid="ignore"):
                registers[target] = f32_word(_F32[opcode](*(f32(value) for value in values)))
        elif opcode in _COMPARE:
            registers[target] = int(_COMPARE[opcode](*(f32(value) for value in values)))
        else:
            raise NotImplementedError(f"ptx_subset: {opcode}")
    return registers
