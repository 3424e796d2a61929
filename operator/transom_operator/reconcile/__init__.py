"""Pure reconcile decisions: desired actions and status from the spec and the observed world.

Nothing here performs I/O. `observe` reduces raw pods and nodes to the facts that matter,
`failures` decides whether an incarnation of a replica has failed and whom to blame, and
`replicas.plan` turns a TrainingJob and what was observed into the pods to create and
delete, the nodes to exclude, the Events to emit and the status to write (the job-level
state and conditions in `job_status`, hot spares in `spares`; `status_diff` makes the
status write as small as what changed). `kube.py`
carries the plan out; running the same world through `plan` twice asks for nothing new.
"""
