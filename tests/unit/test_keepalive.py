"""The coordinator client's kept connections (coordinator/keepalive.py) against a scripted
server on loopback: each accepted connection answers its requests with the given bytes, in
order, then closes; what the client sent is kept."""

from __future__ import annotations

import socket
import threading

import pytest

from transom.coordinator.keepalive import KeptConnections

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Scripted:
    def __init__(self, *connections: list[bytes]):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[bytes] = []  # per request: what arrived
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, args=(list(connections),), daemon=True)
        self._thread.start()

    def _serve(self, connections: list[list[bytes]]) -> None:
        for answers in connections:
            conn, _ = self.sock.accept()
            self.accepted += 1
            with conn:
                for answer in answers:
                    self.requests.append(self._request(conn))
                    conn.sendall(answer)

    @staticmethod
    def _request(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return data


def test_requests_share_one_connection_and_leave_in_one_write():
    server = Scripted([OK, OK])
    conns = KeptConnections(server.url + "/")
    for _ in range(2):
        assert conns.send("POST", "/v1/quorum", b'{"a": 1}', {"Authorization": "Bearer t"}, 5.0) == (200, "OK", b"{}")
    assert server.accepted == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/quorum HTTP/1.1\r\n") and b"Content-Length: 8" in head and body == b'{"a": 1}'


def test_a_connection_the_server_closed_while_kept_is_replaced_at_once():
    server = Scripted([OK], [OK])  # the first connection closes after one answer
    conns = KeptConnections(server.url)
    assert conns.send("GET", "/v1/progress", None, {}, 5.0)[0] == 200
    assert conns.send("GET", "/v1/progress", None, {}, 5.0)[0] == 200
    assert server.accepted == 2


@pytest.mark.parametrize("answer, body", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n", b"abcde"),
    (b"HTTP/1.1 409 Conflict\r\nContent-Length: 3\r\nConnection: close\r\n\r\nold", b"old"),
    (b"HTTP/1.0 200 OK\r\n\r\nuntil the end", b"until the end"),
])
def test_answers_are_read_by_their_framing(answer, body):
    server = Scripted([answer], [OK])
    conns = KeptConnections(server.url)
    assert conns.send("GET", "/x", None, {}, 5.0)[2] == body
    assert conns.send("GET", "/x", None, {}, 5.0)[2] == b"{}"  # a new connection: the last one ended
    assert server.accepted == 2


@pytest.mark.parametrize("answer", [
    b"SMTP ready\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n",
])
def test_what_is_no_answer_is_an_oserror_and_the_connection_is_dropped(answer):
    server = Scripted([answer], [OK])
    conns = KeptConnections(server.url)
    with pytest.raises(OSError):
        conns.send("GET", "/x", None, {}, 5.0)
    assert conns.send("GET", "/x", None, {}, 5.0)[0] == 200


def test_a_header_value_with_a_line_break_is_refused():
    conns = KeptConnections("http://127.0.0.1:9")
    with pytest.raises(ValueError):
        conns.send("GET", "/x", None, {"Authorization": "Bearer a\r\nX-Evil: 1"}, 1.0)
