"""Every rank's HTTP server for replicas that (re)join: the small state and the snapshot.

Every rank runs a small HTTP server (one daemon thread, owned and stopped by the trainer).
While the coordinator names this replica a source, it serves

    GET /small/<round>                 the state that is not tensors of the model or the
                                       optimizer (step, scaler, sampler, scheduler, RNG, the
                                       optimizer's hyperparameters), wire.py-encoded, for a
                                       joiner to train in step at once (ft/catchup.py)
    GET /snapshot                      the manifest of the kept snapshot (ft/transfer.py)
    GET /snapshot/<step>/chunk/<i>     one chunk of it
    GET /healthz                       "ok", from any incarnation: a peer's pre-flight link
                                       check (transom/check/link.py) times it

Only the newest of each is kept, so memory is bounded by one copy of the rank's state.
`bytes_per_s` caps what the server sends in all (the recovery traffic must not starve the
training traffic on a shared link); 0 means no cap.

Requests carry the job's bearer token: the state is the model, and the model is the
customer's property. An incarnation that is no longer the replica's current one serves
nothing (409): `refusal()` (ft/fencing.py) says why not, or None while it may serve. The
server holds at most `max_connections` connections at once (one thread each) and drops a
connection that sends or takes nothing for `idle_timeout_s`, so idle or half-open
connections cannot pile up threads; anything malformed gets a 4xx.
"""

from __future__ import annotations

import hmac
import logging
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from transom.background import yield_cpu
from transom.ft import wire
from transom.ft.transfer import Published, http_get

log = logging.getLogger("transom.ft")
_SMALL_PATH = re.compile(r"^/small/(\d{1,18})$")
_CHUNK_PATH = re.compile(r"^/snapshot/(\d{1,18})/chunk/(\d{1,9})$")
_TEXT, _BYTES = "text/plain", "application/octet-stream"
SHUTDOWN_POLL_S = 0.05  # how soon the server's loop sees close(): a replica's exit waits for it


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, but at most `max_connections` of them; more are closed at once."""

    daemon_threads = True
    request_queue_size = 128  # connections wait in the kernel, not in a thread of ours

    def __init__(self, address, handler, max_connections: int):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: a real joiner retries
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):  # a client that went away: not our error
        log.debug("state server: connection from %s ended badly", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    """HTTP around `StateServer.answer`; `state_server` and `timeout` (per socket read or
    write: a stalled peer is dropped) are set per server."""

    state_server: StateServer
    # Keep-alive: a joiner's fetch worker takes chunk after chunk over one connection
    # (ft/transfer.py's _Link), so this thread and its TCP window serve them all. Every
    # answer has a Content-Length; `timeout` closes a connection idle between requests too.
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: the transfer is logged by its ends
        pass

    def do_GET(self):
        if not self.state_server.authorized(self.headers.get("Authorization", "")):
            return self._reply(401, [b"missing or wrong bearer token"], _TEXT)
        self._reply(*self.state_server.answer(self.path))

    def _reply(self, code: int, pieces: list, ctype: str):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(sum(len(p) for p in pieces)))
        self.end_headers()
        for p in pieces:
            self.wfile.write(p)


class _Throttle:
    """A shared budget of bytes per second for everything the server sends (0: none)."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:  # n bytes go out once the budget has paid for them
            now = time.monotonic()
            self._next = max(now, self._next) + n / self.rate
            wait = self._next - now
        time.sleep(wait)


class StateServer:
    def __init__(self, token: str, bind_host: str = "127.0.0.1", advertise_host: str = "127.0.0.1",
                 max_connections: int = 32, idle_timeout_s: float = 10.0, bytes_per_s: float = 0,
                 on_chunk: Callable[[int], None] | None = None, refusal: Callable[[], str | None] | None = None):
        """`on_chunk(n)` runs when the n-th chunk is asked for, before it is sent (fault injection);
        `refusal()`, before anything is served: why this incarnation may not serve, or None."""
        self._token = token.encode()
        self._refusal = refusal
        self._on_chunk = on_chunk
        self._chunks_asked = 0
        self._lock = threading.Lock()
        self._small: tuple[int, bytes] | None = None
        self._snapshot: Published | None = None
        self._throttle = _Throttle(bytes_per_s)
        # One handler class per server: the socket timeout is a class attribute of the handler.
        handler = type("Handler", (_Handler,), {"timeout": idle_timeout_s, "state_server": self})
        self._httpd = _BoundedServer((bind_host, 0), handler, max_connections)
        self.url = f"http://{advertise_host}:{self._httpd.server_address[1]}"
        # serve_forever looks for a shutdown between waits for a request: close() waits out one.
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(SHUTDOWN_POLL_S,),
                                        name="transom-state-server", daemon=True)
        self._thread.start()

    def authorized(self, header: str) -> bool:
        presented = header.partition(" ")[2].encode("utf-8", "surrogateescape")
        return hmac.compare_digest(presented, self._token)

    def answer(self, path: str) -> tuple[int, list, str]:
        """(status, body pieces, content type) for a GET of `path` by an authorized peer."""
        if path == "/healthz":  # answers whether this incarnation may serve or not: it is the link's probe
            return 200, [b"ok"], _TEXT
        if self._refusal is not None and (why := self._refusal()) is not None:
            return 409, [why.encode()], _TEXT
        with self._lock:
            small, snapshot = self._small, self._snapshot
        if (m := _SMALL_PATH.match(path)) is not None:
            if small is None or small[0] != int(m.group(1)):
                return 404, [b"no state for this round (yet)"], _TEXT
            return 200, [memoryview(small[1])], _BYTES
        if path == "/snapshot":
            if snapshot is None:
                return 404, [b"no snapshot kept"], _TEXT
            return 200, [memoryview(snapshot.manifest_json)], "application/json"
        if (m := _CHUNK_PATH.match(path)) is not None:
            step, i = int(m.group(1)), int(m.group(2))
            if snapshot is None or snapshot.manifest.step != step:
                return 404, [b"that snapshot is no longer kept"], _TEXT
            if i >= len(snapshot.manifest.digests):
                return 400, [b"no such chunk"], _TEXT
            yield_cpu()  # this connection's thread serves chunks: training first
            self._chunk_asked()
            pieces = snapshot.chunk(i)
            self._throttle.take(sum(len(p) for p in pieces))
            return 200, pieces, _BYTES
        return 400, [b"expected GET /small/<round>, /snapshot, /snapshot/<step>/chunk/<i> or /healthz"], _TEXT

    def _chunk_asked(self) -> None:
        with self._lock:
            self._chunks_asked += 1
            n = self._chunks_asked
        if self._on_chunk is not None:
            self._on_chunk(n)

    def publish_small(self, round_id: int, payload: bytes) -> None:
        with self._lock:
            self._small = (round_id, payload)

    def publish_snapshot(self, snapshot: Published | None) -> None:
        """Serve `snapshot` from now on (None: serve none); the previous one is dropped."""
        with self._lock:
            self._snapshot = snapshot

    @property
    def snapshot_step(self) -> int | None:
        with self._lock:
            return None if self._snapshot is None else self._snapshot.manifest.step

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def fetch_small(endpoint: str, round_id: int, token: str, timeout_s: float, wait_s: float = 5.0) -> bytes:
    """GET a source's small state for `round_id`.

    The source publishes it before it enters the round's all-reduce, and the joiner asks
    only after that all-reduce succeeded, so it is normally there at once: a missing state
    or an unreachable source is retried only for `wait_s` (a source that died must not keep
    the joiner, and so the next round, waiting).
    """
    deadline = time.monotonic() + min(wait_s, timeout_s)
    last_error = "no attempt"
    while True:
        try:
            status, body = http_get(endpoint, f"/small/{round_id}", token, timeout_s)
            if status == 200:
                return body
            last_error = f"{status} {body[:200].decode(errors='replace')}"
            if status != 404:
                break
        except OSError as e:
            last_error = str(e)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    raise TimeoutError(f"could not fetch the state of round {round_id} from {endpoint}: {last_error}")


def take_small(endpoint: str, round_id: int, token: str, timeout_s: float) -> tuple[dict | None, str | None]:
    """(the small state of `round_id` from a source, None) or (None, why not). The peer's
    bytes are data: decoded by ft/wire.py, never unpickled."""
    try:
        small = wire.decode(fetch_small(endpoint, round_id, token, timeout_s))
    except Exception as e:
        return None, f"taking the state of round {round_id} from a source: {e}"
    if not isinstance(small, dict) or not isinstance(small.get("param_groups"), list):
        return None, f"taking the state of round {round_id} from a source: its answer is not a small state"
    return small, None
