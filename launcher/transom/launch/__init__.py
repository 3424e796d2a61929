"""The launcher: worker supervision in a pod (supervisor.py) and local mode (local.py)."""
