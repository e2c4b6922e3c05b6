"""Selector compiler: parsing, JMS NULL semantics, LIKE escapes, precedence, malformed
selectors, and a property test that batch evaluation equals the row-by-row oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raymq.errors import SelectorError
from raymq.properties import encode_properties
from raymq.selector import Selector
from raymq.selector.ast import Between, Binary, Ident, In, IsNull, Like, Literal, Unary
from tests.selector_reference import ref_eval

ROWS = [
    {"color": "red", "size": 5, "ok": True, "name": "a_b%c"},
    {"color": "blue", "size": 12.5, "ok": False, "name": "abc"},
    {"color": None, "size": "5", "name": "a\nb"},
    {},
]


def picks(selector: str, rows=ROWS) -> list[int]:
    return np.flatnonzero(Selector(selector).match(rows)).tolist()


@pytest.mark.parametrize(
    "selector, expected",
    [
        ("color = 'red'", [0]),
        ("color <> 'red'", [1]),  # NULL and missing are UNKNOWN, not TRUE
        ("NOT color = 'red'", [1]),
        ("color IS NULL", [2, 3]),
        ("color IS NOT NULL", [0, 1]),
        ("size > 10", [1]),
        ("size = 5", [0]),  # '5' is a string: unlike types compare FALSE
        ("NOT size = 5", [1, 2]),  # ... so NOT gives TRUE for it
        ("size BETWEEN 5 AND 12.5", [0, 1]),
        ("size NOT BETWEEN 6 AND 20", [0, 2]),  # the string is not between: TRUE
        ("color IN ('red', 'green')", [0]),
        ("color NOT IN ('red', 'green')", [1]),
        ("ok", [0]),
        ("ok = FALSE", [1]),
        ("NOT ok", [1]),
        ("ok OR color = 'red'", [0]),
        ("color = 'red' OR size > 10 AND ok", [0]),  # AND binds tighter than OR
        ("(color = 'red' OR size > 10) AND ok", [0]),
        ("size * 2 + 1 = 11", [0]),
        ("size / 0 = 1 OR size - -1 = 6", [0]),  # division by zero is NULL
        ("-size < -6", [1]),
        ("name LIKE 'a%'", [0, 1, 2]),
        ("name LIKE 'a_b'", [2]),  # _ matches a newline too
        ("name LIKE 'a\\_b\\%c' ESCAPE '\\'", [0]),
        ("name LIKE 'a!_b!%_' ESCAPE '!'", [0]),
        ("name NOT LIKE '%c'", [2]),
        ("color = 'it''s'", []),
        ("TRUE", [0, 1, 2, 3]),
        ("color = 'red' and SIZE = 5", []),  # keywords ignore case, identifiers do not
        ("JMSXDeliveryCount > 1", None),
    ],
)
def test_semantics(selector, expected):
    if expected is None:
        with pytest.raises(ValueError, match="JMSXDeliveryCount"):
            picks(selector)
        return
    assert picks(selector) == expected


def test_headers_and_literal_forms():
    s = Selector("RayMQOffset >= 2 AND JMSTimestamp < 1.5e3 AND JMSXDeliveryCount IN (1, 2)")
    headers = {
        "RayMQOffset": np.array([1, 2, 3]),
        "JMSTimestamp": np.array([1000, 1000, 2000]),
        "JMSXDeliveryCount": np.array([1, 2, 1]),
    }
    assert s.match([{}, {}, {}], headers).tolist() == [False, True, False]
    assert picks("size = 5L OR size = .5e1") == [0]


def test_match_encoded_equals_match():
    s = Selector("color = 'red' OR size > 10")
    blobs = [encode_properties({k: v for k, v in r.items() if v is not None}) for r in ROWS] * 3
    expected = s.match([r for r in ROWS] * 3)
    assert s.match_encoded(blobs).tolist() == expected.tolist()


@pytest.mark.parametrize(
    "selector, position, expected",
    [
        ("", None, "empty"),
        ("color =", 8, "expected an expression"),
        ("color = = 'x'", 9, "expected an expression"),
        ("(color = 'x'", 13, "expected ')'"),
        ("color = 'x')", 12, "an operator or the end"),
        ("color = 'x", 9, "closing quote"),
        ("color ! 'x'", 7, "a token"),
        ("color LIKE 5", 12, "string pattern after LIKE"),
        ("color LIKE 'a' ESCAPE ''", 23, "one-character string after ESCAPE"),
        ("color IN ('a',)", 15, "a literal in the IN list"),
        ("color IN 'a'", 10, "'(' after IN"),
        ("color NOT 'a'", 11, "BETWEEN, IN or LIKE after NOT"),
        ("size BETWEEN 1 OR 2", 16, "AND of BETWEEN"),
        ("color IS 'x'", 10, "NULL"),
        ("1 + size", 1, "a condition"),
        ("AND = 1", 1, "keyword AND cannot start"),
    ],
)
def test_malformed(selector, position, expected):
    with pytest.raises(SelectorError) as info:
        Selector(selector)
    assert expected in str(info.value)
    if position is not None:
        assert f"position {position}," in str(info.value)


def test_not_a_string():
    with pytest.raises(TypeError):
        Selector(3)  # type: ignore[arg-type]


# -- property test: batch evaluation == row-by-row reference ------------------------------

NAMES = ["a", "b", "c"]
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(-10, 10, allow_nan=False, width=32),
    st.sampled_from(["", "x", "xy", "a%", "_b", "ab\n"]),
)
rows = st.lists(
    st.dictionaries(st.sampled_from(NAMES), values, max_size=3), min_size=1, max_size=20
)

literal = st.one_of(
    st.booleans().map(Literal),
    st.integers(-3, 3).map(lambda i: Literal(float(i))),
    st.sampled_from(["x", "xy", ""]).map(Literal),
)
leaf = st.one_of(literal, st.sampled_from(NAMES).map(Ident))


def _extend(children):
    return st.one_of(
        st.builds(Unary, st.sampled_from(["NOT", "-"]), children),
        st.builds(
            Binary,
            st.sampled_from(["AND", "OR", "=", "<>", "<", ">=", "+", "*", "/"]),
            children,
            children,
        ),
        st.builds(Between, children, children, children, st.booleans()),
        st.builds(
            In, children, st.lists(literal, min_size=1, max_size=3).map(tuple), st.booleans()
        ),
        st.builds(
            Like,
            children,
            st.sampled_from(["x%", "_", "%b%", "a!%", "!_b"]),
            st.sampled_from([None, "!"]),
            st.booleans(),
        ),
        st.builds(IsNull, children, st.booleans()),
    )


trees = st.recursive(leaf, _extend, max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(tree=trees, batch=rows)
def test_batch_equals_reference(tree, batch):
    sel = Selector("TRUE")
    sel.tree = tree
    sel.properties = frozenset(NAMES)
    got = sel.match(batch).tolist()
    want = [ref_eval(tree, r) is True for r in batch]
    assert got == want
