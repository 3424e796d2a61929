"""The coordinator client's connections: one HTTP/1.1 keep-alive connection per thread.

A replica's leader asks the coordinator for a quorum every step, so what one request costs
is paid every step, by the worker and by the coordinator: a request leaves in one write, and
the answer is read by its Content-Length (every answer of the coordinator carries one; a
chunked one, or one that ends with the connection, is read too), with none of http.client's
two sends and header parsing (docs/benchmarks.md, "What one coordinator request costs").

A kept connection that the coordinator closed meanwhile (its idle timeout, a restart) is
seen at the next request, before any answer came: that request is sent again at once on a
new connection, without the caller's backoff. Anything else that goes wrong closes the
connection and raises OSError (ConnectionError where the bytes are no answer within our
bounds), which is the caller's to retry.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
from urllib.parse import urlsplit

MAX_LINE_BYTES = 64 * 1024  # of a status or header line
MAX_HEADERS = 100
MAX_BODY_BYTES = 256 << 20  # a job's whole status stays far below


class _Connection:
    def __init__(self, host: str, port: int, https: bool, timeout_s: float):
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if https:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        self.sock = sock
        self.reader = sock.makefile("rb")
        self.used = False  # it answered a request before: an EOF now means it went stale

    def close(self) -> None:
        self.reader.close()
        self.sock.close()

    def exchange(self, request: bytes, timeout_s: float) -> tuple[int, str, bytes, bool] | None:
        """(status, reason, body, keep the connection) of one request written whole; None if
        the connection, kept from an earlier request, was closed before it answered (stale)."""
        self.sock.settimeout(timeout_s)
        try:
            self.sock.sendall(request)
            line = self.reader.readline(MAX_LINE_BYTES)
        except (BrokenPipeError, ConnectionResetError):
            if self.used:
                return None
            raise
        if not line:
            if self.used:
                return None
            raise ConnectionResetError("the coordinator closed the connection before it answered")
        parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (parts[1].isascii() and parts[1].isdigit()):
            raise ConnectionError(f"not an HTTP/1.1 status line: {line[:100]!r}")
        status, reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
        headers = self._headers()
        keep = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = self._chunked()
        elif "content-length" in headers:
            body = self._exactly(_length(headers["content-length"]))
        elif status in (204, 304) or 100 <= status < 200:
            body = b""
        else:  # the body ends with the connection
            body, keep = self.reader.read(MAX_BODY_BYTES + 1), False
        if len(body) > MAX_BODY_BYTES:
            raise ConnectionError("an answer over its bound")
        self.used = True
        return status, reason, body, keep

    def _headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS):
            line = self.reader.readline(MAX_LINE_BYTES)
            if line in (b"\r\n", b"\n"):
                return headers
            if not line.endswith(b"\n"):
                raise ConnectionError("a header line cut short or over its bound")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        raise ConnectionError(f"more than {MAX_HEADERS} headers")

    def _exactly(self, n: int) -> bytes:
        body = self.reader.read(n)
        if len(body) < n:
            raise ConnectionError(f"the answer ended after {len(body)} of {n} bytes")
        return body

    def _chunked(self) -> bytes:
        body = bytearray()
        while True:
            size = self.reader.readline(MAX_LINE_BYTES).split(b";", 1)[0].strip()
            n = _length(size.decode("latin-1"), base=16)
            if n == 0:
                self._headers()  # the trailer, up to its empty line
                return bytes(body)
            body += self._exactly(n)
            self._exactly(2)  # the CRLF after the chunk
            if len(body) > MAX_BODY_BYTES:
                raise ConnectionError("an answer over its bound")


def _length(text: str, base: int = 10) -> int:
    try:
        n = int(text, base)
    except ValueError:
        raise ConnectionError(f"a length that is no number: {text[:40]!r}") from None
    if not 0 <= n <= MAX_BODY_BYTES:
        raise ConnectionError(f"a length out of bounds: {n}")
    return n


class KeptConnections:
    """One kept connection to `url` per thread (and process: a forked child opens its own)."""

    def __init__(self, url: str):
        split = urlsplit(url)
        self._https = split.scheme == "https"
        self._host = split.hostname or "127.0.0.1"
        self._port = split.port or (443 if self._https else 80)
        self._base = split.path.rstrip("/")
        self._host_header = split.netloc.rsplit("@", 1)[-1]
        self._local = threading.local()

    def send(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
             timeout_s: float) -> tuple[int, str, bytes]:
        """(status, reason, body) of one request; OSError if it failed (the connection is then
        closed: half a request or answer may be on the wire)."""
        if any("\r" in v or "\n" in v for v in headers.values()):
            raise ValueError("a header value with a line break")  # a token file's bytes, say
        lines = [f"{method} {self._base}{path} HTTP/1.1", f"Host: {self._host_header}",
                 *(f"{k}: {v}" for k, v in headers.items())]
        if body is not None or method in ("POST", "PUT"):
            lines.append(f"Content-Length: {len(body or b'')}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            answer = self._exchange(conn, request, timeout_s)
            if answer is not None:
                return answer
            # Closed by the coordinator while it was kept: sent again at once, on a new connection.
        conn = _Connection(self._host, self._port, self._https, timeout_s)
        self._local.conn, self._local.pid = conn, os.getpid()
        answer = self._exchange(conn, request, timeout_s)
        assert answer is not None  # a new connection is never stale
        return answer

    def _exchange(self, conn: _Connection, request: bytes, timeout_s: float) -> tuple[int, str, bytes] | None:
        try:
            answer = conn.exchange(request, timeout_s)
        except BaseException:
            self._drop(conn)
            raise
        if answer is None or not answer[3]:
            self._drop(conn)
        return answer[:3] if answer is not None else None

    def _drop(self, conn: _Connection) -> None:
        self._local.conn = None
        conn.close()
