"""Convert a Megatron-LM indexed dataset (``prefix.idx``/``prefix.bin``) into foresight shards.

Foresight reads Megatron datasets in place (:class:`MegatronDataset`); converting adds per-sample checksums,
aligned starts and sharding. An inconsistent ``.idx``/``.bin`` pair is refused on open (see
:mod:`foresight.format.megatron`), so the sequences are known to lie back to back and each batch is copied as one
slice of the memory-mapped ``.bin``.
When documents span several sequences, or the index carries modes, each sample's meta records ``document`` (and
``mode``) so nothing is lost.

Example::

    pack_megatron("data/wiki_text_document", "out/")
"""
from __future__ import annotations

import os

import numpy as np

from ...errors import FormatError
from ..megatron import MegatronDataset
from ..types import TOKEN_DTYPES, Modality
from ..writer import DatasetWriter
from .progress import PackProgress

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
    ends = np.cumsum(lengths)
    extra = {"source": src.path, "source_format": "megatron", "megatron_fingerprint": src.fingerprint,
             "num_documents": src.num_documents}
    with DatasetWriter(out, align=align, shard_bytes=shard_bytes, token_dtype=src.token_dtype, overwrite=overwrite,
                       extra=extra) as w, PackProgress(n, f"pack {os.path.basename(src.path)}", progress, "seq") as bar:
        a = 0
        while a < n:
            # Take sequences until about batch_tokens tokens (at least one).
            b = max(a + 1, int(np.searchsorted(ends, (ends[a - 1] if a else 0) + batch_tokens, side="right")))
            b = min(b, n)
            lens = lengths[a:b]
            start = int(src.sequence_pointers[a])  # == (ends[a - 1] if a else 0) * itemsize: checked on open
            raw = tokens[start : start + int(lens.sum()) * itemsize]
            meta = None
            if keep_docs:
                meta = [{"document": int(d)} for d in docs[a:b]]
                if src.sequence_modes is not None:
                    for m, mode in zip(meta, src.sequence_modes[a:b].tolist()):
                        m["mode"] = mode
            w.add_many(np.ascontiguousarray(raw).view(src.token_dtype), lens, modality=Modality.TOKENS, meta=meta)
            bar.advance(b - a)
            a = b
    return os.path.abspath(os.fspath(out))
