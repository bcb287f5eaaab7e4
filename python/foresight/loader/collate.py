"""Collate one step's token pieces into training rows, and derive positions and document boundaries.

Every item of a token plan is ``seq_len + 1`` tokens made of a few pieces, so the pieces of a step, in plan
order, fill ``rows.ravel()`` exactly. One gather pass copies them from the transfer buffer into the rows (the
only copy on the token path); ``input_ids``/``labels`` are then views ``rows[:, :-1]`` / ``rows[:, 1:]``.

Example::

    rows = np.empty((n_items, seq_len + 1), np.uint16)
    gather_tokens(region, x_dest, piece_tokens, rows)
"""
from __future__ import annotations

import numpy as np

from foresight._native import load

_core = load("_core")


def gather_tokens(region: np.ndarray, x_dest: np.ndarray, piece_tokens: np.ndarray, rows: np.ndarray, *,
                  piece_dataset: np.ndarray | None = None, dataset_dtypes: list[np.dtype] | None = None) -> None:
    """Copy each piece ``region[x_dest[p] : x_dest[p] + piece_tokens[p] * itemsize]`` into ``rows`` in order.

    ``region`` is the uint8 transfer buffer and ``rows`` a C-contiguous array. When every piece has the rows'
    dtype this is one native byte gather; datasets of a narrower token dtype (a mixture of uint16 and uint32
    datasets) are gathered per dataset and widened into their positions.
    """
    flat = rows.reshape(-1)
    if int(piece_tokens.sum()) != flat.size:
        raise ValueError(f"pieces hold {int(piece_tokens.sum())} tokens, rows need {flat.size}")
    x_dest = np.ascontiguousarray(x_dest, dtype=np.int64)
    if dataset_dtypes is None or all(np.dtype(d) == rows.dtype for d in dataset_dtypes):
        # Pieces are packed back to back: exactly the row-major order of ``rows``. GIL released inside.
        _core.gather(region, x_dest, np.ascontiguousarray(piece_tokens * rows.itemsize, dtype=np.int64),
                     flat.view(np.uint8))
        return
    starts = np.zeros(len(piece_tokens), dtype=np.int64)
    np.cumsum(piece_tokens[:-1], out=starts[1:])
    for d in np.unique(piece_dataset):
        dtype = np.dtype(dataset_dtypes[int(d)])
        mask = piece_dataset == d
        counts = piece_tokens[mask]
        scratch = np.empty(int(counts.sum()), dtype=dtype)
        _core.gather(region, x_dest[mask], np.ascontiguousarray(counts * dtype.itemsize), scratch.view(np.uint8))
        # Destination of every token of this dataset's pieces, in order.
        first = np.repeat(starts[mask] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
        flat[first + np.arange(scratch.size)] = scratch


def document_boundaries(item_ptr: np.ndarray, piece_tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """``cu_seqlens`` over the flattened ``input_ids`` (B * seq_len): int32, starts at 0, ends at B * seq_len.

    Each row restarts at 0; a boundary falls wherever one document's piece ends inside the row.
    """
    n_items = len(item_ptr) - 1
    row_of_piece = np.repeat(np.arange(n_items, dtype=np.int64), np.diff(item_ptr))
    ends = np.cumsum(piece_tokens)
    # Position of each piece's end inside its row (rows are seq_len + 1 long in the piece stream).
    end_in_row = ends - row_of_piece * (seq_len + 1)
    end_in_row = np.minimum(end_in_row, seq_len)  # the overlap token belongs to labels only
    bounds = row_of_piece * seq_len + end_in_row
    starts = np.arange(n_items + 1, dtype=np.int64) * seq_len
    cu = np.unique(np.concatenate([starts, bounds]))
    return cu.astype(np.int32)


def position_ids(cu_seqlens: np.ndarray, total: int) -> np.ndarray:
    """Positions that restart at every document boundary: ``arange(total) - start_of_its_document``."""
    lengths = np.diff(cu_seqlens.astype(np.int64))
    starts = np.repeat(cu_seqlens[:-1].astype(np.int64), lengths)
    return (np.arange(total, dtype=np.int64) - starts).astype(np.int64)


__all__ = ["gather_tokens", "document_boundaries", "position_ids"]
