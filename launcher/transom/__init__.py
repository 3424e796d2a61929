"""Transom: fault-tolerant training of large PyTorch models.

Importing `transom` needs neither torch nor kopf nor kubernetes; only `transom.ft` (and
the modules that train) import torch.
"""

__version__ = "0.1.0"
