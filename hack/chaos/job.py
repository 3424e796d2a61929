"""One TrainingJob on real pods under one fault, watched and judged the same way for every
scenario.

The job is examples/trainingjob-cpu.yaml on the world's trainer image (e2e_demo.with_trainer_image),
its own namespace and checkpoint prefix, and timeouts short enough for a test (heartbeat
and collective 10 s, a NotReady node given 5 s). While it runs, `Watch` samples once a
second what an admin could see: the TrainingJob's status, and the coordinator's metrics
through the API server's service proxy. `judge` then decides, from what was seen and from
storage, the same five things for every scenario:

- it Succeeded at its target step: a few steps after the scenario saw the job recover
  (`end_after`, as `transom run --end-on` does), the manifest's step count only a cap;
- no committed step was lost: the committed step in status never went back, and every
  committed checkpoint in S3 verifies against its manifest (sizes, CRC-32, its step);
- the replicas ended bit-identical: every final worker printed the same parameter digest
  (examples/train_tiny_gpt.py's last line);
- status and Events name the reason the scenario expects;
- after the job is deleted, none of its pods or processes is left.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from chaos.world import World
from e2e_demo import BUCKET, EXAMPLE, with_trainer_image
from testenv import addons
from transom_operator.naming import COORDINATOR_PORT

DIGEST = re.compile(r"replica (\d+) rank (\d+): final step (\d+) parameters ([0-9a-f]+)")
SAMPLE_EVERY_S = 1.0
END_MARGIN = 10  # steps the job trains after the scenario saw it recover
# What an administrator with the job's token may do, run in the coordinator's own container:
# end the job at a step (POST /v1/finish), printing the step it will end at.
FINISH = ("import os, sys\nfrom transom.coordinator.client import CoordinatorClient\n"
          "print(CoordinatorClient('http://127.0.0.1:' + sys.argv[1], os.environ['TRANSOM_COORDINATOR_TOKEN'])"
          ".finish(int(sys.argv[2])))")
REFUSALS = ("transom_coordinator_fenced_requests_total", "transom_coordinator_unauthenticated_requests_total")
CHECKPOINT_INTERVAL = 20


@dataclass
class Sample:
    t: float
    state: str | None
    step: int | None
    healthy: int | None
    contributing: float | None  # transom_coordinator_contributing_replicas; None: coordinator not answering
    generations: dict[int, int]
    failures: dict[int, str | None]  # replica -> lastFailure.reason
    excluded: list[str]
    last_checkpoint: int | None
    fenced: float | None  # calls the coordinator refused: a superseded incarnation's (409) or a gone pod's (401)
    unauthenticated: float | None  # of those, the 401s

    @staticmethod
    def of(t: float, status: dict, metrics: dict[str, float] | None) -> Sample:
        training = status.get("training") or {}
        replicas = status.get("replicas") or []
        fenced = unauthenticated = None
        if metrics is not None:
            fenced = sum(v for k, v in metrics.items() if k.startswith(REFUSALS))
            unauthenticated = sum(v for k, v in metrics.items() if k.startswith(REFUSALS[1]))
        return Sample(
            t=t, state=status.get("state"), step=training.get("step"), healthy=status.get("healthyReplicas"),
            contributing=metrics.get("transom_coordinator_contributing_replicas") if metrics else None,
            generations={r["id"]: r.get("generation", 0) for r in replicas},
            failures={r["id"]: (r.get("lastFailure") or {}).get("reason") for r in replicas if r.get("lastFailure")},
            excluded=[n["name"] for n in status.get("excludedNodes") or []],
            last_checkpoint=training.get("lastCheckpoint"), fenced=fenced, unauthenticated=unauthenticated)


class Watch:
    """Samples the job once a second on a thread of its own until stopped."""

    def __init__(self, world: World, ns: str, job: str):
        self.world, self.ns, self.job = world, ns, job
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{ns}", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            try:
                status = self.world.job(self.ns, self.job).get("status") or {}
            except Exception:
                continue  # the API server is reachable from here in every scenario; a blip is skipped
            self.samples.append(Sample.of(time.monotonic(), status, self.world.coordinator_metrics(self.ns, self.job)))

    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def now(self) -> Sample:
        """The newest sample, once there is one (a scenario runs on a started job)."""
        if not self.samples:
            raise RuntimeError("no sample of the job yet")
        return self.samples[-1]


@dataclass
class Verdict:
    name: str
    survived: bool = False
    steps_lost: int = 0
    bit_identical: bool = False
    detect_s: float | None = None
    recover_s: float | None = None
    reason: str = ""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self) -> dict:
        return {"name": self.name, "survived": self.survived, "steps_lost": self.steps_lost,
                "bit_identical": self.bit_identical,
                "detect_s": None if self.detect_s is None else round(self.detect_s, 1),
                "recover_s": None if self.recover_s is None else round(self.recover_s, 1), "reason": self.reason}


class ChaosJob:
    """The scenario's TrainingJob: `start`, then the scenario acts, then `finish` and `judge`."""

    def __init__(self, world: World, ns: str, steps: int, env: dict[str, str] | None = None,
                 fault_tolerance: dict | None = None):
        self.world, self.ns, self.steps = world, ns, steps
        manifest = with_trainer_image(yaml.safe_load(EXAMPLE.read_text()), world.trainer)
        self.name = manifest["metadata"]["name"]
        spec = manifest["spec"]
        container = spec["template"]["spec"]["containers"][0]
        container["command"] = [*container["command"][:-1], str(steps)]
        container["env"] = [*container.get("env", []), {"name": "TRANSOM_LOG_LEVEL", "value": "WARNING"},
                            *({"name": k, "value": v} for k, v in (env or {}).items())]
        self.prefix = f"{BUCKET}/chaos/{ns}"
        spec["checkpoint"].update(uri=f"s3://{self.prefix}", intervalSteps=CHECKPOINT_INTERVAL, keep=3)
        spec["faultTolerance"].update({"heartbeatTimeoutSeconds": 10, "collectiveTimeoutSeconds": 10,
                                       "nodeNotReadyGraceSeconds": 5, **(fault_tolerance or {})})
        self.manifest = manifest
        self.watch = Watch(world, ns, self.name)
        self.fault_at: float | None = None
        self.restart_window: tuple[int, int] | None = None  # samples of a whole-job restart (suspend, resume)
        self.started_at = 0.0
        self.target = steps  # the step it must end at: `steps`, until `end_after` ends it sooner

    # --- running ------------------------------------------------------------------------------
    def start(self) -> None:
        w, env = self.world, self.world.env
        w.kubectl("create", "namespace", self.ns)
        w.wait(f"ServiceAccount default in {self.ns}", lambda: w.kubectl(
            "get", "sa", "default", "-n", self.ns, check=False).returncode == 0, 30)
        fs = self.storage_fs()
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        if fs.exists(self.prefix):
            fs.rm(self.prefix, recursive=True)
        secret = self.manifest["spec"]["checkpoint"]["credentialsSecret"]["name"]
        w.kubectl("create", "secret", "generic", secret, "-n", self.ns,
                  f"--from-literal=AWS_ACCESS_KEY_ID={env.s3_access_key}",
                  f"--from-literal=AWS_SECRET_ACCESS_KEY={env.s3_secret_key}",
                  f"--from-literal=AWS_ENDPOINT_URL={addons.S3_URL_IN_CLUSTER}",
                  "--from-literal=AWS_DEFAULT_REGION=us-east-1")
        w.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps(self.manifest))
        self.started_at = time.monotonic()
        self.watch.start()

    def storage_fs(self):
        import s3fs
        env = self.world.env
        return s3fs.S3FileSystem(key=env.s3_access_key, secret=env.s3_secret_key,
                                 client_kwargs={"endpoint_url": env.s3_endpoint})

    def status(self) -> dict:
        return self.world.job(self.ns, self.name).get("status") or {}

    def wait_training(self, step: int, timeout_s: float = 300) -> None:
        """Until every replica contributes and the committed step reached `step`."""
        def ready():
            s = self.watch.last()
            return s and s.contributing == self.replicas and (s.step or 0) >= step
        self.world.wait(f"{self.ns}: step {step} with {self.replicas} replicas contributing", ready, timeout_s)

    @property
    def replicas(self) -> int:
        return self.manifest["spec"]["replicas"]

    def mark_fault(self) -> None:
        self.fault_at = time.monotonic()

    def since_fault(self) -> float:
        """Seconds since the fault was marked."""
        if self.fault_at is None:
            raise RuntimeError("no fault marked")
        return time.monotonic() - self.fault_at

    def wait_contributing(self, timeout_s: float = 240) -> float:
        """Seconds from the fault until every replica contributes again, after the first
        sample since the fault in which one did not (or the coordinator did not answer)."""
        def back():
            dipped = False
            for s in self.watch.samples:
                if s.t < self.fault_at:
                    continue
                dipped = dipped or s.contributing != self.replicas
                if dipped and s.contributing == self.replicas:
                    return s.t - self.fault_at
            return None
        return self.world.wait(f"{self.ns}: every replica contributing again", back, timeout_s)

    def end_after(self, margin: int = END_MARGIN) -> int:
        """End the job `margin` steps after the step it committed last (the coordinator may
        make it later, never sooner): the scenario saw what it is about. Returns the end step."""
        pod = self.world.coordinator_pod(self.ns, self.name)
        if pod is None:
            raise RuntimeError(f"{self.ns}: no running coordinator to end the job")
        step = (self.watch.now().step or 0) + margin
        out = self.world.kubectl("exec", "-n", self.ns, pod.metadata.name, "--", "python3", "-c", FINISH,
                                 str(COORDINATOR_PORT), str(step), timeout_s=60)
        self.target = int(out.stdout.strip().splitlines()[-1])
        return self.target

    def finish(self, timeout_s: float = 600) -> dict:
        def done():
            s = self.status()
            return s if s.get("state") in ("Succeeded", "Failed") else None
        final = self.world.wait(f"{self.ns}: the job Succeeded or Failed", done, timeout_s)
        time.sleep(2 * SAMPLE_EVERY_S)  # one more sample of the final state
        self.watch.stop()
        return final

    # --- judging ------------------------------------------------------------------------------
    def judge(self, verdict: Verdict, final: dict, expect_reasons: set[str]) -> Verdict:
        training = final.get("training") or {}
        end = training.get("completedStep") or training.get("step")
        if final.get("state") != "Succeeded" or end != self.target:
            verdict.problems.append(f"ended {final.get('state')} at step {end}, not Succeeded at {self.target}")
        verdict.steps_lost = self.steps_lost()
        if verdict.steps_lost:
            verdict.problems.append(f"the committed step went back by {verdict.steps_lost}: {self.step_trace()}")
        verdict.problems += self.checkpoint_problems(final)
        digests = self.final_digests()
        verdict.bit_identical = len(digests) >= 2 and len(set(digests.values())) == 1 and \
            all(step == self.target for step, _ in digests.values())
        if not verdict.bit_identical:
            verdict.problems.append(f"final digests differ or are missing: {digests}")
        verdict.notes.append(f"{len(digests)} final digests")
        for pod in self.world.worker_pods(self.ns, self.name).values():
            text = self.world.logs(self.ns, pod.metadata.name)
            if not DIGEST.search(text):  # say why a replica printed none
                tail = " | ".join(text.strip().splitlines()[-4:])[-600:]
                verdict.notes.append(f"no digest from {pod.metadata.name}: ... {tail}")
        seen = self.reasons(final)
        failures: set[str] = {r for x in final.get("replicas") or []
                              if (r := (x.get("lastFailure") or {}).get("reason")) is not None}
        if expect_reasons:
            verdict.reason = ",".join(sorted(seen & expect_reasons)) or ",".join(sorted(seen)) or "none"
        else:  # nothing should have failed: the failures are the reason column, else "none"
            verdict.reason = ",".join(sorted(failures)) or "none"
            if failures:
                verdict.problems.append(f"replicas failed where nothing should: {sorted(failures)}")
        if expect_reasons and not expect_reasons <= seen:
            verdict.problems.append(
                f"expected reasons {sorted(expect_reasons)} in status and Events, saw {sorted(seen)}")
        return verdict

    def steps_lost(self) -> int:
        """The furthest the committed step in status ever fell below its high-water mark; a
        whole-job restart (`restart_window`, samples from the resume until status is back at
        the restored checkpoint) starts the mark again from the checkpoint."""
        top, lost = 0, 0
        start, end = self.restart_window or (len(self.watch.samples), len(self.watch.samples))
        for i, s in enumerate(self.watch.samples):
            if start <= i < end:
                continue
            if i == end:
                top = 0
            if s.step is not None:
                top = max(top, s.step)
                lost = max(lost, top - s.step)
        return lost

    def step_trace(self) -> str:
        """The committed step as status showed it, each change with its time since the fault."""
        out, last = [], object()
        base = self.fault_at or self.started_at
        for s in self.watch.samples:
            if s.step != last:
                out.append(f"{s.t - base:+.0f}s:{s.step}")
                last = s.step
        return " ".join(out[-40:])

    def storage(self):
        from transom.checkpoint.storage import Storage
        env = self.world.env
        return Storage(f"s3://{self.prefix}", key=env.s3_access_key, secret=env.s3_secret_key,
                       client_kwargs={"endpoint_url": env.s3_endpoint})

    def committed_steps(self) -> list[int]:
        """Steps with a manifest in S3, newest first."""
        from transom.checkpoint import restore
        return restore.committed_steps(self.storage())[0]

    def checkpoint_problems(self, final: dict) -> list[str]:
        """Every committed checkpoint verifies (manifest of its own step, sizes and CRC-32s);
        the newest is the one status names."""
        from transom.checkpoint import restore
        storage = self.storage()
        committed, _ = restore.committed_steps(storage)
        problems = []
        for step in committed:
            try:
                restore.load_step(storage, step)
            except Exception as e:
                problems.append(f"checkpoint step {step} does not verify: {e}")
        newest = (final.get("training") or {}).get("lastCheckpoint")
        if not committed or committed[0] != newest:
            problems.append(f"newest committed checkpoint {committed[:1]} is not status' lastCheckpoint {newest}")
        return problems

    def final_digests(self) -> dict[tuple[int, int], tuple[int, str]]:
        """(replica, rank) -> (final step, digest), from the logs of the job's pods."""
        out = {}
        for pod in self.world.all_pods(self.ns):
            for m in DIGEST.finditer(self.world.logs(self.ns, pod.metadata.name)):
                out[(int(m[1]), int(m[2]))] = (int(m[3]), m[4])
        return out

    def reasons(self, final: dict) -> set[str]:
        """Why anything happened, as status and Events say it: replicas' last failures,
        excluded nodes' reasons, Warning Events and the operator's own Events."""
        from transom_operator import reasons as r
        own = {v for k, v in vars(r).items() if k.startswith("EVENT_") and isinstance(v, str)}
        seen = {(x.get("lastFailure") or {}).get("reason") for x in final.get("replicas") or []}
        seen |= {n.get("reason") for n in final.get("excludedNodes") or []}
        seen |= {e.reason for e in self.world.events(self.ns) if e.type == "Warning" or e.reason in own}
        return {x for x in seen if x} - {"JobSucceeded"}

    def delete(self) -> list[str]:
        """Delete the job and its namespace (while the operator runs, for its finalizer);
        what is left running afterwards."""
        w = self.world
        w.kubectl("delete", "tj", self.name, "-n", self.ns, "--timeout=90s", check=False, timeout_s=100)
        w.kubectl("delete", "namespace", self.ns, "--timeout=120s", check=False, timeout_s=130)
        try:
            w.wait(f"{self.ns} gone", lambda: w.kubectl("get", "namespace", self.ns, check=False).returncode != 0, 60)
        except TimeoutError:
            return [f"namespace {self.ns} still exists"]
        try:  # the pods are gone from the API; their processes follow within a grace period
            w.wait("the job's processes gone", lambda: not leftover_processes(), 60)
        except TimeoutError:
            return leftover_processes()
        return []


def leftover_processes() -> list[str]:
    """Processes of a job's containers still running on the real nodes: the training
    script, or a Transom launcher or coordinator, in a node's cgroups (the host's own
    processes, such as another session's local runs, are not the cluster's)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if "/transom-real-" not in (proc / "cgroup").read_text():
                continue
            text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "train_tiny_gpt.py" in text or "transom coordinator" in text or "transom launch" in text:
            found.append(text[:200])
    return found


@contextlib.contextmanager
def tended(job: ChaosJob, verdict: Verdict, label: str = "") -> Iterator[None]:
    """Run a scenario's body: an error in it becomes the verdict's problem (the watch is
    stopped), and the job is always deleted, what it left running a problem too."""
    prefix = f"{label}: " if label else ""
    try:
        yield
    except Exception as e:
        verdict.problems.append(f"{prefix}{type(e).__name__}: {e}")
        job.watch.stop()
    finally:
        left = job.delete()
        if left:
            verdict.problems.append(f"{prefix}left running after the job was deleted: {left}")
