"""Asynchronous, tiered, atomically committed checkpoints with fast restore.

``save`` snapshots a (nested) state dict into a pinned staging pool and returns at once; a background
writer packs thousands of tensors into one aligned data file, checksums each tensor (xxh3), commits the
step directory atomically on the fastest tier and drains it to slower tiers, keeping ``keep`` per tier.
``load`` restores from the fastest tier holding a complete copy, in place into existing tensors.
A slower tier may be a bucket (``s3://bucket/prefix``: multipart uploads, COMMIT last; see :mod:`.bucket_tier`).
``ForesightStorageWriter``/``ForesightStorageReader`` plug the same writer into torch.distributed.checkpoint
(local paths or ``s3://``);
``export_safetensors`` converts a checkpoint for other tools.

Example::

    import foresight.checkpoint as fc

    ckpt = fc.Checkpointer(["/nvme/ckpt", "/shared/ckpt"], keep=[2, 5])
    h = ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, step,
                  extra_state=loader.state_dict())
    ...
    state = ckpt.load("latest", into={"model": model.state_dict(), "optim": opt.state_dict()})
"""
from foresight.checkpoint.checkpointer import Checkpointer, save
from foresight.checkpoint.loading import LoadedCheckpoint, latest_step, load
from foresight.checkpoint.save_handle import SaveHandle
from foresight.checkpoint.tier_drain import copy_checkpoint
from foresight.checkpoint.staging import StagingPool
from foresight.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ForesightStorageReader",
    "ForesightStorageWriter",
    "LoadedCheckpoint",
    "SaveHandle",
    "StagingPool",
    "copy_checkpoint",
    "export_safetensors",
    "latest_step",
    "load",
    "save",
]


def __getattr__(name: str):  # the DCP adapter and the exporter import heavier modules: load them on use
    if name == "ForesightStorageWriter":
        from foresight.checkpoint.dcp import ForesightStorageWriter  # lazy: torch.distributed.checkpoint is heavy

        return ForesightStorageWriter
    if name == "ForesightStorageReader":
        from foresight.checkpoint.dcp_reader import ForesightStorageReader  # lazy: as the writer

        return ForesightStorageReader
    if name == "export_safetensors":
        from foresight.checkpoint.export import export_safetensors  # lazy: safetensors, loaded on use

        return export_safetensors
    raise AttributeError(name)
