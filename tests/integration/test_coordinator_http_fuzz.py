"""A seeded fuzz loop over every write endpoint of the coordinator, over real HTTP (a
`CoordinatorThread` on loopback): bodies mutated from valid ones, truncated, out of range,
NaN and Infinity, never answered with a 5xx, and the server keeps serving."""

from __future__ import annotations

import collections
import http.client
import json
import random

import requests

from test_coordinator_http import (  # noqa: F401  (start_coordinator is a fixture)
    AUTH,
    HTTP_TIMEOUT,
    VALID_REGISTER,
    client,
    reg_req,
    start_coordinator,
)

TEMPLATES = {
    "/v1/register": VALID_REGISTER,
    "/v1/heartbeat": {"identity": {"replica_id": 0, "generation": 0, "attempt": 0}, "step": 1},
    "/v1/quorum": {
        "identity": {"replica_id": 0, "generation": 0, "attempt": 0},
        "step": 0, "commit_quorum_id": -1, "last_round": -1, "failed": False, "report": {"loss": 1.5}, "timeout_s": 0.2,
    },
    "/v1/failure": {"identity": {"replica_id": 0, "generation": 0, "attempt": 0}, "reason": "x", "exit_code": 1},
    "/v1/leave": {"identity": {"replica_id": 0, "generation": 0, "attempt": 0}, "step": 3, "reason": "stopped"},
    "/v1/rendezvous": {"identity": {"replica_id": 0, "generation": 0, "attempt": 0},
                       "master_addr": "h", "master_port": 1},
}


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "bigint", "neg", "float", "special", "str", "long", "bool", "null"]
    if depth < 3:
        kinds += ["list", "dict"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(0, 5)
    if kind == "bigint":
        return rng.choice([2**31, 2**62, 2**63, 2**64, 10**40])
    if kind == "neg":
        return -rng.randint(1, 2**40)
    if kind == "float":
        return rng.uniform(-1e9, 1e9)
    if kind == "special":
        return rng.choice([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 1e-320])
    if kind == "str":
        return "".join(rng.choice("ab0:/\x00\u00e9\u2603\ud7ff{}\"\\") for _ in range(rng.randint(0, 12)))
    if kind == "long":
        return "x" * rng.choice([255, 256, 257, 1024, 1025, 5000])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["identity", "step", "x", "replica_id"]): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def mutate(rng: random.Random, template: dict):
    body = json.loads(json.dumps(template))
    choice = rng.random()
    if choice < 0.1:
        return random_value(rng)
    target = body["identity"] if rng.random() < 0.3 else body
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        key = rng.choice(list(target) + ["extra"])
        if op < 0.2:
            target.pop(key, None)
        else:
            target[key] = random_value(rng)
    return body


def test_fuzzed_bodies_never_cause_a_server_error(start_coordinator):  # noqa: F811  (the imported fixture)
    # One replica: any body that happens to be a valid quorum request is decided at once,
    # so no request of the loop can block on a long-poll.
    ct = start_coordinator(num_replicas=1, heartbeat_timeout_s=30.0)
    rng = random.Random(20240611)
    seen: collections.Counter[int] = collections.Counter()
    conn = http.client.HTTPConnection("127.0.0.1", int(ct.url.rsplit(":", 1)[1]), timeout=HTTP_TIMEOUT)
    generation = 0
    try:
        for path, template in TEMPLATES.items():
            method = "PUT" if path == "/v1/rendezvous" else "POST"
            for i in range(200):
                if i % 25 == 0:  # a fresh live incarnation, so valid mutations reach the logic
                    generation += 1
                    client(ct).register(reg_req(0, gen=generation))
                    template = json.loads(json.dumps(template))
                    template["identity"]["generation"] = generation
                data = json.dumps(mutate(rng, template)).encode()  # NaN/Infinity as JSON extensions
                if i % 20 == 0:
                    data = data[: rng.randint(0, len(data))]  # truncated
                status, payload = raw_request(conn, method, path, data)
                assert status < 500, (path, data[:300], status, payload[:300])
                if status >= 400:
                    assert json.loads(payload)["error"], (path, payload)
                seen[status] += 1
    finally:
        conn.close()
    assert requests.get(ct.url + "/healthz", timeout=HTTP_TIMEOUT).status_code == 200
    assert client(ct).status().num_replicas == 1
    assert seen[400] > 500 and seen[200] > 20 and seen[409] > 0, seen  # every path was exercised


def raw_request(conn: http.client.HTTPConnection, method: str, path: str, data: bytes) -> tuple[int, bytes]:
    """One request on a kept-alive connection (far cheaper than requests for a loop)."""
    headers = {**AUTH, "Content-Type": "application/json"}
    for attempt in range(2):
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (http.client.RemoteDisconnected, ConnectionError):
            conn.close()  # the server closed a kept-alive connection: reconnect once
            if attempt:
                raise
    raise AssertionError("unreachable")


