"""Transom imports and finds what it needs on every supported torch (transom/compat.py).

Part of the `make test-compat` smoke subset, which runs it on the oldest supported torch.
"""

import importlib
import pkgutil

import pytest
import torch

import transom
from transom import compat

pytestmark = pytest.mark.compat


def test_this_torch_is_supported():
    assert compat.torch_version() >= compat.MIN_TORCH, torch.__version__


def test_every_module_of_transom_imports():
    names = [m.name for m in pkgutil.walk_packages(transom.__path__, "transom.")]
    assert "transom.checkpoint.persist" in names and "transom.ft.trainer" in names
    for name in names:
        if name == "transom.__main__":
            continue  # runs the CLI
        importlib.import_module(name)


def test_dcp_reader_and_writer_are_found(tmp_path):
    assert type(compat.fsspec_writer(str(tmp_path))).__name__ == "FsspecWriter"
    assert type(compat.fsspec_reader(str(tmp_path))).__name__ == "FsspecReader"


def test_dcp_async_save_and_load_without_a_process_group(tmp_path):
    state = {"w": torch.arange(6, dtype=torch.float32)}
    future = compat.dcp_async_save(state, storage_writer=compat.fsspec_writer(str(tmp_path)))
    (future.upload_completion if hasattr(future, "upload_completion") else future).result(timeout=60)
    back = {"w": torch.zeros(6)}
    compat.dcp_load(back, str(tmp_path))
    assert torch.equal(back["w"], state["w"])
