"""The engine server's wire (docs/security.md): authenticated, pickle-free messages over a
unix or TCP socket, with a time limit on every wait.

A connection starts with a mutual challenge: the server sends a random nonce, the client
answers with its own nonce and an HMAC-SHA256 of both under the run's key (the `.key` file),
and the server proves the key back. Only then does either side read a message.

A message is `MAGIC, u32 header length, JSON header, frames`: the header is
`{"m": value, "f": [frame lengths]}`, where a value is a str, number, bool, None, list or
dict with str keys, and `{"$b": i}` stands for the bytes of frame i (tuples travel as lists).
Tensors and arrays go as bytes with their dtype and shape beside them
(`eagleflow.extract.stream.to_wire`). Nothing received is ever executed: a message that does
not parse is a `WireError` for that connection alone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import numbers
import secrets
import socket
import ssl
import struct
import time

MAGIC = b"EFW1"  # every message
HELLO = b"EFA1"  # the server's challenge
NONCE = 32
HANDSHAKE_TIMEOUT_S = 10.0  # a client that does not prove the key in time is dropped
CONNECT_TIMEOUT_S = 30.0
# Once a message has begun, each further read must make progress within this long.
PROGRESS_TIMEOUT_S = 120.0
MAX_HEADER = 64 << 20  # bytes of JSON: token ids of a request, figures of an answer
MAX_FRAME = 1 << 40  # one pack's states; a bound, not a budget


class WireError(ConnectionError):
    """A connection that broke the protocol: a failed handshake, a message that does not
    parse, or a peer silent past its limit. It ends that connection, nothing else."""


class AuthenticationFailed(WireError):
    pass


def _encode(value, frames: list):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Integral):  # numpy's scalars
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        frames.append(memoryview(value).cast("B"))
        return {"$b": len(frames) - 1}
    if isinstance(value, (list, tuple)):
        return [_encode(v, frames) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or k.startswith("$"):
                raise TypeError(f"the wire takes dict keys that are str without '$', not {k!r}")
            out[k] = _encode(v, frames)
        return out
    raise TypeError(f"the wire takes str, numbers, lists, dicts and bytes, not {type(value)}")


def encode(value) -> list:
    """The buffers of one message: its header, then its frames."""
    frames: list = []
    header = json.dumps({"m": _encode(value, frames), "f": [f.nbytes for f in frames]}).encode()
    return [MAGIC + struct.pack("<I", len(header)) + header, *frames]


def decode(header: bytes, frames: list):
    """The value of a message whose header and frames were read; WireError if it is not one."""

    def bytes_of(d: dict):
        if "$b" in d:
            i = d["$b"]
            if len(d) != 1 or type(i) is not int or not 0 <= i < len(frames):
                raise WireError(f"a bytes reference {d!r} that names no frame")
            return frames[i]
        if any(k.startswith("$") for k in d):
            raise WireError("a dict key beginning with '$'")
        return d

    try:
        return json.loads(header, object_hook=bytes_of)["m"]
    except WireError:
        raise
    except (ValueError, RecursionError, KeyError, TypeError) as e:
        raise WireError(f"a message that does not parse ({type(e).__name__})") from None


class PeerSilent(WireError):
    """The peer sent nothing for the time allowed (a stalled client, a lost host)."""


CHUNK = 1 << 24  # bytes per socket call: each must make progress within its limit


class Connection:
    """One end of an authenticated connection (`accept`, `connect`). Every read and write
    has a time limit (the socket's timeout, set per call): nothing waits forever unless asked
    to with `timeout=None`."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def _read(self, n: int, timeout: float | None, deadline: float | None = None) -> bytearray:
        """`n` bytes, each socket read within `timeout` s, all by `deadline`
        (time.monotonic) when one is given; PeerSilent, or EOFError when the peer closed."""
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            wait = timeout
            if deadline is not None:
                wait = max(0.001, min(wait, deadline - time.monotonic()))
            self.sock.settimeout(wait)
            try:
                k = self.sock.recv_into(view[got:], min(n - got, CHUNK))
            except TimeoutError:
                raise PeerSilent(f"the peer sent nothing for {wait:g} s") from None
            if k == 0:
                raise EOFError("the peer closed the connection")
            got += k
        return buf

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.sock.settimeout(PROGRESS_TIMEOUT_S)
        for i in range(0, len(view), CHUNK):
            try:
                self.sock.sendall(view[i : i + CHUNK])
            except TimeoutError:
                raise PeerSilent(f"the peer took nothing for {PROGRESS_TIMEOUT_S:g} s") from None

    def send(self, value) -> None:
        for buf in encode(value):
            self._write(buf)

    def recv(self, timeout: float | None = None):
        """The next message; `timeout`: how long to wait for it to begin (None: forever).
        PeerSilent past it; WireError for anything that is not a message."""
        head = self._read(1, timeout) + self._read(7, PROGRESS_TIMEOUT_S)
        if head[:4] != MAGIC:
            raise WireError("a message without the eagleflow wire's magic bytes")
        (n,) = struct.unpack("<I", head[4:])
        if n > MAX_HEADER:
            raise WireError(f"a message header of {n} bytes (at most {MAX_HEADER})")
        header = bytes(self._read(n, PROGRESS_TIMEOUT_S))
        try:
            lengths = json.loads(header)["f"]
            ok = isinstance(lengths, list) and all(
                type(x) is int and 0 <= x <= MAX_FRAME for x in lengths
            )
        except (ValueError, RecursionError, KeyError, TypeError):
            ok = False
        if not ok:
            raise WireError("a message whose header does not parse")
        frames = [self._read(x, PROGRESS_TIMEOUT_S) for x in lengths]  # bytearrays: no copy
        return decode(header, frames)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive: a peer whose host is gone is noticed in about two minutes."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def accept(
    listener: socket.socket,
    key: bytes,
    timeout: float = HANDSHAKE_TIMEOUT_S,
    tls: ssl.SSLContext | None = None,
) -> Connection:
    """The next client that proves the key within `timeout` seconds. Raises WireError (or
    OSError, EOFError) for one that does not: the caller drops it and accepts the next."""
    sock, _ = listener.accept()
    deadline = time.monotonic() + timeout
    try:
        keepalive(sock)
        sock.settimeout(timeout)
        if tls is not None:  # its handshake within the same limit
            sock = tls.wrap_socket(sock, server_side=True)
        conn = Connection(sock)
        ns = secrets.token_bytes(NONCE)
        sock.sendall(HELLO + ns)
        answer = conn._read(2 * NONCE, timeout, deadline)
        nc, mac = bytes(answer[:NONCE]), bytes(answer[NONCE:])
        if not hmac.compare_digest(mac, _mac(key, b"client", ns, nc)):
            raise AuthenticationFailed("a client that does not hold the key")
        sock.sendall(_mac(key, b"server", nc, ns))
        return conn
    except BaseException:
        sock.close()
        raise


def connect(
    address, family: int, key: bytes, ready_timeout: float, tls: ssl.SSLContext | None = None
) -> Connection:
    """A connection to the server at `address` that has proven it holds `key`. The server's
    challenge comes when it accepts, after its engine has loaded: it is waited for up to
    `ready_timeout` seconds."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(address)
        keepalive(sock)
        if tls is not None:  # the server's TLS handshake comes when it accepts
            sock.settimeout(ready_timeout)
            sock = tls.wrap_socket(sock)
        conn = Connection(sock)
        try:
            hello = conn._read(1, ready_timeout)
        except PeerSilent:
            raise PeerSilent(f"the server did not accept within {ready_timeout:g} s") from None
        hello += conn._read(len(HELLO) + NONCE - 1, HANDSHAKE_TIMEOUT_S)
        if hello[: len(HELLO)] != HELLO:
            raise WireError("a server that does not speak the eagleflow wire")
        ns, nc = bytes(hello[len(HELLO) :]), secrets.token_bytes(NONCE)
        conn._write(nc + _mac(key, b"client", ns, nc))
        try:
            proof = bytes(conn._read(NONCE, HANDSHAKE_TIMEOUT_S))
        except EOFError:
            raise AuthenticationFailed("the server refused this client's key") from None
        if not hmac.compare_digest(proof, _mac(key, b"server", nc, ns)):
            raise AuthenticationFailed("a server that does not hold the key")
        return conn
    except BaseException:
        sock.close()
        raise


def listen(address, family: int, backlog: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        return sock
    except BaseException:
        sock.close()
        raise
