"""Tokenizer and recursive-descent parser of JMS message selectors.

Grammar (lowest precedence first), keywords case-insensitive as in JMS::

    selector   := or_expr
    or_expr    := and_expr ("OR" and_expr)*
    and_expr   := not_expr ("AND" not_expr)*
    not_expr   := "NOT" not_expr | predicate
    predicate  := sum ( cmp_op sum
                      | ["NOT"] "BETWEEN" sum "AND" sum
                      | ["NOT"] "IN" "(" literal ("," literal)* ")"
                      | ["NOT"] "LIKE" string ["ESCAPE" string]
                      | "IS" ["NOT"] "NULL" )?
    sum        := product (("+" | "-") product)*
    product    := unary (("*" | "/") unary)*
    unary      := ("+" | "-") unary | primary
    primary    := literal | identifier | "(" or_expr ")"

Errors are ``SelectorError`` naming the 1-based position and what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from raymq.errors import SelectorError
from raymq.selector.ast import (
    Between,
    Binary,
    Ident,
    In,
    IsNull,
    Like,
    Literal,
    Node,
    Unary,
    is_condition,
)

KEYWORDS = frozenset(
    {"AND", "OR", "NOT", "BETWEEN", "IN", "LIKE", "ESCAPE", "IS", "NULL", "TRUE", "FALSE"}
)
#: Longest selector accepted (characters).
MAX_SELECTOR_LENGTH = 64 * 1024

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>'(?:[^']|'')*')
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[lLfFdD]?)
  | (?P<ident>[A-Za-z_$][A-Za-z0-9_$]*)
  | (?P<op><>|<=|>=|[=<>+\-*/(),])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Token:
    kind: str  # string, number, ident, keyword, op, end
    text: str
    pos: int  # 0-based character index


def tokenize(text: str) -> list[Token]:
    """Split a selector into tokens; raises ``SelectorError`` at an unknown character."""
    tokens: list[Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos] == "'":
                raise _error(text, pos, "a closing quote for this string")
            raise _error(text, pos, f"a token, not {text[pos]!r}")
        kind = m.lastgroup
        if kind != "ws":
            tok = m.group()
            if kind == "ident" and tok.upper() in KEYWORDS:
                tokens.append(Token("keyword", tok.upper(), pos))
            else:
                tokens.append(Token(kind, tok, pos))
        pos = m.end()
    tokens.append(Token("end", "", len(text)))
    return tokens


def _error(text: str, pos: int, expected: str) -> SelectorError:
    found = "end of input" if pos >= len(text) else repr(text[pos : pos + 12])
    return SelectorError(
        f"selector {text!r}: expected {expected} at position {pos + 1}, found {found}"
    )


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens = tokenize(text)
        self.i = 0

    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def fail(self, expected: str, tok: Token | None = None) -> SelectorError:
        return _error(self.text, (tok or self.tok).pos, expected)

    def accept(self, kind: str, text: str | None = None) -> Token | None:
        t = self.tok
        if t.kind == kind and (text is None or t.text == text):
            self.i += 1
            return t
        return None

    def expect(self, kind: str, text: str | None, expected: str) -> Token:
        t = self.accept(kind, text)
        if t is None:
            raise self.fail(expected)
        return t

    def keyword(self, word: str) -> bool:
        return self.accept("keyword", word) is not None

    # -- grammar -----------------------------------------------------------------------

    def selector(self) -> Node:
        start = self.tok
        node = self.or_expr()
        if self.tok.kind != "end":
            raise self.fail("an operator or the end of the selector")
        if not is_condition(node):
            raise self.fail("a condition (comparison, AND/OR/NOT, ...), not a value", start)
        return node

    def or_expr(self) -> Node:
        node = self.and_expr()
        while self.keyword("OR"):
            node = Binary("OR", node, self.and_expr())
        return node

    def and_expr(self) -> Node:
        node = self.not_expr()
        while self.keyword("AND"):
            node = Binary("AND", node, self.not_expr())
        return node

    def not_expr(self) -> Node:
        if self.keyword("NOT"):
            return Unary("NOT", self.not_expr())
        return self.predicate()

    def predicate(self) -> Node:
        left = self.sum()
        t = self.tok
        if t.kind == "op" and t.text in ("=", "<>", "<", ">", "<=", ">="):
            self.i += 1
            return Binary(t.text, left, self.sum())
        if self.keyword("IS"):
            negated = self.keyword("NOT")
            self.expect("keyword", "NULL", "NULL")
            return IsNull(left, negated)
        negated = self.keyword("NOT")
        if self.keyword("BETWEEN"):
            low = self.sum()
            self.expect("keyword", "AND", "AND of BETWEEN")
            return Between(left, low, self.sum(), negated)
        if self.keyword("IN"):
            self.expect("op", "(", "'(' after IN")
            values = [self.literal("a literal in the IN list")]
            while self.accept("op", ","):
                values.append(self.literal("a literal in the IN list"))
            self.expect("op", ")", "',' or ')' in the IN list")
            return In(left, tuple(values), negated)
        if self.keyword("LIKE"):
            pattern = self.string("a string pattern after LIKE")
            escape = None
            if self.keyword("ESCAPE"):
                at = self.tok
                escape = self.string("a one-character string after ESCAPE")
                if len(escape) != 1:
                    raise self.fail("a one-character string after ESCAPE", at)
            return Like(left, pattern, escape, negated)
        if negated:
            raise self.fail("BETWEEN, IN or LIKE after NOT")
        return left

    def sum(self) -> Node:
        node = self.product()
        while self.tok.kind == "op" and self.tok.text in ("+", "-"):
            op = self.tok.text
            self.i += 1
            node = Binary(op, node, self.product())
        return node

    def product(self) -> Node:
        node = self.unary()
        while self.tok.kind == "op" and self.tok.text in ("*", "/"):
            op = self.tok.text
            self.i += 1
            node = Binary(op, node, self.unary())
        return node

    def unary(self) -> Node:
        t = self.tok
        if t.kind == "op" and t.text in ("+", "-"):
            self.i += 1
            operand = self.unary()
            if t.text == "-" and isinstance(operand, Literal) and isinstance(operand.value, float):
                return Literal(-operand.value)
            return Unary(t.text, operand)
        return self.primary()

    def primary(self) -> Node:
        t = self.tok
        if self.accept("op", "("):
            node = self.or_expr()
            self.expect("op", ")", "')'")
            return node
        if t.kind == "ident":
            self.i += 1
            return Ident(t.text)
        if t.kind == "keyword" and t.text not in ("TRUE", "FALSE"):
            raise self.fail(f"an expression (the keyword {t.text} cannot start one)")
        return self.literal("an expression")

    def literal(self, expected: str) -> Literal:
        t = self.tok
        sign = 1.0
        if t.kind == "op" and t.text in ("+", "-") and self.tokens[self.i + 1].kind == "number":
            sign = -1.0 if t.text == "-" else 1.0
            self.i += 1
            t = self.tok
        if t.kind == "string":
            self.i += 1
            return Literal(t.text[1:-1].replace("''", "'"))
        if t.kind == "number":
            self.i += 1
            return Literal(sign * float(t.text.rstrip("lLfFdD")))
        if t.kind == "keyword" and t.text in ("TRUE", "FALSE"):
            self.i += 1
            return Literal(t.text == "TRUE")
        raise self.fail(expected)

    def string(self, expected: str) -> str:
        t = self.accept("string")
        if t is None:
            raise self.fail(expected)
        return t.text[1:-1].replace("''", "'")


def parse(text: str) -> Node:
    """Parse a selector into its tree; raises ``SelectorError`` (position, expectation)."""
    if not isinstance(text, str):
        raise TypeError(f"a selector is a str, not {type(text).__name__}")
    if len(text) > MAX_SELECTOR_LENGTH:
        raise SelectorError(f"selector is {len(text)} characters; at most {MAX_SELECTOR_LENGTH}")
    if not text.strip():
        raise SelectorError("selector is empty; pass None to receive every message")
    return _Parser(text).selector()
