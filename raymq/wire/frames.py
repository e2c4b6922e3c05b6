"""The wire's frame codec: a length, a msgpack header, then raw buffers (docs/WIRE.md).

A frame is ``u32 big-endian n | n bytes of msgpack | raw buffers``. The header is
always a list of four: ``[id, a, b, sizes]`` (a request: ``[id, op, args, sizes]``; an
answer: ``[id, error, value, sizes]``), where ``sizes`` lists the byte lengths of the
raw buffers that follow the header, in order. Raw buffers carry bulk bytes (a batch's
bodies, an Arrow IPC stream, a replica's records) without msgpack copying them.

``FrameDecoder`` is fed by an ``asyncio.BufferedProtocol`` (the server's connections
and the client's): small frames are parsed in place from one receive buffer, many per
system call; a frame whose raw buffers are large is received straight into a buffer of
its exact size (no copy between the socket and its user, as a replica's commits need).
It never imports asyncio's transports: tests feed it bytes (``feed``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

LENGTH = struct.Struct(">I")
#: Longest header a peer may send before it showed the secret (bytes).
HELLO_LIMIT = 1024
#: Bytes of one receive (the in-place buffer grows for a longer header).
RECEIVE_BYTES = 256 * 1024
#: A frame's raw buffers up to this many bytes in all are copied out of the receive
#: buffer; longer ones are received into a buffer of their own (bytes).
COPY_BYTES = 64 * 1024

Buffer = bytes | bytearray | memoryview
#: ``on_frame(header, buffers)``: one whole frame, header checked for shape.
OnFrame = Callable[[list, list[Any]], None]


class FrameError(ValueError):
    """A peer sent bytes that are not a frame of this wire (the connection is dropped)."""


def header_bytes(header: list) -> bytes:
    """``header`` as a frame's first part: its length, then msgpack."""
    payload = msgpack.packb(header, use_bin_type=True)
    return LENGTH.pack(len(payload)) + payload


def encode(header_start: list, buffers: Sequence[Buffer] = ()) -> list[Buffer]:
    """One frame's parts: ``header_start`` (``[id, a, b]``) completed with the raw
    buffers' sizes, then the buffers themselves (not copied)."""
    views = [memoryview(b).cast("B") for b in buffers] if buffers else []
    sizes = [v.nbytes for v in views]
    return [header_bytes([*header_start, sizes]), *views]


def buffer_sizes(header: list) -> int:
    """Total bytes of the raw buffers ``header`` announces; ``FrameError`` if it is
    not a well-formed header (a list of four, an integer id, a list of sizes)."""
    if type(header) is not list or len(header) != 4:
        raise FrameError(f"a frame header is a list of four, not {header!r:.80}")
    req_id, _a, _b, sizes = header
    if type(req_id) is not int or req_id < 0:
        raise FrameError(f"a frame id is an integer >= 0, not {req_id!r:.40}")
    if type(sizes) is not list:
        raise FrameError(f"a frame's sizes are a list, not {sizes!r:.40}")
    total = 0
    for n in sizes:
        if type(n) is not int or n < 0:
            raise FrameError(f"a raw buffer size is an integer >= 0, not {n!r:.40}")
        total += n
    return total


class FrameDecoder:
    """Cuts a byte stream into frames, calling ``on_frame(header, buffers)`` for each.

    Use it as an ``asyncio.BufferedProtocol``'s buffer: ``get_buffer()`` then
    ``buffer_updated(n)``. ``header_limit`` (bytes) may be changed between frames (a
    connection raises it once the peer showed its secret); ``payload_limit`` bounds a
    frame's raw buffers (bytes). A frame over a limit, or not a frame, raises
    ``FrameError``: the stream cannot be trusted after it, and the caller drops it.
    """

    def __init__(self, on_frame: OnFrame, header_limit: int, payload_limit: int):
        self._on_frame = on_frame
        self.header_limit = header_limit
        self.payload_limit = payload_limit
        self._buf = bytearray(RECEIVE_BYTES)
        self._start = 0  # first byte not yet parsed
        self._end = 0  # end of the bytes received
        # A frame whose raw buffers are received on their own: its header, sizes, and
        # the buffer being filled (``_got`` bytes so far).
        self._pending: tuple[list, list[int]] | None = None
        self._direct = memoryview(b"")
        self._got = 0

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes go."""
        if self._pending is not None:
            return self._direct[self._got :]
        if self._end == len(self._buf):
            self._make_room()
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were received into ``get_buffer()``'s view: handle each frame
        completed (``on_frame`` may raise; the bytes it was given are consumed)."""
        if self._pending is not None:
            self._got += nbytes
            if self._got < self._direct.nbytes:
                return
            self._finish_direct()
        else:
            self._end += nbytes
        self._parse()

    def feed(self, data: Buffer) -> None:
        """Decode ``data`` (tests, and peers that hand over bytes rather than fill
        ``get_buffer``)."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            target = self.get_buffer()
            n = min(target.nbytes, view.nbytes)
            target[:n] = view[:n]
            target.release()
            view = view[n:]
            self.buffer_updated(n)

    def _make_room(self) -> None:
        """Move the unparsed bytes to the front of the receive buffer; grow it if one
        unfinished frame fills it (its header and raw buffers are bounded by the
        limits, checked in ``_parse`` before it waits for them)."""
        start, end = self._start, self._end
        kept = end - start
        if start:
            self._buf[:kept] = self._buf[start:end]
            self._start, self._end = 0, kept
        if self._end == len(self._buf):
            self._buf.extend(bytes(len(self._buf)))

    def _parse(self) -> None:
        buf = self._buf
        while self._pending is None:
            start, end = self._start, self._end
            if end - start < LENGTH.size:
                break
            (n,) = LENGTH.unpack_from(buf, start)
            if n > self.header_limit:
                raise FrameError(
                    f"a frame header of {n} bytes, over the {self.header_limit} allowed"
                )
            body = start + LENGTH.size
            if end - body < n:
                break
            try:
                with memoryview(buf) as view:
                    header = msgpack.unpackb(view[body : body + n], raw=False)
            except (ValueError, msgpack.UnpackException) as exc:
                raise FrameError(f"a frame header that is not msgpack: {exc!r}") from exc
            total = buffer_sizes(header)
            if total > self.payload_limit:
                raise FrameError(
                    f"raw buffers of {total} bytes, over the {self.payload_limit} allowed"
                )
            pos = body + n
            sizes = header[3]
            if not total:  # no bytes, but as many (empty) buffers as announced
                self._start = pos
                self._on_frame(header, [b""] * len(sizes))
                continue
            if total <= COPY_BYTES and end - pos >= total:
                buffers = []
                for size in sizes:
                    buffers.append(bytes(buf[pos : pos + size]))
                    pos += size
                self._start = pos
                self._on_frame(header, buffers)
                continue
            if total <= COPY_BYTES:
                break  # wait for the rest in place
            # Large: into a buffer of its own, starting with what arrived already.
            have = min(end - pos, total)
            # Not zeroed (a bytearray's would cost ~40 µs a MiB): every byte is received.
            self._direct = memoryview(np.empty(total, dtype=np.uint8))
            self._direct[:have] = buf[pos : pos + have]
            self._got = have
            self._start = pos + have
            self._pending = (header, sizes)
            if have == total:
                self._finish_direct()
        if self._start == self._end:
            self._start = self._end = 0
            if len(buf) > RECEIVE_BYTES:  # grown for one long header: not kept for ever
                self._buf = bytearray(RECEIVE_BYTES)

    def _finish_direct(self) -> None:
        header, sizes = self._pending  # type: ignore[misc]
        view, self._direct, self._pending = self._direct, memoryview(b""), None
        buffers, pos = [], 0
        for size in sizes:
            buffers.append(view[pos : pos + size])
            pos += size
        self._on_frame(header, buffers)
