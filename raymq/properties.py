"""Validation and msgpack encoding of message properties.

Properties are a flat dict of str keys to str, int, float, bool or None values, the
types a JMS selector can compare. Each message's properties are stored as one msgpack
map (an empty byte string when there are none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from raymq.errors import InvalidProperties

PropertyValue = str | int | float | bool | None
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_ALLOWED = (str, int, float, bool, type(None))


def validate_properties(props: object, *, where: str = "message") -> dict[str, PropertyValue]:
    """Return ``props`` as a dict after checking keys and value types.

    ``where`` names the message (e.g. ``"message 3 for queue 'orders'"``) in the error.
    Raises ``InvalidProperties`` for a non-mapping, a non-str or empty key, a value of
    another type, or an int outside the signed 64-bit range.
    """
    if props is None:
        return {}
    if not isinstance(props, Mapping):
        raise InvalidProperties(f"properties of {where} must be a dict, not {type(props).__name__}")
    for key, value in props.items():
        if not isinstance(key, str) or not key:
            raise InvalidProperties(f"property key {key!r} of {where} must be a non-empty str")
        if not isinstance(value, _ALLOWED):
            raise InvalidProperties(
                f"property {key!r} of {where} has type {type(value).__name__};"
                " allowed: str, int, float, bool, None"
            )
        if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
            raise InvalidProperties(f"property {key!r} of {where} is outside int64: {value}")
    return dict(props)


_packer = msgpack.Packer(use_bin_type=True)


def encode_properties(props: Mapping[str, PropertyValue]) -> bytes:
    """Encode validated properties as one msgpack map; ``b""`` when empty."""
    return _packer.pack(props) if props else b""


def check_encoded_properties(data: bytes, *, where: str = "message") -> None:
    """Raise ``InvalidProperties`` unless ``data`` is what ``encode_properties`` writes
    for valid properties: empty, or one msgpack map of str keys to allowed values with
    nothing after it. What a queue stores must decode for every reader and selector."""
    if not data:
        return
    try:
        props = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        raise InvalidProperties(f"properties of {where} are not one msgpack map") from None
    if not isinstance(props, dict) or not props:
        raise InvalidProperties(f"properties of {where} are not a non-empty msgpack map")
    validate_properties(props, where=where)


def decode_properties(data: bytes | memoryview) -> dict[str, Any]:
    """Decode what ``encode_properties`` wrote."""
    return msgpack.unpackb(data, raw=False) if len(data) else {}


def count_property(blob: bytes, name: str, key_bytes: bytes) -> int | None:
    """Property ``name`` (whose msgpack encoding is ``key_bytes``) of one message's
    encoded properties as an int from 0 to 2**63 - 1 (a time in ms since the epoch, a
    priority), else None. Decoded only if the key's bytes are there. Properties read without their
    record's CRC may be rot: ones that do not decode, or hold no such int, give None
    (the checked read of the record quarantines it)."""
    if key_bytes not in blob:
        return None
    try:
        props = msgpack.unpackb(blob, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    value = props.get(name) if isinstance(props, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        return None
    return value


#: The property a producer's message id travels in (Artemis's name): durable with the
#: message under its record's CRC (``raymq.core.duplicate_ids``).
DUPLICATE_ID_PROPERTY = "_AMQ_DUPL_ID"
#: The property name as msgpack encodes it (a fixstr of 12 bytes): properties without
#: these bytes carry no id and are not decoded.
ID_KEY_BYTES = msgpack.packb(DUPLICATE_ID_PROPERTY)


def id_in_properties(props: bytes) -> str | None:
    """The producer id in one message's msgpack-encoded properties, if any (a
    non-empty string). Raises ``ValueError`` for bytes that are not msgpack."""
    if ID_KEY_BYTES not in props:
        return None
    mid = msgpack.unpackb(props, raw=False).get(DUPLICATE_ID_PROPERTY)
    return mid if isinstance(mid, str) and mid else None
