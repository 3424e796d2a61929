"""The per-job coordinator: membership, per-step quorum, heartbeats (see membership.py)."""
