"""Asynchronous checkpoints: snapshot to host memory, persist in the background, restore.

`CheckpointEngine` (engine.py) is the entry point; `restore.load_latest` reads back the
newest complete checkpoint; `export.export` writes one as a plain PyTorch file (`transom
checkpoint export`). Needs torch and fsspec (the `train` and `s3` extras); the rest of
`transom` does not import this package, except `cli.py` (that command's arguments), which
imports nothing heavy.
"""
