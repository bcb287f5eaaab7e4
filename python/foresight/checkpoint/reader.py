"""Restore: read a committed checkpoint into page-aligned memory, verify, hand out tensors.

The data file is read with large parallel O_DIRECT requests into one page-aligned buffer; every tensor's
xxh3 is checked against the index (a mismatch raises :class:`CheckpointError` naming the file, the tensor
and its offset); tensors are then zero-copy views of that buffer, or are copied into the caller's tensors
in place (see :func:`foresight.checkpoint.state_tree.restore_into`).

Example::

    tensors, index = read_checkpoint("/ckpt/step-00000100")
    problem = verify_uncommitted("/ckpt/step-00000200")  # None: index and data agree (COMMIT lost)
"""
from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from foresight.checkpoint import store
from foresight.checksum import xxh3_many
from foresight.checkpoint.aligned_io import FileIO
from foresight.checkpoint.layout import align_up, dtype_from_name
from foresight.errors import CheckpointError

_default_fio: FileIO | None = None


def default_fileio() -> FileIO:
    global _default_fio
    if _default_fio is None:
        _default_fio = FileIO()
    return _default_fio


def _alloc(nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(nbytes, 1), flags=flags)


SEGMENT = 64 << 20  # verification and copy-out of one segment overlap the reads of the next ones


def read_checkpoint(path: str, *, verify: bool = True, fio: FileIO | None = None, direct: bool = True,
                    buffer: torch.Tensor | None = None,
                    targets: Callable[[dict[str, Any]], dict[int, torch.Tensor]] | None = None,
                    segment: int = SEGMENT) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Read the committed checkpoint directory ``path``; return (tensors in index order, index).

    All reads are submitted at once; as each ``segment`` of the file lands, the tensors that end in it
    are verified and, when ``targets(index)`` maps their index to an existing tensor, copied into it, so
    checksumming and copying overlap the I/O. ``buffer`` (a page-aligned uint8 tensor, e.g. a staging
    slot) receives a single-file checkpoint that fits in it instead of freshly allocated memory; the
    tensors returned are views of the read buffer. On a CheckpointError, ``targets`` may be partly filled.
    """
    fio = fio or default_fileio()
    index = store.read_index(path)
    cols = index["tensors"]
    files = index["files"]
    offsets, nbytes, file_ids, expected, dtypes = index_columns(index, os.path.join(path, store.INDEX))
    wanted = targets(index) if targets is not None else None
    buffers: list[torch.Tensor] = []
    for f in files:
        nb = int(f["bytes"])
        if buffer is not None and len(files) == 1 and buffer.numel() >= nb:
            buffers.append(buffer)
        else:
            buffers.append(torch.frombuffer(_alloc(align_up(nb)), dtype=torch.uint8))
    tensors = tensor_views(buffers, index, file_ids, offsets, nbytes, dtypes, path)
    for fi, f in enumerate(files):
        fpath = os.path.join(path, f["name"])
        size_needed = int(f["bytes"])
        try:
            size = os.stat(fpath).st_size
        except OSError as e:
            raise CheckpointError(f"data file missing: {e.strerror}", path=fpath) from e
        if size < size_needed:
            raise CheckpointError("data file is truncated", path=fpath, expected=size_needed, size=size)
        sel = np.flatnonzero(file_ids == fi)
        last_seg = np.maximum(offsets[sel] + nbytes[sel] - 1, offsets[sel]) // segment
        order = np.argsort(last_seg, kind="stable")
        sel, last_seg = sel[order], last_seg[order]
        mv = memoryview(buffers[fi].numpy())
        fd, _ = fio.open(fpath, direct=direct)
        tokens = [fio.submit_read(fd, mv[s:min(s + segment, size_needed)], file_offset=s, path=fpath)
                  for s in range(0, size_needed, segment)]
        # a driver thread reaps completions (keeping the device queue full) while this thread verifies and
        # copies out the segments that have landed
        landed = [threading.Event() for _ in tokens]
        failures: list[BaseException | None] = [None] * len(tokens)

        def drive() -> None:
            for k, tok in enumerate(tokens):
                try:
                    fio.wait(tok)
                except BaseException as e:  # noqa: BLE001 - handed to the consuming thread
                    failures[k] = e
                landed[k].set()

        driver = threading.Thread(target=drive, name="foresight-ckpt-read", daemon=True)
        driver.start()
        try:
            bounds = np.searchsorted(last_seg, np.arange(len(tokens) + 1), side="left")
            bounds[-1] = len(sel)
            for k in range(len(tokens)):
                landed[k].wait()
                if failures[k] is not None:
                    raise failures[k]
                ids = sel[bounds[k]:bounds[k + 1]]
                if len(ids):
                    verify_and_copy(ids, mv, offsets, nbytes, expected, tensors, wanted, verify, fpath, cols["name"])
        finally:
            driver.join()  # never free memory with reads still in flight into it
            os.close(fd)
    return tensors, index


def index_columns(index: dict[str, Any], index_path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                   list[torch.dtype]]:
    """The index's per-tensor columns: offsets, byte counts, file numbers, xxh3 sums (arrays) and dtypes."""
    cols = index["tensors"]
    try:
        offsets = np.asarray(cols["offset"], dtype=np.int64)
        nbytes = np.asarray(cols["nbytes"], dtype=np.int64)
        file_ids = np.asarray(cols["file"], dtype=np.int64)
        expected = np.array([int(h, 16) for h in cols["xxh3"]], dtype=np.uint64)
        dtypes = [dtype_from_name(dt) for dt in cols["dtype"]]
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"index is malformed: {e}", path=index_path) from e
    return offsets, nbytes, file_ids, expected, dtypes


def tensor_views(buffers: list[torch.Tensor], index: dict[str, Any], file_ids: np.ndarray, offsets: np.ndarray,
                 nbytes: np.ndarray, dtypes: list[torch.dtype], path: str) -> list[torch.Tensor]:
    """Every tensor of the index as a view of its data file's buffer (``buffers[file]`` holds the file's bytes)."""
    tensors = []
    for fi, o, n, dt, shape in zip(file_ids.tolist(), offsets.tolist(), nbytes.tolist(), dtypes,
                                   index["tensors"]["shape"]):
        try:
            tensors.append(buffers[fi][o:o + n].view(dt).view(shape))
        except (RuntimeError, IndexError) as e:
            raise CheckpointError(f"index entry is inconsistent: {e}", path=path, offset=o, dtype=str(dt)) from e
    return tensors


def verify_and_copy(ids: np.ndarray, mv: memoryview, offsets: np.ndarray, nbytes: np.ndarray, expected: np.ndarray,
             tensors: list[torch.Tensor], targets: dict[int, torch.Tensor] | None, verify: bool, fpath: str,
             names: list[str]) -> None:
    """Verify the tensors ``ids`` (all read by now) and copy those with a target into it."""
    if verify:
        got = xxh3_many(mv, offsets[ids], nbytes[ids])
        bad = ids[got != expected[ids]]
        if len(bad):
            i = int(bad[0])
            raise CheckpointError("tensor checksum mismatch: data file is corrupt", path=fpath, tensor=names[i],
                                  offset=int(offsets[i]), nbytes=int(nbytes[i]), corrupt_tensors=len(bad))
    if targets:
        pairs = [(targets[i], tensors[i]) for i in ids.tolist() if i in targets]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def verify_uncommitted(path: str) -> str | None:
    """Check a step directory whose COMMIT marker is missing: its index parses and every tensor's bytes
    match their checksum in it. Return ``None`` when everything verifies, else what did not."""
    index_path = os.path.join(path, store.INDEX)
    try:
        with open(index_path, "rb") as f:
            index = store.parse_index(f.read(), index_path)
        cols = index["tensors"]
        offsets = np.asarray(cols["offset"], dtype=np.int64)
        nbytes = np.asarray(cols["nbytes"], dtype=np.int64)
        file_ids = np.asarray(cols["file"], dtype=np.int64)
        expected = np.array([int(h, 16) for h in cols["xxh3"]], dtype=np.uint64)
        for fi, f in enumerate(index["files"]):
            fpath = os.path.join(path, f["name"])
            sel = np.flatnonzero(file_ids == fi)
            with open(fpath, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                needed = max(int(f["bytes"]), int((offsets[sel] + nbytes[sel]).max(initial=0)))
                if size < needed:
                    return f"{fpath} is truncated ({size} of {needed} bytes)"
                if not len(sel) or not size:
                    continue
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    bad = sel[xxh3_many(memoryview(mm), offsets[sel], nbytes[sel]) != expected[sel]]
            if len(bad):
                return f"tensor {cols['name'][int(bad[0])]!r} in {fpath} does not match its checksum"
    except CheckpointError as e:
        return str(e)
    except (OSError, KeyError, ValueError, TypeError, IndexError) as e:
        return f"{index_path}: {e}"
    return None
