"""How kube.py reads the API server's refusals of a create: 409 is "exists", a namespace
being deleted is "nothing to create", and anything else is raised (the pass is retried)."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException

from transom_operator.kube import Kube

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}


class Refusing:
    def __init__(self, status: int, reason: str):
        self.status, self.reason = status, reason

    def create(self, **_):
        e = ApiException(status=self.status, reason=self.reason)
        e.body = json.dumps({"kind": "Status", "code": self.status, "details": {"causes": [{"reason": self.reason}]}})
        raise e


@pytest.fixture
def kube():
    # Without __init__: its dynamic client would ask a server for discovery. create() needs
    # only _kind, which each test replaces.
    return Kube.__new__(Kube)


@pytest.mark.parametrize("status, reason, created", [(409, "AlreadyExists", False), (403, "NamespaceTerminating", False)])
def test_refusals_that_mean_nothing_to_do(kube, monkeypatch, status, reason, created):
    monkeypatch.setattr(kube, "_kind", lambda *_: Refusing(status, reason))
    assert kube.create("ns", POD) is created


@pytest.mark.parametrize("status, reason", [(403, "Forbidden"), (422, "Invalid"), (500, "InternalError")])
def test_other_refusals_are_raised(kube, monkeypatch, status, reason):
    monkeypatch.setattr(kube, "_kind", lambda *_: Refusing(status, reason))
    with pytest.raises(ApiException):
        kube.create("ns", POD)
