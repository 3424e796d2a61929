"""Peer-to-peer state transfer for a replica that (re)joins: serve and fetch.

Every rank runs a small HTTP server (one daemon thread, owned and stopped by the Manager).
When the coordinator names this replica as a recovery source for a round, the rank
encodes its committed state into memory *before* its next optimizer step (wire.py: tensors
and JSON, nothing a receiver would execute) and publishes it under that round; the
recovering rank of the same shard index fetches it. Only the newest snapshot is kept, so
memory is bounded by one copy of the rank's state.

Requests carry the job's bearer token: the state is the model, and the model is the
customer's property. The server holds at most `max_connections` connections at once (one
thread each) and drops a connection that sends or takes nothing for `idle_timeout_s`, so
idle or half-open connections cannot pile up threads; anything malformed gets a 4xx.
"""

from __future__ import annotations

import hmac
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("transom.ft")
_STATE_PATH = re.compile(r"^/state/(\d{1,18})$")


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


class StateServer:
    def __init__(self, token: str, bind_host: str = "127.0.0.1", advertise_host: str = "127.0.0.1",
                 max_connections: int = 32, idle_timeout_s: float = 10.0):
        self._token = token.encode()
        self._lock = threading.Lock()
        self._round: int | None = None
        self._payload: bytes = b""
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_timeout_s  # per socket read or write: a stalled peer is dropped

            def log_message(self, fmt, *args):  # quiet: one line per transfer is logged below
                pass

            def do_GET(self):
                header = self.headers.get("Authorization", "")
                presented = header.partition(" ")[2].encode("utf-8", "surrogateescape")
                if not hmac.compare_digest(presented, server._token):
                    return self._reply(401, b"missing or wrong bearer token")
                match = _STATE_PATH.match(self.path)
                if match is None:
                    return self._reply(400, b"expected GET /state/<round>")
                with server._lock:
                    ready = server._round == int(match.group(1))
                    payload = server._payload
                if not ready:
                    return self._reply(404, b"no snapshot for this round (yet)")
                self._reply(200, payload, "application/octet-stream")

            def _reply(self, code: int, body: bytes, ctype: str = "text/plain"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._httpd = _BoundedServer((bind_host, 0), Handler, max_connections)
        self.url = f"http://{advertise_host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="transom-state-server", daemon=True)
        self._thread.start()

    def publish(self, round_id: int, payload: bytes) -> None:
        with self._lock:
            self._round, self._payload = round_id, payload

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def fetch_state(endpoint: str, round_id: int, token: str, timeout_s: float, wait_s: float = 5.0) -> bytes:
    """GET a peer's snapshot for `round_id`; the transfer may take up to timeout_s.

    The source publishes before it enters the round's all-reduce, and the joiner fetches
    only after that all-reduce succeeded, so the snapshot is normally there at once: a
    missing snapshot or an unreachable source is retried only for `wait_s` (a source that
    died must not keep the joiner, and so the next round, waiting for minutes).
    """
    deadline = time.monotonic() + min(wait_s, timeout_s)
    last_error = "no attempt"
    while True:
        req = urllib.request.Request(f"{endpoint}/state/{round_id}")
        req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            last_error = f"{e.code} {e.read()[:200].decode(errors='replace')}"
            if e.code != 404:
                break
        except (urllib.error.URLError, OSError) as e:
            last_error = str(e)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    raise TimeoutError(f"could not fetch state of round {round_id} from {endpoint}: {last_error}")
