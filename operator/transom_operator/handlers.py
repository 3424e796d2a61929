"""kopf registrations: thin, level-based, and never sleeping in a handler.

Each TrainingJob gets a daemon that runs a reconcile pass (controller.py) whenever
something relevant changed or its requeue time came, whichever is first: job, pod and node
watch events update the controller's cache of them (cache.py) and *wake* the daemon of the
job they concern (for a job's own events: when its spec changed or it is being deleted),
so reaction is immediate while every decision is still made from the whole current view
(level-based), without reading the job or listing its pods on every event.
Only the leader (leader.py) acts; the others keep their daemons idle.
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from transom import contract
from transom_operator.kube import GROUP, PLURAL, VERSION

log = logging.getLogger("transom.operator")
IDLE_POLL_S = 1.0


def _wake(memo, key) -> None:
    ev = memo.wakeups.get(key)
    if ev is not None:
        ev.set()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def job_daemon(name, namespace, stopped, memo, **_):
    key = (namespace, name)
    wakeup = memo.wakeups.setdefault(key, asyncio.Event())
    try:
        while not stopped:
            wait_s = IDLE_POLL_S
            wakeup.clear()  # before reading: a change during the pass triggers the next one
            if memo.leader.is_leader():
                try:
                    requeue = await asyncio.to_thread(memo.controller.reconcile, namespace, name)
                except Exception as e:  # a failed pass is retried; the daemon must live on
                    log.exception("reconcile of %s/%s failed: %s", namespace, name, e)
                    requeue = 2.0
                if requeue is None:
                    return
                wait_s = max(0.05, min(requeue, memo.resync_s))
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=wait_s)
            except TimeoutError:
                pass
    finally:
        memo.wakeups.pop(key, None)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_changed(event, namespace, name, memo, **_):
    # A spec change or a deletion is acted on at once; a status change (most are the
    # operator's own writes, or the coordinator's training figures) only keeps the cache current.
    if memo.controller.cache.job_event(event.get("type"), event["object"]):
        _wake(memo, (namespace, name))


@kopf.on.event("", "v1", "pods", labels={contract.LABEL_JOB: kopf.PRESENT})
async def pod_changed(event, namespace, labels, memo, **_):
    memo.controller.cache.pod_event(event.get("type"), event["object"])
    _wake(memo, (namespace, labels[contract.LABEL_JOB]))


@kopf.on.event("", "v1", "nodes")
async def node_changed(event, memo, **_):
    memo.controller.cache.node_event(event.get("type"), event["object"])
    for key in list(memo.wakeups):
        _wake(memo, key)
