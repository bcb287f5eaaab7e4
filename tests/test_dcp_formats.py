"""A checkpoint read with the other implementation's reader says who wrote it and which reader to use."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from foresight.checkpoint import ForesightStorageReader, ForesightStorageWriter
from foresight.errors import CheckpointError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STATE = {"w": torch.arange(6.0), "step": 3}


def target() -> dict:
    return {"w": torch.zeros(6), "step": 0}


def test_foresight_reader_on_a_pytorch_checkpoint_names_pytorch_reader(tmp_path):
    dcp.save(STATE, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    with pytest.raises((CheckpointError, CheckpointException),
                       match=r"written by PyTorch's torch.distributed.checkpoint.FileSystemWriter, not "
                             r"foresight.checkpoint.ForesightStorageWriter: load it with "
                             r"torch.distributed.checkpoint.FileSystemReader\(path\)"):
        dcp.load(target(), storage_reader=ForesightStorageReader(tmp_path), no_dist=True)


@pytest.mark.parametrize("how", ["FileSystemReader", "checkpoint_id"])
def test_pytorch_reader_on_a_foresight_checkpoint_names_foresight_reader(tmp_path, how):
    dcp.save(STATE, storage_writer=ForesightStorageWriter(tmp_path), no_dist=True)
    # DCP's storage detection offers FileSystemReader for any directory and no way to register another
    kwargs = ({"storage_reader": FileSystemReader(tmp_path)} if how == "FileSystemReader"
              else {"checkpoint_id": tmp_path})
    with pytest.raises((CheckpointError, CheckpointException),
                       match=r"written by foresight.checkpoint.ForesightStorageWriter; PyTorch's FileSystemReader "
                             r"cannot read it: load it with storage_reader=foresight.checkpoint."
                             r"ForesightStorageReader\(path\)"):
        dcp.load(target(), no_dist=True, **kwargs)
    # its metadata is plain DCP metadata: tools that only list keys still work
    assert set(FileSystemReader(tmp_path).read_metadata().state_dict_metadata) == {"w", "step"}


def test_empty_state_dict_round_trips(tmp_path):
    # PyTorch's writer and reader accept an empty state dict; so must foresight's
    dcp.save({}, storage_writer=ForesightStorageWriter(tmp_path), no_dist=True)
    dcp.load({}, storage_reader=ForesightStorageReader(tmp_path), no_dist=True)
