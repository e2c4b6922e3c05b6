"""The syntax tree of a message selector (the JMS SQL-92 conditional subset).

Nodes are frozen dataclasses; ``raymq.selector.parser`` builds them and
``raymq.selector.evaluate`` evaluates them over a whole batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Header identifiers a selector may use besides message properties.
#: Values: the message's offset, its timestamp in milliseconds since the epoch (as JMS),
#: and its delivery count (1 on first delivery, as JMSXDeliveryCount).
HEADER_OFFSET = "RayMQOffset"
HEADER_TIMESTAMP = "JMSTimestamp"
HEADER_DELIVERY_COUNT = "JMSXDeliveryCount"
HEADERS = frozenset({HEADER_OFFSET, HEADER_TIMESTAMP, HEADER_DELIVERY_COUNT})


@dataclass(frozen=True)
class Literal:
    """A string, numeric (kept as float) or boolean literal."""

    value: str | float | bool


@dataclass(frozen=True)
class Ident:
    """A message property, or one of ``HEADERS``."""

    name: str


@dataclass(frozen=True)
class Unary:
    """``-x``, ``+x`` or ``NOT x``."""

    op: str
    operand: Node


@dataclass(frozen=True)
class Binary:
    """Arithmetic (``+ - * /``), comparison (``= <> < > <= >=``) or ``AND``/``OR``."""

    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class Between:
    """``expr [NOT] BETWEEN low AND high``."""

    expr: Node
    low: Node
    high: Node
    negated: bool


@dataclass(frozen=True)
class In:
    """``expr [NOT] IN (literal, ...)``."""

    expr: Node
    values: tuple[Literal, ...]
    negated: bool


@dataclass(frozen=True)
class Like:
    """``expr [NOT] LIKE 'pattern' [ESCAPE 'c']``: ``%`` any run, ``_`` one character."""

    expr: Node
    pattern: str
    escape: str | None
    negated: bool


@dataclass(frozen=True)
class IsNull:
    """``expr IS [NOT] NULL``."""

    expr: Node
    negated: bool


Node = Literal | Ident | Unary | Binary | Between | In | Like | IsNull

ARITHMETIC = frozenset({"+", "-", "*", "/"})
COMPARISON = frozenset({"=", "<>", "<", ">", "<=", ">="})
LOGICAL = frozenset({"AND", "OR"})


def identifiers(node: Node) -> frozenset[str]:
    """Every identifier the tree names."""
    match node:
        case Ident(name):
            return frozenset({name})
        case Literal():
            return frozenset()
        case Unary(_, operand):
            return identifiers(operand)
        case Binary(_, left, right):
            return identifiers(left) | identifiers(right)
        case Between(expr, low, high, _):
            return identifiers(expr) | identifiers(low) | identifiers(high)
        case In(expr, _, _) | Like(expr, _, _, _) | IsNull(expr, _):
            return identifiers(expr)
    raise TypeError(f"not a selector node: {node!r}")


def is_condition(node: Node) -> bool:
    """True when the node can yield a boolean (so it may be a whole selector)."""
    match node:
        case Literal(value):
            return isinstance(value, bool)
        case Ident():
            return True  # a boolean property
        case Unary(op, _):
            return op == "NOT"
        case Binary(op, _, _):
            return op not in ARITHMETIC
    return True


def like_regex(pattern: str, escape: str | None, *, anchored: bool = True) -> str:
    """The LIKE pattern as a regex (``%`` -> ``.*``, ``_`` -> ``.``) for RE2 and Python.

    ``anchored`` adds RE2's ``^...$`` (whole string); Python callers use ``re.fullmatch``
    without anchors instead, because Python's ``$`` also matches before a final newline.
    """
    out = ["(?s)^" if anchored else "(?s)"]
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if escape is not None and ch == escape and i + 1 < len(pattern):
            out.append(_literal(pattern[i + 1]))
            i += 2
            continue
        out.append(".*" if ch == "%" else "." if ch == "_" else _literal(ch))
        i += 1
    if anchored:
        out.append("$")
    return "".join(out)


def _literal(ch: str) -> str:
    if ch.isalnum() or ch == " ":
        return ch
    if ch in "\\.^$|?*+()[]{}":
        return "\\" + ch
    return ch if ch.isprintable() and ch not in "#&~-" else f"[{ch}]" if ch != "]" else "\\]"
