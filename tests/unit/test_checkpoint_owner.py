"""One job per checkpoint location (checkpoint/owner.py, job_identity.py): who a job is, what
its record says and how a record from storage is checked, the refusal's words, and the claim
on a local directory and on an object store (fsspec's memory file system, and a stand-in for
a server that does not take conditional writes)."""

from __future__ import annotations

import errno
import json
import re
import threading
from collections.abc import Iterator

import fsspec
import pytest

from transom import contract
from transom.checkpoint import owner
from transom.checkpoint.layout import JOB_RECORD
from transom.checkpoint.owner import JobRecord, claim, refusal
from transom.checkpoint.storage import Storage
from transom.errors import CheckpointLocationTaken, ScriptError
from transom.job_identity import LOCAL_UID, JobIdentity
from transom.launch.config import RunConfig

pytestmark = pytest.mark.timeout(20)
DEMO = JobIdentity("demo", "6c3a1f0e-8d2b-4f57-9a41-0b5d2e7c9f13")
DEMO_AGAIN = JobIdentity("demo", "0f9e8d7c-6b5a-4c3d-8e2f-1a0b9c8d7e6f")  # deleted and created again
LOCAL_A, LOCAL_B = JobIdentity("run-a", LOCAL_UID), JobIdentity("run-b", LOCAL_UID)


def never() -> bool:
    return False


# --- who a job is ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["demo", "a", "job-1.v2", "My_Run", "x" * 253])
def test_a_job_name_may_be_a_kubernetes_name_or_a_local_one(name):
    assert JobIdentity(name, "u").name == name


@pytest.mark.parametrize("name", ["", "-a", "a-", "a b", "a/b", "../x", "a\n", "é", "x" * 254, None, 7])
def test_anything_else_is_no_job_name(name):
    with pytest.raises(ValueError, match="job name"):
        JobIdentity(name, "u")


@pytest.mark.parametrize("uid", ["", "a b", "x" * 129, "-u", None])
def test_a_job_uid_is_a_short_plain_word(uid):
    with pytest.raises(ValueError, match="job uid"):
        JobIdentity("demo", uid)


def test_a_local_run_is_its_name_alone_and_gets_a_fresh_one_by_default():
    assert JobIdentity.for_local_run("run-a") == LOCAL_A and LOCAL_A.local and not DEMO.local
    first, second = JobIdentity.for_local_run(None), JobIdentity.for_local_run(None)
    assert re.fullmatch(r"local-[0-9a-f]{8}", first.name) and first.uid == LOCAL_UID and first != second
    assert RunConfig(command=["true"], replicas=1).job_name.startswith("local-")
    assert RunConfig(command=["true"], replicas=1, job_name="run-a").job_name == "run-a"
    with pytest.raises(ValueError, match="job name"):
        RunConfig(command=["true"], replicas=1, job_name="no spaces")


def test_the_identity_comes_from_the_pod_environment_and_none_without_a_uid():
    base = {contract.ENV_COORDINATOR_URL: "http://c", contract.ENV_REPLICA_ID: "0", contract.ENV_NUM_REPLICAS: "1",
            contract.ENV_JOB: "demo"}
    with_uid = contract.ReplicaEnv.from_environ({**base, contract.ENV_JOB_UID: DEMO.uid})
    assert JobIdentity.of(with_uid) == DEMO
    assert JobIdentity.of(with_uid.promoted(0, 1)) == DEMO  # a spare takes the job's identity along
    assert JobIdentity.of(contract.ReplicaEnv.from_environ(base)) is None


# --- the record, as read back from storage -------------------------------------------------
def test_a_record_round_trips_and_ignores_fields_a_later_version_adds():
    record = JobRecord.of(DEMO, 1.5e9)
    assert JobRecord.from_json(record.to_json()) == record and record.identity == DEMO
    later = {**json.loads(record.to_json()), "namespace": "ml"}
    assert JobRecord.from_json(json.dumps(later)).identity == DEMO


@pytest.mark.parametrize("text, says", [
    ("", "not JSON"), ("{", "not JSON"), (b"\xff\xfe", "not JSON"), ("[1]", "record"), ("null", "record"),
    ('{"name": "demo", "created": 1.0}', "uid"),
    ('{"name": 3, "uid": "u", "created": 1.0}', "name"),
    ('{"name": "demo", "uid": "u", "created": "yesterday"}', "created"),
    ('{"name": "../etc", "uid": "u", "created": 1.0}', "job name"),
    ('{"name": "demo", "uid": "a b", "created": 1.0}', "job uid"),
    ('{"format": "transom-job-9", "name": "demo", "uid": "u", "created": 1.0}', "format"),
    ("[" * 100_000, "not JSON"),
])
def test_a_record_that_is_not_one_is_a_value_error_that_says_what(text, says):
    with pytest.raises(ValueError, match=says):
        JobRecord.from_json(text)


# --- the refusal's words -----------------------------------------------------------------
def test_the_same_job_is_never_refused():
    assert refusal(DEMO, DEMO, "s3://b/run") is None
    assert refusal(LOCAL_A, JobIdentity("run-a", LOCAL_UID), "/ckpt") is None


def test_another_job_is_refused_with_both_jobs_the_location_and_what_to_do():
    said = refusal(DEMO_AGAIN, DEMO, "s3://b/run")
    assert said is not None
    assert said.startswith(f"checkpoint location s3://b/run belongs to TrainingJob demo (uid {DEMO.uid}), "
                           f"not to this job, TrainingJob demo (uid {DEMO_AGAIN.uid})")
    assert "a checkpoint URI of its own" in said and "delete s3://b/run/job.json" in said
    assert "--job-name" not in said  # no use to a TrainingJob


def test_a_second_local_run_is_told_how_to_continue_the_first():
    said = refusal(LOCAL_B, LOCAL_A, "/ckpt")
    assert said is not None and "belongs to `transom run` job run-a, not to this job, `transom run` job run-b" in said
    assert said.endswith("run it with `transom run --job-name run-a`.")
    assert "--job-name" not in (refusal(LOCAL_B, DEMO, "/ckpt") or "")  # a TrainingJob's location: not continued


# --- the claim -------------------------------------------------------------------------------
@pytest.fixture(params=["local", "memory"])
def location(request, tmp_path) -> Iterator[Storage]:
    """A location on a local file system, or on an object store (fsspec's memory one)."""
    if request.param == "local":
        yield Storage(str(tmp_path / "ckpt"))
        return
    yield Storage(f"memory://{tmp_path.name}/ckpt")
    fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_the_first_job_records_itself_and_its_restarts_go_on(location):
    assert claim(location, DEMO, never) is True
    assert JobRecord.from_json(location.read_text(JOB_RECORD)).identity == DEMO
    assert claim(location, DEMO, never) is False  # a restarted replica, a replaced pod: the same job


@pytest.mark.parametrize("second", [DEMO_AGAIN, LOCAL_A])
def test_another_job_is_refused_and_the_record_stays(location, second):
    claim(location, DEMO, never)
    before = location.read_text(JOB_RECORD)
    with pytest.raises(CheckpointLocationTaken, match="belongs to TrainingJob demo .* not to this job") as caught:
        claim(location, second, never)
    assert isinstance(caught.value, ScriptError)  # ends the job: no restart loop
    assert location.read_text(JOB_RECORD) == before


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"name": "demo"}', b"\x80\x04pickle"])
def test_a_record_that_is_not_one_refuses_the_job_in_words(location, content):
    location.write_atomic(content, JOB_RECORD)
    with pytest.raises(CheckpointLocationTaken, match=r"holds a job record, .*job\.json, that is not valid \("):
        claim(location, DEMO, never)


def test_a_huge_or_odd_record_is_refused_without_reading_it(tmp_path):
    store = Storage(str(tmp_path))
    (tmp_path / JOB_RECORD).write_bytes(b" " * (owner.MAX_RECORD_BYTES + 1))
    with pytest.raises(CheckpointLocationTaken, match="is not valid"):
        claim(store, DEMO, never)
    (tmp_path / JOB_RECORD).unlink()
    (tmp_path / JOB_RECORD).mkdir()
    with pytest.raises(CheckpointLocationTaken, match="not a regular file"):
        claim(store, DEMO, never)


def test_of_jobs_starting_at_once_exactly_one_takes_the_location(tmp_path):
    jobs = [JobIdentity(f"job-{i}", LOCAL_UID) for i in range(8)]
    barrier, outcome = threading.Barrier(len(jobs)), {}

    def start(job: JobIdentity) -> None:
        barrier.wait()
        try:
            outcome[job] = claim(Storage(str(tmp_path)), job, never)
        except CheckpointLocationTaken:
            outcome[job] = None

    threads = [threading.Thread(target=start, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    [winner] = [job for job, took in outcome.items() if took]
    assert {job for job, took in outcome.items() if took is None} == set(jobs) - {winner}
    assert JobRecord.from_json((tmp_path / JOB_RECORD).read_text()).identity == winner
    assert not [p for p in tmp_path.iterdir() if p.name != JOB_RECORD]  # no temporary file left


class _Unconditional:
    """An object store whose conditional PUT fails with `error`: a server that does not take
    `If-None-Match` (s3fs: ENOSYS for a 501), an fsspec without mode="create"."""

    def __init__(self, fs, error: Exception):
        self.fs, self.error = fs, error
        self.puts: list[str] = []

    def pipe_file(self, path, data, mode="overwrite"):
        if mode == "create":
            raise self.error
        self.puts.append(path)
        self.fs.pipe_file(path, data)

    def __getattr__(self, name):
        return getattr(self.fs, name)


@pytest.mark.parametrize("error", [OSError(errno.ENOSYS, "NotImplemented"), TypeError("unexpected keyword 'mode'")])
def test_a_store_without_conditional_writes_looks_first_then_writes(tmp_path, error):
    store = Storage(f"memory://{tmp_path.name}")
    store.fs = _Unconditional(store.fs, error)
    assert claim(store, DEMO, never) is True and claim(store, DEMO, never) is False
    with pytest.raises(CheckpointLocationTaken):
        claim(store, DEMO_AGAIN, never)
    assert store.fs.puts == [store.path(JOB_RECORD)]  # written once
    store.fs.rm(f"/{tmp_path.name}", recursive=True)


def test_storage_that_stays_away_is_its_own_error_not_a_refusal(tmp_path):
    store = Storage(str(tmp_path))
    tries = []

    def away(*parts, **kwargs):
        tries.append(parts)
        raise ConnectionError("storage is away")

    store.read_text = away
    with pytest.raises(ConnectionError):  # the replica fails as for any outage; its launcher restarts it
        claim(store, DEMO, lambda: len(tries) >= 2)
    assert len(tries) == 2
