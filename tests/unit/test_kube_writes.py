"""How kube.py writes and reads the API server's answers: a create that succeeds, a status
patch whose answer is the job, and the refusals of a create: 409 is "exists", a namespace
being deleted is "nothing to create", and anything else is raised (the pass is retried).
The answers come over HTTP from a loopback server that answers as the API server would."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from transom_operator.kube import Kube

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}


class _Refusing(BaseHTTPRequestHandler):
    answer: tuple[int, str] = (500, "InternalError")  # 2xx: the request's own body comes back
    seen: list[tuple[str, str, str, object]] = []  # method, path, content type, body

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.command, self.path, self.headers["Content-Type"], body))
        status, reason = self.answer
        if status < 300:
            payload = json.dumps({"echo": body}).encode()
        else:
            payload = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                                  "reason": reason, "message": f"refused: {reason}"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_PATCH = do_POST  # noqa: N815

    def log_message(self, *_):
        pass


@pytest.fixture
def kube():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}"))
    _Refusing.seen = []
    yield Kube(api, timeout=(2.0, 5.0))
    api.close()
    server.shutdown()
    thread.join(timeout=5)
    server.server_close()


def test_a_create_and_a_status_patch_that_succeed(kube):
    _Refusing.answer = (201, "Created")
    assert kube.create("ns", POD) is True
    ops = [{"op": "add", "path": "/status", "value": {"state": "Running"}}]
    _Refusing.answer = (200, "OK")
    assert kube.patch_job_status("ns", "demo", ops) == {"echo": ops}  # the job as the server has it
    assert kube.patch_pod_labels("ns", "p", {"a": None}) == {"echo": {"metadata": {"labels": {"a": None}}}}
    assert _Refusing.seen == [
        ("POST", "/api/v1/namespaces/ns/pods", "application/json", POD),
        ("PATCH", "/apis/transom.io/v1alpha1/namespaces/ns/trainingjobs/demo/status", "application/json-patch+json",
         ops),
        ("PATCH", "/api/v1/namespaces/ns/pods/p", "application/merge-patch+json",
         {"metadata": {"labels": {"a": None}}}),
    ]


@pytest.mark.parametrize("status, reason", [(409, "AlreadyExists"), (403, "NamespaceTerminating")])
def test_refusals_that_mean_nothing_to_do(kube, status, reason):
    _Refusing.answer = (status, reason)
    assert kube.create("ns", POD) is False
    # The manifest went as it is, to the kind's collection in the namespace.
    assert _Refusing.seen == [("POST", "/api/v1/namespaces/ns/pods", "application/json", POD)]


@pytest.mark.parametrize("status, reason", [(403, "Forbidden"), (422, "Invalid"), (500, "InternalError")])
def test_other_refusals_are_raised(kube, status, reason):
    _Refusing.answer = (status, reason)
    with pytest.raises(ApiException) as raised:
        kube.create("ns", POD)
    assert raised.value.status == status
