"""Non-blocking catch-up: a replica (re)joins while the others train on, and nobody waits for it.

The joiner enters the quorum at once. In its first round it takes the *small* state from a
source (the step, the optimizer's hyperparameters, the GradScaler's scale, the sampler, the
script's extra state such as an LR scheduler, the RNG: kilobytes), so from then on its
script runs in step with the others: the same LR schedule, the same scale, the same skip
decisions, the same clipping of the same averaged gradients. What it lacks is the *tensor*
state (parameters and optimizer moments). Until it has them it contributes zero gradients
(the others average over the contributors only), and instead of stepping its optimizer it
records each committed step's update: the averaged gradients as the optimizer would have
consumed them, the hyperparameters, whether the scaler skipped the step (`Record`).

Meanwhile, in a background thread (`Joiner`), it fetches a snapshot of a committed step S
from its sources' host memory (ft/transfer.py: chunks with checksums, from every source in
parallel, resumed on the others when one dies; ft/sources.py: only a snapshot that fits its
own model and that a majority of its sources serve), builds a *shadow* copy of the
parameters and of the optimizer from it, verifies it if asked to (`verify`), and replays the
recorded updates S, S+1, ... on the shadow. When the shadow has reached the step the replica
is committing, the main thread swaps it in (parameter storage and optimizer state, no copy)
and commits that step normally: the replica is bit-identical to the others and contributes
from the next round. A transfer that outlasts many steps only means more records to replay,
whose memory is bounded (`max_record_bytes`): past it the joiner drops its records and asks
for a newer snapshot.

A source (`Source`) takes its snapshot after a commit, when the coordinator asks for one
newer than what it keeps: the host copy runs in the background during the next forward
and backward (checkpoint/snapshot.py) and is awaited before the next optimizer step, the
hashing after it; so a source never stops its own step for the joiner. It keeps one
snapshot while anyone is catching up and drops it when nobody is. The snapshot holds the
step and the model's and optimizer's state (`snapshot_part`): the rest the joiner took
with the small state.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from transom.background import yield_cpu
from transom.checkpoint import structure
from transom.checkpoint.snapshot import Snapshot
from transom.errors import IncompatibleState, WireError
from transom.ft import transfer
from transom.ft.expected import ExpectedState
from transom.ft.sources import Choice, SnapshotUse, Sources
from transom.ft.state_print import PrintLater
from transom.ft.state_server import StateServer

log = logging.getLogger("transom.ft")
TENSOR_PARTS = ("model", "optimizer")


def small_part(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (ReplicaState.capture) without the model's and the optimizer's tensors."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["optimizer"]["param_groups"]]
    return {**{k: v for k, v in state.items() if k not in TENSOR_PARTS}, "param_groups": groups}


def snapshot_part(state: dict[str, Any]) -> dict[str, Any]:
    """What a source's snapshot holds of `state` (ReplicaState.capture): the step and the
    model's and optimizer's state, all a shadow is built from (ft/expected.py expects this)."""
    return {"step": state["step"], **{k: state[k] for k in TENSOR_PARTS}}


def apply_small(small: dict[str, Any], optimizer: torch.optim.Optimizer, load_rest: Callable[[dict], int]) -> int:
    """Load the small state: the optimizer's hyperparameters here, the rest by `load_rest`
    (ReplicaState.apply_small); returns its step."""
    groups = small.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise IncompatibleState("the peer's optimizer has a different number of parameter groups")
    step = load_rest(small)
    for live, peer in zip(optimizer.param_groups, groups):
        live.update({k: v for k, v in peer.items() if k != "params"})
    return step


@dataclass
class Record:
    """What committed step `step` did to the optimizer; replayed on the shadow."""

    step: int
    grads: list[torch.Tensor | None]  # in the order of the optimizer's param_groups
    hyper: list[dict[str, Any]]  # each group's hyperparameters, LR scaling applied
    update: bool  # False: the scaler found inf/NaN, the step counted without an update

    @property
    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads if g is not None)


def record_of(step: int, optimizer: torch.optim.Optimizer, update: bool) -> Record:
    """The update the optimizer would make now (call it where it would step)."""
    grads = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            grad = p.grad
            # zero_grad(set_to_none=True) follows and releases the tensor to us; a view of a
            # bucket that DDP reuses next step must be copied.
            if grad is not None and grad._base is not None:
                grad = grad.clone()
            grads.append(None if grad is None else grad.detach())
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return Record(step, grads, hyper, update)


def parameters_of(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """The model's parameters by name and its buffers' names, for a Shadow. Call it on the
    training thread between passes, where FSDP2's registered parameters are the sharded
    ones the optimizer steps."""
    return list(model.named_parameters()), [name for name, _ in model.named_buffers()]


class Shadow:
    """Parameters and an optimizer of the same class built from a snapshot, to replay records on."""

    def __init__(self, state: dict[str, Any], named: list[tuple[str, torch.Tensor]], buffer_names: list[str],
                 optimizer: torch.optim.Optimizer):
        """`named`: the model's parameters by name and `buffer_names`, as the training thread
        saw them between steps (`parameters_of`): read here, on the joiner's thread, the
        model's registered parameters may be FSDP2's unsharded ones of a pass in flight,
        which the optimizer does not hold."""
        sd = state["model"]
        self.step: int = state["step"]
        by_id = {}
        for name, p in named:
            if name not in sd:
                raise IncompatibleState(f"the snapshot has no parameter {name}")
            t = sd[name]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise IncompatibleState(f"{name}: the snapshot's {t.dtype}{list(t.shape)} does not fit "
                                        f"{p.dtype}{list(p.shape)}")
            by_id[id(p)] = t.detach().requires_grad_(p.requires_grad)
        self.model_params = list(by_id.values())  # what a source's fingerprint sums (ft/snapshot_check.py)
        self.buffers = {name: sd[name] for name in buffer_names if name in sd}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [by_id[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        self.params = [p for g in groups for p in g["params"]]
        try:
            # A concrete optimizer class takes (params, hyperparameters with defaults), not
            # Optimizer.__init__'s (params, defaults): the groups carry every hyperparameter.
            rebuild = cast(Callable[[list[dict[str, Any]]], torch.optim.Optimizer], type(optimizer))
            self.optimizer = rebuild(groups)
        except TypeError as e:
            raise IncompatibleState(f"{type(optimizer).__name__} cannot be rebuilt from its param_groups "
                                    f"for a catch-up: {e}") from e
        self.optimizer.load_state_dict(state["optimizer"])

    def replay(self, r: Record) -> None:
        for g, h in zip(self.optimizer.param_groups, r.hyper):
            g.update(h)
        if r.update:
            for p, grad in zip(self.params, r.grads):
                p.grad = grad
            self.optimizer.step()
            for p in self.params:
                p.grad = None
        self.step = r.step + 1

    def swap_into(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Make the live parameters and optimizer this shadow's (their storage, no copy)."""
        live = [p for g in optimizer.param_groups for p in g["params"]]
        with torch.no_grad():
            for p, s in zip(live, self.params):
                if hasattr(p, "to_local") or hasattr(s, "to_local"):
                    p.copy_(s)  # a sharded parameter's storage belongs to FSDP: copy into it
                else:
                    p.data = s.detach()
            for name, b in model.named_buffers():
                if name in self.buffers:
                    b.copy_(self.buffers[name])
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(self.optimizer.state_dict())
        for g, h in zip(optimizer.param_groups, hyper):  # the live schedule, not the last record's
            g.update(h)


class Joiner:
    """The joiner's background half: fetch a snapshot, build the shadow, replay records."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, token: str,
                 device: torch.device, rebuild: Callable | None, need_from: int, sources: list[str],
                 timeout_s: float, max_record_bytes: int, gate: transfer.LinkGate | None = None,
                 verify: Callable[[transfer.SnapshotManifest, Shadow, int, int], SnapshotUse] | None = None):
        """Make it on the training thread, in the round whose small state it took: `need_from`
        is that state's step, committed by the sources. `gate`: the trainer's; the transfer
        uses the link only while the exchange does not. `verify(manifest, shadow, serving,
        others)`: called on this thread once a snapshot's shadow is built, before anything is
        replayed on it, with how many sources serve it and how many others are left; REFUSE
        means it is not to be trusted (the sources that served it are dropped, it is never
        taken again), ELSEWHERE that it is unconfirmed while another source is left (its
        sources are dropped); either way another snapshot is sought. An exception from it is
        a failed attempt (the snapshot is fetched again); it is bounded by `timeout_s` like
        the rest."""
        self.model, self.optimizer, self.token, self.device = model, optimizer, token, device
        self._named, self._buffer_names = parameters_of(model)  # here, on the training thread
        self.gate, self.verify = gate, verify
        self.rebuild, self.timeout_s, self.max_record_bytes = rebuild, timeout_s, max_record_bytes
        self.need_from = need_from  # the snapshot must be of this step or later
        self._committed = need_from  # the newest step known committed: no snapshot can be newer
        self._want_newer = False  # the sources disagree: ask them for a newer snapshot at the next commit
        self.error: str | None = None
        self.fetched: list[tuple[int, int, float]] = []  # (step, bytes, seconds) per completed transfer
        self.recorded: list[int] = []  # the steps recorded, for statistics and fault injection
        self._endpoints: list[str] = list(sources)
        # Before anything is fetched: the joiner's own tensors are what a snapshot must hold.
        self.sources = Sources(self._sources, token, timeout_s, ExpectedState.of(model, optimizer))
        self._records: dict[int, Record] = {}
        self._record_bytes = 0
        self._shadow: Shadow | None = None
        self._generation = 0  # bumped when the records are dropped: the shadow is then useless
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transom-catchup", daemon=True)
        self._thread.start()

    # --- the main thread ---------------------------------------------------------------------
    def set_sources(self, endpoints: list[str]) -> None:
        with self._cond:
            self._endpoints = list(endpoints)

    def _sources(self) -> list[str]:
        with self._cond:
            return list(self._endpoints)

    def _bounds(self) -> tuple[int, int]:
        """(the oldest step a snapshot may be of, the newest committed step)."""
        with self._cond:
            return self.need_from, self._committed

    def _ask_newer(self) -> None:
        with self._cond:
            self._want_newer = True

    def ready_at(self, step: int) -> bool:
        """The shadow holds the state after `step` committed steps: swap it in now."""
        with self._cond:
            return self._shadow is not None and self._shadow.step == step

    def record(self, r: Record) -> None:
        with self._cond:
            self.recorded.append(r.step)
            self._committed = max(self._committed, r.step + 1)
            if self._want_newer:
                # need_from goes into the next quorum request (catching_up_from): every source
                # that keeps an older snapshot takes one at the same commit, and the honest
                # ones then serve the same.
                self._want_newer = False
                self.need_from = max(self.need_from, r.step + 1)
            self._records[r.step] = r
            self._record_bytes += r.nbytes
            if self._record_bytes > self.max_record_bytes:
                # Too far behind to replay within the memory allowed: start over from a
                # snapshot newer than anything recorded (the sources take one).
                log.warning("catch-up: %d MB of updates recorded, over the limit; asking for a newer snapshot",
                            self._record_bytes >> 20)
                self._records.clear()
                self._record_bytes = 0
                self._shadow = None
                self._generation += 1
                self.need_from = r.step + 1
            self._cond.notify_all()

    def take(self) -> None:
        """Swap the shadow into the live model and optimizer (after ready_at) and stop."""
        with self._cond:
            shadow = self._shadow
            self._stop.set()
            self._cond.notify_all()
        self._thread.join(timeout=30)
        assert shadow is not None
        shadow.swap_into(self.model, self.optimizer)
        self._records.clear()

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # --- the background thread ---------------------------------------------------------------
    def _run(self) -> None:
        last_progress = time.monotonic()
        while not self._stop.is_set():
            with self._cond:
                generation = self._generation
            try:
                shadow = self._build()
            except transfer.SnapshotChanged as e:
                log.info("catch-up: %s; fetching the newer one", e)
                continue
            except InterruptedError:
                return
            except Exception as e:
                if time.monotonic() - last_progress > self.timeout_s:
                    self.error = f"{type(e).__name__}: {e}"
                    return
                log.warning("catch-up: %s; trying again", e)
                self._stop.wait(0.2)
                continue
            last_progress = time.monotonic()
            self._replay(shadow, generation)

    def _build(self) -> Shadow:
        stopped = self._stop.is_set
        chosen = self.sources.find(self._bounds, stopped, self._ask_newer, verified=self.verify is not None)
        manifest = chosen.manifest
        t0 = time.monotonic()
        data = transfer.fetch(manifest, chosen.serving, self.token, self.timeout_s, stopped, late=chosen.late,
                              gate=self.gate, max_manifest_bytes=self.sources.expected.max_manifest_bytes)
        self.fetched.append((manifest.step, manifest.total_bytes, time.monotonic() - t0))
        log.info("catch-up: snapshot of step %d (%.1f MB) from %d source(s) in %.2fs", manifest.step,
                 manifest.total_bytes / 1e6, len(chosen.serving) + len(chosen.late), time.monotonic() - t0)
        t1 = time.monotonic()
        try:
            state = transfer.assemble(manifest, data, self.device, self.rebuild)
            if not isinstance(state, dict) or not set(TENSOR_PARTS) <= state.keys() \
                    or state.get("step") != manifest.step:
                raise WireError("the snapshot is not a replica state of its step")
        except WireError as e:
            self.sources.refuse(manifest, chosen.serving, f"its snapshot of step {manifest.step}: {e}")
            raise
        shadow = Shadow(state, self._named, self._buffer_names, self.optimizer)
        self._verify(chosen, shadow)
        log.info("catch-up: shadow of step %d built in %.2fs", manifest.step, time.monotonic() - t1)
        return shadow

    def _verify(self, chosen: Choice, shadow: Shadow) -> None:
        """WireError unless `verify` lets the shadow built from `chosen` be used."""
        if self.verify is None:
            return
        manifest = chosen.manifest
        others = [ep for ep in self._sources() if ep not in self.sources.dropped and ep not in chosen.serving]
        use = self.verify(manifest, shadow, len(chosen.serving), len(others))
        if use is SnapshotUse.REFUSE:
            why = f"the snapshot of step {manifest.step} failed the verification"
            self.sources.refuse(manifest, chosen.serving, why)
            raise WireError(why)
        if use is SnapshotUse.ELSEWHERE:
            why = f"nobody but its source confirms its snapshot of step {manifest.step}; another source is tried"
            self.sources.drop(chosen.serving, why)
            raise WireError(why)

    def _replay(self, shadow: Shadow, generation: int) -> None:
        """Apply the records from the shadow's step on, as they come, until taken or reset."""
        with self._cond:
            for step in [s for s in self._records if s < shadow.step]:
                self._record_bytes -= self._records.pop(step).nbytes
            if self._generation != generation:
                return
            self._shadow = shadow
        while not self._stop.is_set():
            with self._cond:
                if self._generation != generation:
                    return  # the records were dropped: this shadow can never catch up
                r = self._records.pop(shadow.step, None)
                if r is None:
                    self._cond.wait(0.5)
                    continue
                self._record_bytes -= r.nbytes
            # Outside the lock, so the training step never waits for a replay; shadow.step
            # moves only once the update is applied, so ready_at never sees half of one.
            t0 = time.monotonic()
            shadow.replay(r)
            log.debug("catch-up: replayed step %d in %.3fs", r.step, time.monotonic() - t0)


class Source:
    """A source's half: keep one snapshot of a committed step while anyone catches up."""

    def __init__(self, server: StateServer, localize: Callable | None, chunk_bytes: int = transfer.CHUNK_BYTES):
        self.server, self.localize, self.chunk_bytes = server, localize, chunk_bytes
        self._want: int | None = None  # a snapshot of a step >= this is wanted
        self._copy: Snapshot | None = None
        self._skeleton: Any = None
        self._copy_step = -1
        self._publisher: threading.Thread | None = None
        self._reserved: Snapshot | None = None  # pinned buffers allocated by _reserving
        self._reserving: threading.Thread | None = None
        self._print: PrintLater | None = None  # the fingerprint of the snapshot's state, being summed

    def on_round(self, serve: bool, snapshot_from: int | None) -> None:
        """The round's instruction: keep a snapshot of a step >= `snapshot_from`, or none."""
        if not serve or snapshot_from is None:
            self._want = None
            if self._reserving is not None and not self._reserving.is_alive():
                self._reserving = self._reserved = None  # nobody joins: give the pinned memory back
            if self._copy is None and self._publisher is None:
                self.server.publish_snapshot(None)
            return
        kept = self.server.snapshot_step
        in_flight = self._copy_step if (self._copy is not None or self._publisher is not None) else None
        best = max(s for s in (kept, in_flight, -1) if s is not None)
        self._want = snapshot_from if best < snapshot_from else None

    def after_commit(self, step: int, capture: Callable[[int], dict],
                     state: Callable[[], list[torch.Tensor]] | None = None) -> None:
        """Start the snapshot of `step` if one is wanted (the copy runs in the background),
        and the fingerprint of `state()` (the parameters and optimizer state) beside it."""
        if self._want is None or step < self._want or self._copy is not None:
            return
        if self._publisher is not None and self._publisher.is_alive():
            return  # the previous one is still being hashed: take this one at the next commit
        self._publisher = None
        t0 = time.monotonic()
        tensors, skeleton = structure.flatten(snapshot_part(capture(step)), torch.is_tensor, self.localize)
        copy = self._snapshot_for(tensors)
        if copy is None:
            return  # its pinned buffers are being allocated: a later commit takes the snapshot
        self._skeleton, self._copy, self._copy_step, self._want = skeleton, copy, step, None
        copy.start(tensors)
        self._print = PrintLater(state()) if state is not None else None
        log.info("taking a snapshot of step %d for a replica that catches up (started in %.3fs)", step,
                 time.monotonic() - t0)

    def _snapshot_for(self, tensors: dict[str, torch.Tensor]) -> Snapshot | None:
        """A Snapshot ready to copy `tensors`, or None while its buffers are being allocated.

        Host buffers for CPU tensors cost nothing to allocate (their pages are touched by the
        copy thread). Pinned buffers for CUDA tensors lock their pages when allocated, a
        fraction of a second per 100 MB, which on the training thread stalled the sources'
        step at the start of every catch-up; a helper thread allocates them instead, and the
        snapshot is taken at the first commit after they exist. A fresh Snapshot each time,
        because the previous one's buffers may still be sent to a joiner."""
        if not any(t.is_cuda for t in tensors.values()):
            return Snapshot()
        if self._reserving is None:
            reserved = self._reserved = Snapshot()

            def reserve() -> None:
                try:
                    reserved.reserve(tensors)
                except Exception:  # start() allocates what is missing, on the training thread
                    log.exception("could not allocate the pinned buffers of a snapshot ahead")

            self._reserving = threading.Thread(target=reserve, name="transom-snapshot-reserve", daemon=True)
            self._reserving.start()
        if self._reserving.is_alive():
            return None
        copy, self._reserved, self._reserving = self._reserved, None, None
        return copy

    def snapshot_print(self, step: int) -> concurrent.futures.Future[int] | None:
        """Where a snapshot of `step` was started at its commit: the fingerprint its row
        carries once summed, which the joiners check the snapshot against
        (ft/snapshot_check.py); None otherwise."""
        if self._copy is None or self._copy_step != step or self._print is None:
            return None
        return self._print.future

    def before_update(self, timeout_s: float = 300.0) -> None:
        """Before the optimizer changes the parameters: the copy and the state's fingerprint
        must be complete. Hashing and publishing go on in the background."""
        if self._copy is None:
            return
        copy, self._copy = self._copy, None
        t0 = time.monotonic()
        self._wait_print(timeout_s)
        tensors = copy.wait(timeout_s)
        log.debug("snapshot copy of step %d awaited %.3fs before the optimizer step", self._copy_step,
                 time.monotonic() - t0)
        step, skeleton, chunk_bytes = self._copy_step, self._skeleton, self.chunk_bytes

        def publish() -> None:
            yield_cpu()
            try:
                t0 = time.monotonic()
                self.server.publish_snapshot(transfer.publish(step, tensors, skeleton, chunk_bytes))
                log.info("serving the snapshot of step %d (hashed in %.2fs)", step, time.monotonic() - t0)
            except Exception:  # the joiner times out and asks again; never the source's failure
                log.exception("could not publish the snapshot of step %d", step)

        self._publisher = threading.Thread(target=publish, name="transom-snapshot-publish", daemon=True)
        self._publisher.start()

    def _wait_print(self, timeout_s: float) -> None:
        if self._print is not None:
            self._print.wait(timeout_s)
            self._print = None

    def wait_publisher(self, timeout_s: float) -> None:
        if self._publisher is not None:
            self._publisher.join(timeout_s)
            if not self._publisher.is_alive():
                self._publisher = None

    def close(self) -> None:
        if self._reserving is not None:
            self._reserving.join(30.0)
            self._reserving = self._reserved = None
        self._wait_print(30.0)
        if self._copy is not None:
            try:
                self._copy.wait(30.0)
            except Exception as e:
                log.debug("snapshot copy at close: %s", e)
            self._copy = None
        self.wait_publisher(30.0)
        self.server.publish_snapshot(None)
