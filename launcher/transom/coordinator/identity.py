"""Who is calling the coordinator, and which replica that caller may speak for.

A replica's code (the user's training script, and the launcher beside it) must speak only
for its own replica: what it claims about itself (its step, its busy time, its parameters'
fingerprint, its failure) is evidence the coordinator acts on, and a claim made in another
replica's name could condemn that replica or its node. So every call under `/v1/` carries
a credential, and the credential, not the body, says who the caller is:

- **The job's token** (`TRANSOM_COORDINATOR_TOKEN`, the Secret `<job>-coordinator-token`):
  the administrator's. It may act for any replica and read the whole `/v1/status`. Neither
  the operator nor `transom run` gives it to a replica any more.
- **A replica key** (`transom run`, or a coordinator started with `--replica-key-file`): a
  string that names one replica, generation and node rank, signed with an HMAC-SHA256 of a
  secret only the runner and the coordinator hold. `ReplicaKeys.mint` makes one per launcher.
- **A Kubernetes ServiceAccount token** (`kube_identity.py`): the pod's own projected,
  audience-bound token, checked with a TokenReview and mapped to the replica through the
  operator's labels on that pod.

The result is a `Principal`. `Principal.check` refuses (`Forbidden`, HTTP 403) a request
whose identity is not the principal's own replica and generation; the attempt is the
launcher's own restart count, which the platform cannot know, and a replica that lies about
it can only supersede itself.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from transom.coordinator.models import Identity
from transom.errors import Forbidden

KEY_PREFIX = "transom-replica.v1"


@dataclass(frozen=True)
class Principal:
    """The caller: the job's administrator, or one node of one replica's incarnation."""

    name: str  # for messages and logs: never a secret
    replica_id: int | None = None  # None with admin (any replica) or a spare not yet promoted
    generation: int | None = None
    node_rank: int | None = None
    admin: bool = False
    pod: tuple[str, str] | None = None  # (name, uid) of the pod whose labels made it: read again on a mismatch

    def check(self, identity: Identity, node_rank: int | None = None) -> None:
        """Forbidden unless this principal may speak for `identity` (and `node_rank`)."""
        if self.admin:
            return
        if self.replica_id is None:
            raise Forbidden(f"{self.name} holds no replica identity (a spare not yet promoted?)")
        if (identity.replica_id, identity.generation) != (self.replica_id, self.generation):
            raise Forbidden(f"{self.name} is replica {self.replica_id} generation {self.generation}; "
                            f"it may not speak for replica {identity.replica_id} generation {identity.generation}")
        if node_rank is not None and self.node_rank is not None and node_rank != self.node_rank:
            raise Forbidden(f"{self.name} is node {self.node_rank} of its replica, not node {node_rank}")

    def check_replica(self, replica_id: int) -> None:
        """Forbidden unless this principal may read replica `replica_id`'s own records."""
        if not self.admin and replica_id != self.replica_id:
            raise Forbidden(f"{self.name} may not read replica {replica_id}'s records")

    def require_admin(self, what: str) -> None:
        if not self.admin:
            raise Forbidden(f"{what} needs the job's token; {self.name} is a replica")


ADMIN = Principal(name="the job's token holder", admin=True)


class ReplicaKeys:
    """Replica keys: `transom-replica.v1.<replica>.<generation>.<node>.<hmac hex>`.

    The HMAC covers the job's name too, so a key of one job is nothing to another job's
    coordinator that happens to share the secret."""

    def __init__(self, job: str, secret: bytes | None = None):
        if secret is not None and len(secret) < 16:
            raise ValueError("a replica key secret needs at least 16 bytes")
        self.job = job
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def _mac(self, replica_id: int, generation: int, node_rank: int) -> str:
        msg = f"{self.job}/{replica_id}/{generation}/{node_rank}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def mint(self, replica_id: int, generation: int, node_rank: int = 0) -> str:
        return f"{KEY_PREFIX}.{replica_id}.{generation}.{node_rank}.{self._mac(replica_id, generation, node_rank)}"

    def principal(self, key: str) -> Principal | None:
        """The principal a key names, None if it is not a valid key of this job."""
        parts = key.split(".")
        if len(parts) != 6 or ".".join(parts[:2]) != KEY_PREFIX:
            return None
        fields, mac = parts[2:5], parts[5]
        # ASCII digits only: str.isdigit() also takes '²' (which int() refuses: a 400, not a 401)
        # and '１' (which int() reads: another spelling of a minted key).
        if not all(f.isascii() and f.isdigit() and len(f) <= 10 for f in fields):
            return None
        replica_id, generation, node_rank = (int(f) for f in fields)
        if not hmac.compare_digest(mac.encode(), self._mac(replica_id, generation, node_rank).encode()):
            return None
        return Principal(name=f"replica {replica_id} generation {generation} node {node_rank}",
                         replica_id=replica_id, generation=generation, node_rank=node_rank)


def is_replica_key(token: str) -> bool:
    return token.startswith(KEY_PREFIX + ".")
