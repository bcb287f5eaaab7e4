"""Load a DCP ``.metadata`` pickle without letting it run code.

A DCP checkpoint's ``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``, and a pickle
can call any importable function while it loads (``os.system``, ``builtins.eval``, ...). Replicas arrive from
other hosts and tools read checkpoints they did not write, so every ``.metadata`` is loaded here: the unpickler
resolves only the globals a real Metadata pickle refers to and refuses anything else before calling it.

The allow-list is what torch 2.13's ``dcp.save`` writes (found by recording ``find_class`` while loading the
metadata of model + optimizer state dicts, DTensors, bytes items, quantized and channels-last tensors, saved with
PyTorch's ``FileSystemWriter`` and foresight's writers): the metadata dataclasses, the two storage-info classes,
``torch.Size``, dtypes, and the helpers ``TensorProperties`` pickles its layout and memory format with. Each of
them only builds a value from plain data.

Example::

    from foresight.checkpoint.safe_pickle import load_dcp_metadata

    with open(path, "rb") as f:
        metadata = load_dcp_metadata(f, source=path)
"""
from __future__ import annotations

import io
import pickle
from typing import IO, Any

from foresight.errors import CheckpointError

_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "ChunkStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # PyTorch's FileSystemWriter
    ("foresight.checkpoint.dcp", "ForesightStorageInfo"),  # foresight's writers
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # TensorProperties.layout: a lookup by name ("torch.strided")
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of FileSystemWriter
})


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":  # dtypes (torch.bfloat16, ...), layouts, memory formats: values, not callables
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CheckpointError(f"refused to unpickle DCP metadata: it refers to {module}.{name}, which a DCP "
                              f"metadata file never needs (a foreign writer's class, or a malicious file)",
                              path=self.source)


def load_dcp_metadata(data: bytes | bytearray | memoryview | IO[bytes], *, source: str) -> Any:
    """The ``Metadata`` pickled in ``data`` (bytes or a binary file), refusing any global DCP does not write.

    ``source`` names the file in errors. Raises :class:`~foresight.errors.CheckpointError` for a refused
    global, a truncated or corrupt pickle, or a pickle of something other than ``Metadata``.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    file = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        metadata = _MetadataUnpickler(file, source).load()
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or garbled pickle raises many types (EOFError, UnpicklingError, ...)
        raise CheckpointError(f"DCP metadata is truncated or corrupt: {type(e).__name__}: {e}", path=source) from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"DCP metadata holds a {type(metadata).__name__}, not a "
                              f"torch.distributed.checkpoint Metadata", path=source)
    return metadata


__all__ = ["load_dcp_metadata"]
