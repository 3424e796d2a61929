"""One small HTTP GET with a deadline, timed: the link check's probe of a peer and the node
check's clock reading from the coordinator. The body is read up to MAX_BODY bytes and never
interpreted beyond its status."""

from __future__ import annotations

import http.client
import time
import urllib.parse
from dataclasses import dataclass

MAX_BODY = 4096


@dataclass(frozen=True)
class Answer:
    status: int
    date: str | None  # the Date header, if any
    sent: float  # time.time() just before the request was sent
    received: float  # time.time() once the answer's body arrived

    @property
    def rtt_s(self) -> float:
        return self.received - self.sent


def get(base_url: str, path: str, token: str | None, timeout_s: float) -> Answer:
    """GET `path` under `base_url` (http or https), with a bearer `token` if given; OSError
    (or http.client's errors) when it cannot be reached within `timeout_s`."""
    url = urllib.parse.urlsplit(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"{base_url!r} is not an http(s) URL")
    kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = kind(url.hostname, url.port, timeout=max(0.001, timeout_s))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        sent = time.time()
        conn.request("GET", url.path.rstrip("/") + path, headers=headers)
        response = conn.getresponse()
        response.read(MAX_BODY)
        return Answer(response.status, response.getheader("Date"), sent, time.time())
    finally:
        conn.close()
