"""Every rank's checkpoint trouble, heard through the replica's leader.

Each rank of a replica writes its own part of every checkpoint (ft/checkpointing.py), so
storage can fail for one rank while the leader's own writes still go through (a part on
another node, its mount gone). Only the leader talks to the coordinator, so the other
ranks say what their checkpoint writer fails at through the replica's store (the leader's
TCPStore, the one its quorum groups use): rank r sets `transom/trouble/r` whenever its
writer's trouble changes (from the writer's thread), and the leader's heartbeat reads
every rank's key and reports them with its own, each prefixed with its rank. A rank's
words are its own: they name its rank, and nothing acts on them.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from transom.checkpoint.engine import CheckpointEngine
    from transom.ft.replica import ReplicaContext

log = logging.getLogger("transom.ft")
KEY = "transom/trouble/{rank}"
STORE_TIMEOUT_S = 2.0  # a heartbeat does not wait longer for the store


class TroubleBoard:
    """The replica's ranks' checkpoint trouble: `publish` on every rank but the leader,
    `read` on the leader."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self._said: str | None = None

    @classmethod
    def connect(cls, leader_store: tuple[str, int] | None, own: dist.Store | None, rank: int,
                world_size: int) -> TroubleBoard:
        """The leader uses its own store; another rank connects to the leader's (its address
        handed down from the leader); a replica of one process needs none."""
        if world_size == 1 or leader_store is None:
            return cls(own, rank, world_size)
        if own is not None:
            return cls(own, rank, world_size)
        host, port = leader_store
        try:
            store = dist.TCPStore(host, port, is_master=False, use_libuv=True,
                                  timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        except Exception as e:  # checkpoints go on; only this rank's trouble goes unheard
            log.warning("rank %d cannot reach the replica's store (%s): its checkpoint trouble is not reported",
                        rank, e)
            store = None
        return cls(store, rank, world_size)

    def publish(self, trouble: str | None) -> None:
        """This rank's writer's trouble changed (its thread): tell the leader."""
        if self.store is None or self.rank == 0 or trouble == self._said:
            return
        try:
            self.store.set(KEY.format(rank=self.rank), trouble or "")
            self._said = trouble
        except Exception as e:  # the leader gone: the replica is failing anyway
            log.debug("rank %d could not publish its checkpoint trouble: %s", self.rank, e)

    def read(self, own: str | None) -> str | None:
        """The leader's view for its heartbeat: its own trouble and every other rank's, each
        prefixed with its rank when there are several; None when nobody has any."""
        said = {0: own} if own else {}
        if self.store is not None and self.rank == 0:
            for rank in range(1, self.world_size):
                key = KEY.format(rank=rank)
                try:
                    if self.store.check([key]):
                        text = self.store.get(key).decode(errors="replace")
                        if text:
                            said[rank] = text
                except Exception as e:
                    log.debug("could not read rank %d's checkpoint trouble: %s", rank, e)
        if not said:
            return None
        if self.world_size == 1:
            return said.get(0)
        return "; ".join(f"rank {rank}: {text}" for rank, text in sorted(said.items()))


class ReplicaTrouble:
    """What the replica's checkpoint writers fail at, as the leader's heartbeat says it:
    `engine`'s own trouble, and once `connect`ed, every other rank's through the board."""

    def __init__(self, engine: CheckpointEngine | None):
        self.engine = engine
        self.board: TroubleBoard | None = None

    def connect(self, ctx: ReplicaContext, leader_store: dist.TCPStore | None) -> None:
        """On every rank of the replica, together (the leader hands its store's address down)."""
        if self.engine is None:
            return
        address = (ctx.env.advertise_addr, leader_store.port) if leader_store is not None else None
        self.board = TroubleBoard.connect(ctx.from_leader(address), leader_store, ctx.rank, ctx.world_size)
        self.engine.on_trouble = self.board.publish

    def __call__(self) -> str | None:
        own = self.engine.trouble if self.engine is not None else None
        board = self.board  # a heartbeat may come before the board is made, or after close
        return board.read(own) if board is not None else own
