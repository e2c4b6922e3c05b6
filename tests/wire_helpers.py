"""Raw wire peers for tests (docs/WIRE.md): bare sockets that speak, or abuse, the frame
format of ``raymq.wire.frames`` without the wire's client."""

from __future__ import annotations

import socket
import threading

import msgpack

from raymq.wire import frames
from raymq.wire.server import WIRE_VERSION

#: Bound on a socket read a test expects to finish, in real seconds.
READ_SECONDS = 30.0


def hello(secret: str, protocol: str, version: int = WIRE_VERSION) -> bytes:
    """The hello frame a client sends first."""
    return frames.header_bytes([0, "hello", [secret, protocol, version], []])


def request(req_id: int, op: str, args: list, buffers: list[bytes] = ()) -> bytes:
    """One request frame, raw buffers included."""
    return b"".join(bytes(p) for p in frames.encode([req_id, op, args], buffers))


def exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; ``ConnectionError`` if it ends first."""
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket) -> tuple[list, list[bytes]]:
    """One frame: its header ``[id, a, b, sizes]`` and its raw buffers."""
    n = int.from_bytes(exactly(sock, 4), "big")
    header = msgpack.unpackb(exactly(sock, n), raw=False)
    return header, [exactly(sock, size) for size in header[3]]


def read_answers(sock: socket.socket, count: int) -> dict[int, tuple]:
    """``count`` answers by request id: (error name or None, value)."""
    answers = {}
    while len(answers) < count:
        (req_id, error, value, _sizes), _buffers = read_frame(sock)
        answers[req_id] = (None if error is None else error[0], value)
    return answers


def raw_client(host: str, port: int, secret: str | None, protocol: str = "send") -> socket.socket:
    """A bare TCP socket, said hello when ``secret`` is given (as a hostile client)."""
    sock = socket.create_connection((host, port), timeout=READ_SECONDS)
    if secret is not None:
        sock.sendall(hello(secret, protocol))
        (req_id, error, caps, _sizes), _ = read_frame(sock)
        assert (req_id, error, caps["protocol"]) == (0, None, protocol)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the peer closed ``sock`` (reads what it still sends, then the end)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


class MutePeer:
    """A server that answers one client's hello and then reads and answers nothing
    (a paused or wedged process): its socket stays open."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.greeted = threading.Event()
        self._thread = threading.Thread(target=self._mute, daemon=True)
        self._thread.start()

    def _mute(self) -> None:
        conn, _ = self.listener.accept()
        self.accepted.append(conn)
        conn.settimeout(READ_SECONDS)
        n = int.from_bytes(exactly(conn, 4), "big")
        exactly(conn, n)  # the hello; nothing is read after it
        conn.sendall(b"".join(bytes(p) for p in frames.encode([0, None, {}])))
        self.greeted.set()

    def endpoint(self) -> tuple[str, int, str]:
        return "127.0.0.1", self.port, "s" * 32

    def close(self) -> None:
        self._thread.join(READ_SECONDS)
        for sock in [*self.accepted, self.listener]:
            sock.close()
