"""The status of a TrainingJob: what the operator and the job's coordinator observed.

The operator writes everything but `training`, which the coordinator writes with its own
ServiceAccount (progress, completion, verdicts). Status objects accept fields they do not
know, so that an older reader survives a newer writer (`StatusModel`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from transom_operator.api_base import (
    CAMEL_CASE,
    MAX_COUNT,
    MAX_GENERATION,
    MAX_INT,
    MAX_NODES_PER_REPLICA,
    MAX_RANKS_PER_REPLICA,
    MAX_REPLICAS,
    MAX_RESTARTS,
    MAX_STEP,
    JobState,
    NodeName,
    NodeNameItem,
    Reason,
    ReplicaPhase,
    Rule,
    SpareState,
    StatusModel,
    Timestamp,
)


class Condition(StatusModel):
    """An observation of one aspect of the job (Kubernetes condition conventions)."""

    type: str = Field(
        max_length=64, pattern=CAMEL_CASE,
        description="Kind of condition: Ready, Degraded, Recovering, Succeeded, Failed or Rebalanced.",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: Reason | None = Field(None, description="Why, as one CamelCase word (for example NodeNotReady).")
    message: str | None = Field(None, max_length=4096, description="Why, for humans.")
    last_transition_time: Timestamp | None = Field(None, description="When status last changed.")
    observed_generation: int | None = Field(
        None, ge=0, le=MAX_INT, description="metadata.generation of the spec this condition was computed from.",
    )


class Failure(StatusModel):
    """A failure of a replica."""

    reason: Reason = Field(description="Kind of failure as one CamelCase word (for example PodFailed, NodeNotReady).")
    message: str | None = Field(None, max_length=4096, description="What happened, for humans.")
    time: Timestamp | None = Field(None, description="When the failure was detected.")


class ReplicaStatus(StatusModel):
    """Observed state of one data-parallel replica."""

    id: int = Field(ge=0, le=MAX_REPLICAS - 1, description="Replica index, 0 to replicas - 1.")
    generation: int = Field(
        0, ge=0, le=MAX_GENERATION, description="Incarnation of the replica; each replacement increments it.",
    )
    state: ReplicaPhase = Field(ReplicaPhase.PENDING, description="Pending, Running, Replacing, Succeeded or Failed.")
    nodes: list[NodeNameItem] = Field(
        default_factory=list, max_length=MAX_NODES_PER_REPLICA,
        description="Nodes of the replica's pods, by node rank.",
    )
    restarts: int = Field(0, ge=0, le=MAX_COUNT, description="Times this replica was replaced.")
    last_failure: Failure | None = Field(None, description="The replica's most recent failure.")
    reason: Reason | None = Field(
        None,
        description=(
            "What keeps the replica from running, as one CamelCase word, while something does: ImagePullFailed "
            "(the kubelet cannot pull an image of one of its pods; it keeps retrying, and the pod is left alone)."
        ),
    )
    message: str | None = Field(
        None, max_length=1024,
        description="What keeps the replica from running, for humans (pod, container, image, the kubelet's reason).",
    )


class SpareStatus(StatusModel):
    """Observed state of one hot spare replica (pods kept running to take over a failed replica)."""

    id: int = Field(ge=0, le=MAX_REPLICAS - 1, description="Spare index, 0 to spareReplicas - 1.")
    generation: int = Field(
        0, ge=0, le=MAX_GENERATION,
        description="Incarnation of the spare; it increments when the spare is promoted or its pods are replaced.",
    )
    state: SpareState = Field(SpareState.PENDING, description="Ready (every pod running, can take over) or Pending.")
    nodes: list[NodeNameItem] = Field(
        default_factory=list, max_length=MAX_NODES_PER_REPLICA,
        description="Nodes of the spare's pods, by node rank.",
    )
    last_failure: Failure | None = Field(None, description="Why the spare's pods were last replaced, if they were.")


class ExcludedNode(StatusModel):
    """A node that this job's pods avoid after a hardware-class failure on it."""

    name: NodeName = Field(description="Name of the node.")
    reason: Reason = Field(description="The failure that excluded it, as one CamelCase word.")
    time: Timestamp | None = Field(None, description="When the node was excluded.")


Blame = Literal["Replica", "Node"]


class Verdict(StatusModel):
    """The coordinator's request that one incarnation of a replica be replaced."""

    cel_rules = (
        Rule(
            "self.blame != 'Node' || has(self.nodeRank)",
            "nodeRank must be set when blame is Node: it names the node to exclude",
            lambda v: v.blame != "Node" or v.node_rank is not None,
            ".nodeRank",
        ),
    )

    replica: int = Field(ge=0, le=MAX_REPLICAS - 1, description="The replica to replace.")
    generation: int = Field(
        ge=0, le=MAX_GENERATION,
        description="The incarnation the verdict is about; a newer one (already replaced) is left alone.",
    )
    reason: Reason = Field(description="What was found, as one CamelCase word (for example Hang, FailSlow).")
    message: str | None = Field(None, max_length=1024, description="What was found, for humans.")
    blame: Blame = Field(
        "Replica",
        description=(
            "Replica: replace the replica. Node: also treat the node of pod nodeRank as faulty "
            "(spec.faultTolerance.nodeExclusionPolicy)."
        ),
    )
    node_rank: int | None = Field(
        None, ge=0, le=MAX_NODES_PER_REPLICA - 1, description="The pod (node rank) whose node is blamed.",
    )
    rank: int | None = Field(
        None, ge=0, le=MAX_RANKS_PER_REPLICA - 1,
        description=(
            "The replica's rank to blame, where the evidence names one: for a Hang, the rank the others waited "
            "for (it entered fewer collectives; the message gives the counts)."
        ),
    )
    time: Timestamp | None = Field(None, description="When the verdict was reached.")


class DuplicateData(StatusModel):
    """Ranks that trained on identical inputs at one step (a warning: nothing is restarted)."""

    step: int = Field(ge=0, le=MAX_STEP, description="The first step whose inputs showed it.")
    replicas: list[Annotated[int, Field(ge=0, le=MAX_REPLICAS - 1, description="A replica id.")]] = Field(
        default_factory=list, max_length=MAX_REPLICAS,
        description="The replicas whose ranks trained on those identical inputs (one: ranks of that replica).",
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    message: str | None = Field(None, max_length=1024, description="Who, at which step, and how to fix the script.")


SharePercent = Annotated[int, Field(ge=1, le=400, description="A replica's share, in percent.")]


class OomKills(StatusModel):
    """The OOM kills of one replica's workers that its launchers reported (each restarted in place)."""

    replica: int = Field(ge=0, le=MAX_REPLICAS - 1, description="The replica.")
    generation: int = Field(ge=0, le=MAX_GENERATION, description="The incarnation the last kill was in.")
    count: int = Field(ge=1, le=MAX_INT,
                       description="Kills reported since the coordinator started, every generation's.")
    time: Timestamp | None = Field(None, description="When the last one was reported.")
    message: str | None = Field(
        None, max_length=1024,
        description="The last report, for example \"worker rank 0 was OOMKilled (memory limit 3Gi)\".",
    )


class TrainingProgress(StatusModel):
    """Training progress, written by the job's coordinator (a job's user cannot write status)."""

    step: int | None = Field(None, ge=0, le=MAX_STEP, description="Last optimizer step committed by the replicas.")
    completed_step: int | None = Field(
        None, ge=0, le=MAX_STEP,
        description=(
            "Set once a replica committed the job's last step (or its script ended the job): "
            "training is complete. Worker pods that exit before it are failures."
        ),
    )
    verdicts: list[Verdict] = Field(
        default_factory=list, max_length=MAX_REPLICAS,
        description="Replica incarnations the coordinator wants replaced; the operator acts on them.",
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    last_checkpoint: int | None = Field(
        None, ge=0, le=MAX_STEP,
        description="Step of the last committed checkpoint (the directory step-<N>/ under spec.checkpoint.uri).",
    )
    last_checkpoint_time: Timestamp | None = Field(None, description="When the last checkpoint was committed.")
    checkpoint_trouble: str | None = Field(
        None, max_length=2048,
        description=(
            "Set while replicas' checkpoint writers fail and retry (the storage unreachable, a bucket "
            "refused): what each says it fails at, its words quoted after its id and entries separated "
            "by '; ', as 'replica 0: \"writing part 0 of step 40: ClientConnectorError\"' (a replica's "
            "words hold no double quote and no ';': they cannot read as another replica's). Training "
            "goes on meanwhile and lastCheckpoint ages; removed once their writes go through again."
        ),
    )
    goodput: str | None = Field(
        None, max_length=5, pattern=r"^(0(\.[0-9]{1,3})?|1(\.0{1,3})?)$",
        description=(
            "Fraction of the job's time spent on steps that were kept, as a decimal string "
            "from \"0\" to \"1.000\" with at most three decimals (for example \"0.930\")."
        ),
    )
    batch_share_percent: list[SharePercent] | None = Field(
        None, max_length=MAX_REPLICAS,
        description=(
            "Each replica's share of the global batch, in percent of the nominal one (the index is the "
            "replica), while a slow replica is rebalanced (spec.detection.slowAction Rebalance); absent "
            "when every replica has its nominal share. A replica outside the quorum takes no samples and "
            "shows 100, the share it takes when it rejoins."
        ),
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    diverged: str | None = Field(
        None, max_length=1024,
        description=(
            "Set when replicas that must hold the same parameters and optimizer state do not, and no "
            "majority says which is right: the coordinator stopped the job (its replicas raise Diverged) "
            "and no checkpoint was assembled from them. The Diverged condition says so too."
        ),
    )
    duplicate_data: DuplicateData | None = Field(
        None,
        description=(
            "Set when ranks trained on identical inputs (every replica seeded by ctx.rank alone, say): the "
            "job trains on a fraction of its data. A warning from the coordinator; nothing acts on it."
        ),
    )
    oom_kills: list[OomKills] = Field(
        default_factory=list, max_length=MAX_REPLICAS,
        description=(
            "Per replica, the OOM kills of its workers that its launchers reported and restarted in place "
            "(a pod's own OOMKilled end is in status.replicas[].lastFailure)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    update_time: Timestamp | None = Field(None, description="When the coordinator last wrote this.")


class RestartRecord(StatusModel):
    """One replacement of a replica within spec.faultTolerance.restartWindowSeconds."""

    replica: int = Field(ge=0, le=MAX_REPLICAS - 1, description="The replica that was replaced.")
    generation: int = Field(ge=0, le=MAX_GENERATION, description="The incarnation that failed.")
    time: int = Field(ge=0, le=MAX_INT, description="When its failure was seen, in unix seconds.")
    node: NodeName | None = Field(None, description="The node of its pod that failed first, if any.")
    reason: Reason | None = Field(None, description="Why it failed, as one CamelCase word (lastFailure.reason).")


MAX_RESTART_HISTORY = MAX_RESTARTS + MAX_REPLICAS  # the limit, plus the failures of the pass that exceeds it


class TrainingJobStatus(StatusModel):
    """Observed state of a TrainingJob, written by the operator (training: by the coordinator)."""

    observed_generation: int | None = Field(
        None, ge=0, le=MAX_INT, description="metadata.generation of the last spec the operator acted on.",
    )
    state: JobState | None = Field(
        None,
        description=(
            "Summary: Pending, Running, Degraded, Recovering, Succeeded, Failed, Suspended or Queued "
            "(waiting for Kueue). Conditions carry the details."
        ),
    )
    healthy: str | None = Field(
        None, max_length=11, pattern=r"^[0-9]{1,5}/[0-9]{1,5}$",
        description="Healthy replicas out of spec.replicas, as \"3/4\" (for kubectl get).",
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16,
        description="Ready, Degraded, Recovering, Succeeded, Failed and Rebalanced, at most one of each type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    healthy_replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS, description="Replicas with every pod running.")
    ready_spare_replicas: int | None = Field(
        None, ge=0, le=MAX_REPLICAS, description="Spare replicas ready to take over.",
    )
    total_restarts: int | None = Field(
        None, ge=0, le=MAX_COUNT, description="Replica replacements since the job started.",
    )
    replicas: list[ReplicaStatus] = Field(
        default_factory=list, max_length=MAX_REPLICAS, description="Per-replica state, by replica id.",
        # Atomic, not a map keyed by id: only the operator writes it, and a map list makes the API
        # server track every field of every entry in managedFields (29 KB for 250 replicas),
        # which made each status write of a large job 1.5-2x slower (docs/benchmarks.md).
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    spares: list[SpareStatus] = Field(
        default_factory=list, max_length=MAX_REPLICAS, description="Per-spare state, by spare id.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    restart_history: list[RestartRecord] = Field(
        default_factory=list, max_length=MAX_RESTART_HISTORY,
        description=(
            "Replacements within restartWindowSeconds, oldest first: what maxReplicaRestarts, the "
            "backoff and the repeated-failures rule count. Kept in status so only the operator writes it."
        ),
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    excluded_nodes: list[ExcludedNode] = Field(
        default_factory=list, max_length=1024,
        description="Nodes that this job's new pods avoid (see spec.faultTolerance.nodeExclusionPolicy).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    training: TrainingProgress | None = Field(None, description="Training progress, written by the coordinator.")
