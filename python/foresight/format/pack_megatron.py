"""Convert a Megatron-LM indexed dataset (``prefix.idx``/``prefix.bin``) into foresight shards.

Foresight reads Megatron datasets in place (:class:`MegatronDataset`); converting adds per-sample checksums,
aligned starts and sharding. Sequences are copied in batches straight from the memory-mapped ``.bin`` (one slice per
batch when the sequences are stored back to back, as Megatron writes them). When documents span several sequences,
or the index carries modes, each sample's meta records ``document`` (and ``mode``) so nothing is lost.

Example::

    pack_megatron("data/wiki_text_document", "out/")
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import FormatError
from .megatron import MegatronDataset
from .types import TOKEN_DTYPES, Modality
from .writer import DatasetWriter

__all__ = ["pack_megatron"]


def pack_megatron(prefix: str | os.PathLike, out: str | os.PathLike, *, align: int = 0, shard_bytes: int = 1 << 30,
                  overwrite: bool = False, progress: bool = True, batch_tokens: int = 16 << 20) -> str:
    """Convert the Megatron dataset at ``prefix`` into a foresight dataset at ``out``; returns its path."""
    src = MegatronDataset(prefix)
    if src.token_dtype.name not in TOKEN_DTYPES:
        raise FormatError(f"Megatron dtype {src.token_dtype.name} is not a token dtype ({TOKEN_DTYPES})",
                          path=src.idx_path)
    n = src.num_samples
    keep_docs = src.sequence_modes is not None or src.num_documents != n
    docs = None
    if keep_docs:
        docs = np.repeat(np.arange(src.num_documents, dtype=np.int64), np.diff(src.document_indices))
    itemsize = src.token_dtype.itemsize
    tokens = np.memmap(src.shard_paths[0], dtype=np.uint8, mode="r") if src.bin_bytes else np.zeros(0, np.uint8)
    lengths = src.sequence_lengths.astype(np.int64)
    pointers = src.sequence_pointers
    ends = np.cumsum(lengths)
    extra = {"source": src.path, "source_format": "megatron", "megatron_fingerprint": src.fingerprint,
             "num_documents": src.num_documents}
    from tqdm.auto import tqdm

    with DatasetWriter(out, align=align, shard_bytes=shard_bytes, token_dtype=src.token_dtype, overwrite=overwrite,
                       extra=extra) as w, tqdm(total=n, desc=f"pack {os.path.basename(src.path)}", unit="seq",
                                               unit_scale=True, disable=not progress, dynamic_ncols=True) as bar:
        a = 0
        while a < n:
            # Take sequences until about batch_tokens tokens (at least one).
            b = max(a + 1, int(np.searchsorted(ends, (ends[a - 1] if a else 0) + batch_tokens, side="right")))
            b = min(b, n)
            ptr, lens = pointers[a:b], lengths[a:b]
            contiguous = bool((ptr[1:] == ptr[:-1] + lens[:-1] * itemsize).all())
            if contiguous:
                raw = tokens[int(ptr[0]) : int(ptr[0]) + int(lens.sum()) * itemsize]
            else:  # rare: gaps or reordering in the .bin; gather sequence by sequence
                raw = np.concatenate([tokens[int(p) : int(p) + int(k) * itemsize] for p, k in zip(ptr, lens)] or
                                     [np.zeros(0, np.uint8)])
            meta = None
            if keep_docs:
                meta = [{"document": int(d)} for d in docs[a:b]]
                if src.sequence_modes is not None:
                    for m, mode in zip(meta, src.sequence_modes[a:b].tolist()):
                        m["mode"] = mode
            w.add_many(np.ascontiguousarray(raw).view(src.token_dtype), lens, modality=Modality.TOKENS, meta=meta)
            bar.update(b - a)
            a = b
    return os.path.abspath(os.fspath(out))
