"""Every rank's checkpoint trouble reaches the replica's leader through its store
(ft/trouble_board.py), with a real TCPStore on loopback; and the S3 client makes one attempt
per request, so Transom's own retry names an outage at the first failed write
(checkpoint/storage.py `s3_options`)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from transom.checkpoint.storage import S3_CONNECT_TIMEOUT_S, Storage, s3_options
from transom.ft.trouble_board import TroubleBoard


def test_a_rank_s_trouble_reaches_the_leader_with_its_rank_and_goes_when_it_writes_again():
    leader_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
                                 timeout=datetime.timedelta(seconds=5))
    leader = TroubleBoard.connect(("127.0.0.1", leader_store.port), leader_store, rank=0, world_size=3)
    other = TroubleBoard.connect(("127.0.0.1", leader_store.port), None, rank=2, world_size=3)
    assert leader.read(None) is None
    other.publish("writing part 5 of step 40: ClientConnectorError")
    assert leader.read(None) == "rank 2: writing part 5 of step 40: ClientConnectorError"
    assert leader.read("writing part 0 of step 40: ClientConnectorError") == (
        "rank 0: writing part 0 of step 40: ClientConnectorError; "
        "rank 2: writing part 5 of step 40: ClientConnectorError")
    other.publish(None)  # its write went through
    assert leader.read(None) is None


def test_a_replica_of_one_process_reports_its_own_trouble_as_it_is():
    alone = TroubleBoard.connect(None, None, rank=0, world_size=1)
    assert alone.read("writing part 0 of step 40: ConnectError") == "writing part 0 of step 40: ConnectError"
    alone.publish("ignored: there is no other rank")
    assert alone.read(None) is None


def test_the_s3_client_tries_each_request_once_with_a_short_connect_timeout():
    options = s3_options({"endpoint_url": "http://127.0.0.1:9"})
    assert options["config_kwargs"]["retries"]["max_attempts"] == 1
    assert options["config_kwargs"]["connect_timeout"] == S3_CONNECT_TIMEOUT_S
    own = s3_options({"config_kwargs": {"retries": {"max_attempts": 3}}})  # the caller's choice stays
    assert own["config_kwargs"]["retries"] == {"max_attempts": 3}
    storage = Storage("s3://bucket/job", endpoint_url="http://127.0.0.1:9", key="k", secret="s")
    assert storage.fs.retries == 1  # s3fs's own loop around each request: one try
    assert storage.fs.config_kwargs["retries"]["max_attempts"] == 1
