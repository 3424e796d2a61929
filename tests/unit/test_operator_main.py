"""The operator process survives a TrainingJob as deep as the API server stores (10,000
levels of JSON): it parses, copies and compares it (as kopf's watch and diff base do), in its
main thread and in new threads, and the models refuse it with a message."""

from __future__ import annotations

import os
import subprocess
import sys

# In a process of its own: the settings are process-wide and must not leak into the tests.
PROBE = r"""
import copy, json, threading
from pydantic import ValidationError
from transom_operator import api, main

main.allow_deep_objects()
depth = 10_000  # Go's encoding/json refuses deeper, so the API server stores nothing deeper
template = '{"spec": {"containers": [{"name": "t"}], "nested": ' + '{"a":' * depth + '1' + '}' * depth + '}}'
event = ('{"type": "ADDED", "object": {"apiVersion": "transom.io/v1alpha1", "kind": "TrainingJob", '
         '"metadata": {"name": "deep"}, "spec": {"replicas": 1, "template": ' + template + '}}}')

def handle(out):
    body = json.loads(event)["object"]  # the watch
    assert copy.deepcopy(body) == body  # kopf's diff base, and a comparison
    try:
        api.TrainingJob.model_validate(body)
    except ValidationError as e:
        out.append(e.errors()[0]["msg"])

seen = []
handle(seen)
thread = threading.Thread(target=handle, args=(seen,))
thread.start()
thread.join()
print(seen)
"""


def test_a_job_as_deep_as_the_api_server_stores_is_read_and_refused_not_a_crash():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert done.returncode == 0, done.stderr[-2000:]
    refusal = "must not nest objects and lists more than 32 levels deep"
    assert done.stdout.count(refusal) == 2, done.stdout
