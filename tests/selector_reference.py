"""A deliberately simple, row-by-row evaluator of selector trees: the oracle that the
batch evaluator (raymq.selector.evaluate) is checked against. Returns True, False or
None (UNKNOWN) following the rules in that module's docstring."""

from __future__ import annotations

import re

from raymq.selector.ast import Between, Binary, Ident, In, IsNull, Like, Literal, Unary, like_regex


def _value(v):
    if v is None or isinstance(v, bool | str):
        return v
    if isinstance(v, int | float):
        return float(v)
    return None


def _kind(v):
    return "bool" if isinstance(v, bool) else "str" if isinstance(v, str) else "num"


def _not(a):
    return None if a is None else not a


def _and(a, b):
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return True


def _or(a, b):
    if a is True or b is True:
        return True
    if a is None or b is None:
        return None
    return False


def _cmp(op, a, b):
    if a is None or b is None:
        return None
    if _kind(a) != _kind(b):
        return False
    if _kind(a) == "bool" and op not in ("=", "<>"):
        return False
    if isinstance(a, float) and (a != a or b != b):  # NaN compares false (IEEE)
        return op == "<>"
    return {
        "=": a == b,
        "<>": a != b,
        "<": a < b,
        ">": a > b,
        "<=": a <= b,
        ">=": a >= b,
    }[op]


def _as_bool(v):
    return v if isinstance(v, bool) else None


def _num(v):
    return v if isinstance(v, float) else None


def ref_eval(node, row: dict):
    """Evaluate one message (a properties dict, headers included) with SQL logic."""
    match node:
        case Literal(value):
            return value
        case Ident(name):
            return _value(row.get(name))
        case Unary("NOT", x):
            return _not(_as_bool(ref_eval(x, row)))
        case Unary("-", x):
            v = _num(ref_eval(x, row))
            return None if v is None else -v
        case Unary("+", x):
            return _num(ref_eval(x, row))
        case Binary("AND", a, b):
            return _and(_as_bool(ref_eval(a, row)), _as_bool(ref_eval(b, row)))
        case Binary("OR", a, b):
            return _or(_as_bool(ref_eval(a, row)), _as_bool(ref_eval(b, row)))
        case Binary(op, a, b) if op in "+-*/":
            x, y = _num(ref_eval(a, row)), _num(ref_eval(b, row))
            if x is None or y is None or (op == "/" and y == 0):
                return None
            return {"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else None}[op]
        case Binary(op, a, b):
            return _cmp(op, ref_eval(a, row), ref_eval(b, row))
        case Between(x, lo, hi, neg):
            v = ref_eval(x, row)
            r = _and(_cmp(">=", v, ref_eval(lo, row)), _cmp("<=", v, ref_eval(hi, row)))
            return _not(r) if neg else r
        case In(x, values, neg):
            v = ref_eval(x, row)
            r = False
            for lit in values:
                r = _or(r, _cmp("=", v, lit.value))
            return _not(r) if neg else r
        case Like(x, pattern, escape, neg):
            v = ref_eval(x, row)
            if v is None:
                return None
            r = (
                isinstance(v, str)
                and re.fullmatch(like_regex(pattern, escape, anchored=False), v) is not None
            )
            return _not(r) if neg else r
        case IsNull(x, neg):
            r = ref_eval(x, row) is None
            return not r if neg else r
    raise TypeError(node)
