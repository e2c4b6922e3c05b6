"""Message selectors: JMS SQL-92 conditions compiled once, evaluated over whole batches.

``Selector(text)`` parses (raising ``raymq.errors.SelectorError`` with the position);
``Selector.match(properties, headers)`` returns a boolean mask for a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from raymq.properties import decode_properties
from raymq.selector.ast import HEADER_DELIVERY_COUNT, HEADER_OFFSET, HEADER_TIMESTAMP, HEADERS
from raymq.selector.ast import identifiers as _identifiers
from raymq.selector.evaluate import evaluate, numeric_column, selected, typed_column
from raymq.selector.parser import parse


class Selector:
    """A compiled message selector."""

    def __init__(self, text: str):
        self.text = text
        self.tree = parse(text)
        names = _identifiers(self.tree)
        self.headers = frozenset(names & HEADERS)
        self.properties = frozenset(names - HEADERS)

    def __repr__(self) -> str:
        return f"Selector({self.text!r})"

    @property
    def uses_headers(self) -> bool:
        """True when the selector reads offset, timestamp or delivery count."""
        return bool(self.headers)

    def match(
        self,
        properties: Sequence[Mapping[str, object]],
        headers: Mapping[str, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Boolean mask: which of these messages the selector selects.

        ``properties`` holds one decoded dict per message; ``headers`` maps each of
        ``self.headers`` to an array of that header per message.
        """
        n = len(properties)
        if n == 0:
            return np.zeros(0, dtype=np.bool_)
        columns = {
            name: typed_column([p.get(name) for p in properties]) for name in self.properties
        }
        for name in self.headers:
            if headers is None or name not in headers:
                raise ValueError(f"selector {self.text!r} needs header {name} per message")
            columns[name] = numeric_column(headers[name])
        return selected(evaluate(self.tree, columns), n)

    def match_encoded(
        self, blobs: Sequence[bytes], headers: Mapping[str, np.ndarray] | None = None
    ) -> np.ndarray:
        """``match`` over msgpack-encoded properties, decoding each distinct blob once."""
        distinct: dict[bytes, int] = {}
        index = np.fromiter(
            (distinct.setdefault(b, len(distinct)) for b in blobs), dtype=np.int64, count=len(blobs)
        )
        return self.match_groups(list(distinct), index, headers)

    def match_groups(
        self,
        distinct: Sequence[bytes],
        index: np.ndarray,
        headers: Mapping[str, np.ndarray] | None = None,
    ) -> np.ndarray:
        """``match`` over messages whose encoded properties are ``distinct[index[i]]``:
        a selector on properties alone is evaluated once per distinct encoding."""
        decoded = [_decoded_or_none(b) for b in distinct]
        unreadable = np.array([d is None for d in decoded], dtype=np.bool_)
        if unreadable.any():
            decoded = [{} if d is None else d for d in decoded]
        if self.uses_headers:  # headers differ per message
            mask = self.match([decoded[i] for i in index.tolist()], headers)
            return mask & ~unreadable[index] if len(index) else mask
        mask = self.match(decoded) & ~unreadable
        return mask[index] if len(index) else np.zeros(0, dtype=np.bool_)


def _decoded_or_none(blob: bytes) -> dict | None:
    """The properties map, or None if the bytes are not one: properties read for
    matching are not checksummed (delivery checks the whole record), so rot can reach
    here; such a message matches nothing, and the read that delivers it, or the scrub,
    finds the damage."""
    try:
        props = decode_properties(blob)
    except Exception:
        return None
    return props if isinstance(props, dict) else None


__all__ = [
    "HEADERS",
    "HEADER_DELIVERY_COUNT",
    "HEADER_OFFSET",
    "HEADER_TIMESTAMP",
    "Selector",
]
