"""Batch evaluation of a selector tree with ``pyarrow.compute``.

Each value is a ``Typed``: three Arrow columns (number as float64, string, boolean), at
most one of them valid per row; a row where none is valid is NULL. The rules, kept by
``tests/selector_reference.py`` row by row as well:

- A missing property, or one that is None, is NULL. Every number is compared as a
  float64 (ints beyond 2**53 lose precision).
- A comparison with a NULL operand is UNKNOWN; a comparison of unlike types (a number
  with a string, a boolean with anything but a boolean) is FALSE; booleans support only
  ``=`` and ``<>``; strings compare by code point with every operator.
- Arithmetic on anything but two numbers is NULL; division by zero is NULL.
- ``AND``/``OR``/``NOT`` use SQL's three-valued logic; an operand that is not a
  boolean is UNKNOWN. ``IN`` is a chain of ``=`` joined by OR, ``BETWEEN`` is ``>=``
  AND ``<=``; ``LIKE`` on a NULL is UNKNOWN, on a non-string FALSE.
- A message is selected only when the whole selector is TRUE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from raymq.batch import fixed_array
from raymq.selector.ast import (
    ARITHMETIC,
    Between,
    Binary,
    Ident,
    In,
    IsNull,
    Like,
    Literal,
    Node,
    Unary,
    like_regex,
)

# Arrays and scalars are built from buffers, never from Python values (pa.array,
# pa.scalar, a Python literal passed to pyarrow.compute, to_numpy): pyarrow imports
# pandas on the first of those, ~0.24 s of CPU in the process that evaluates its first
# selector (a queue or TargetList actor, on a consumer's first message).


def _validity(values: Sequence[object]) -> pa.Buffer | None:
    """The validity bitmap of ``values`` (None entries are null); None if none is."""
    valid = np.fromiter((v is not None for v in values), dtype=np.bool_, count=len(values))
    return None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))


def _floats(values: Sequence[float | None]) -> pa.Array:
    data = np.fromiter((0.0 if v is None else v for v in values), np.float64, len(values))
    return pa.Array.from_buffers(pa.float64(), len(values), [_validity(values), pa.py_buffer(data)])


def _bools(values: Sequence[bool | None]) -> pa.Array:
    bits = np.packbits(
        np.fromiter((v is True for v in values), np.bool_, len(values)), bitorder="little"
    )
    return pa.Array.from_buffers(pa.bool_(), len(values), [_validity(values), pa.py_buffer(bits)])


def _strings(values: Sequence[str | None]) -> pa.Array:
    encoded = [b"" if v is None else v.encode() for v in values]
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    buffers = [_validity(values), pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers)


_NULL_NUM = pa.nulls(1, pa.float64())[0]
_NULL_STR = pa.nulls(1, pa.string())[0]
_NULL_BOOL = pa.nulls(1, pa.bool_())[0]
_FALSE = _bools([False])[0]
_ZERO = _floats([0.0])[0]
_ORDERING = {"<": "less", ">": "greater", "<=": "less_equal", ">=": "greater_equal"}
_ARITH = {"+": "add", "-": "subtract", "*": "multiply"}


class _Compute:
    """``pyarrow.compute``, imported on first use: importing it costs every queue and
    TargetList actor about 35 ms of its start, and most never evaluate a selector."""

    def __getattr__(self, name: str):
        import pyarrow.compute as compute

        globals()["pc"] = compute
        return getattr(compute, name)


pc: Any = _Compute()


@dataclass(frozen=True)
class Typed:
    """A column of selector values split by type (arrays, or scalars for literals)."""

    num: pa.Array | pa.Scalar
    str: pa.Array | pa.Scalar
    bool: pa.Array | pa.Scalar

    @classmethod
    def of_bool(cls, b) -> Typed:
        return cls(_NULL_NUM, _NULL_STR, b)

    @classmethod
    def of_num(cls, n) -> Typed:
        return cls(n, _NULL_STR, _NULL_BOOL)

    def present(self):
        """True where the value is not NULL."""
        return pc.or_(pc.or_(pc.is_valid(self.num), pc.is_valid(self.str)), pc.is_valid(self.bool))


def typed_column(values: Sequence[object]) -> Typed:
    """Split a list of property values (None for missing) into a ``Typed`` column."""
    num = [float(v) if type(v) in (int, float) else None for v in values]
    text = [v if type(v) is str else None for v in values]
    flag = [v if type(v) is bool else None for v in values]
    return Typed(_floats(num), _strings(text), _bools(flag))


def numeric_column(values: np.ndarray) -> Typed:
    """A ``Typed`` column of numbers (header values)."""
    return Typed.of_num(fixed_array(pa.float64(), values, np.float64))


def _literal(value: object) -> Typed:
    if isinstance(value, bool):
        return Typed.of_bool(_bools([value])[0])
    if isinstance(value, float):
        return Typed.of_num(_floats([value])[0])
    return Typed(_NULL_NUM, _strings([value])[0], _NULL_BOOL)


def _unknown_unless_present(result, a: Typed, b: Typed):
    """A comparison's result: NULL operands give UNKNOWN, unlike types FALSE."""
    both = pc.and_(a.present(), b.present())
    return pc.if_else(both, pc.fill_null(result, _FALSE), _NULL_BOOL)


def _compare(op: str, a: Typed, b: Typed):
    if op in ("=", "<>"):
        fn = pc.equal if op == "=" else pc.not_equal
        result = pc.coalesce(fn(a.num, b.num), fn(a.str, b.str), fn(a.bool, b.bool))
    else:
        fn = getattr(pc, _ORDERING[op])
        result = pc.coalesce(fn(a.num, b.num), fn(a.str, b.str))
    return _unknown_unless_present(result, a, b)


def _arith(op: str, a: Typed, b: Typed) -> Typed:
    if op == "/":
        zero = pc.equal(b.num, _ZERO)
        quotient = pc.divide(a.num, pc.if_else(zero, _NULL_NUM, b.num))
        return Typed.of_num(quotient)
    return Typed.of_num(getattr(pc, _ARITH[op])(a.num, b.num))


def evaluate(node: Node, columns: Mapping[str, Typed]) -> Typed:
    """Evaluate ``node`` over ``columns`` (identifier -> Typed column of equal length)."""
    match node:
        case Literal(value):
            return _literal(value)
        case Ident(name):
            return columns[name]
        case Unary("NOT", operand):
            return Typed.of_bool(pc.invert(evaluate(operand, columns).bool))
        case Unary("-", operand):
            return Typed.of_num(pc.negate(evaluate(operand, columns).num))
        case Unary("+", operand):
            return Typed.of_num(evaluate(operand, columns).num)
        case Binary("AND", left, right):
            return Typed.of_bool(
                pc.and_kleene(evaluate(left, columns).bool, evaluate(right, columns).bool)
            )
        case Binary("OR", left, right):
            return Typed.of_bool(
                pc.or_kleene(evaluate(left, columns).bool, evaluate(right, columns).bool)
            )
        case Binary(op, left, right) if op in ARITHMETIC:
            return _arith(op, evaluate(left, columns), evaluate(right, columns))
        case Binary(op, left, right):
            return Typed.of_bool(_compare(op, evaluate(left, columns), evaluate(right, columns)))
        case Between(expr, low, high, negated):
            v = evaluate(expr, columns)
            inside = pc.and_kleene(
                _compare(">=", v, evaluate(low, columns)),
                _compare("<=", v, evaluate(high, columns)),
            )
            return Typed.of_bool(pc.invert(inside) if negated else inside)
        case In(expr, values, negated):
            v = evaluate(expr, columns)
            found = _compare("=", v, _literal(values[0].value))
            for lit in values[1:]:
                found = pc.or_kleene(found, _compare("=", v, _literal(lit.value)))
            return Typed.of_bool(pc.invert(found) if negated else found)
        case Like(expr, pattern, escape, negated):
            v = evaluate(expr, columns)
            matched = pc.match_substring_regex(v.str, like_regex(pattern, escape))
            result = pc.if_else(
                pc.is_valid(v.str), matched, pc.if_else(v.present(), _FALSE, _NULL_BOOL)
            )
            return Typed.of_bool(pc.invert(result) if negated else result)
        case IsNull(expr, negated):
            present = evaluate(expr, columns).present()
            return Typed.of_bool(present if negated else pc.invert(present))
    raise TypeError(f"not a selector node: {node!r}")


def selected(result: Typed, n: int) -> np.ndarray:
    """Rows where the selector is TRUE (UNKNOWN and non-booleans are not selected)."""
    b = result.bool
    if isinstance(b, pa.Scalar):
        return np.full(n, b.as_py() is True, dtype=np.bool_)
    if n == 0:
        return np.zeros(0, dtype=np.bool_)
    filled = pc.fill_null(b, _FALSE)  # no nulls left: its data bits are the answer
    bits = np.frombuffer(filled.buffers()[1], dtype=np.uint8)
    return np.unpackbits(bits, count=filled.offset + n, bitorder="little")[filled.offset :].view(
        np.bool_
    )
