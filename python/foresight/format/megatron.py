"""Megatron-LM indexed datasets (``prefix.idx`` + ``prefix.bin``), read in place, and an independent writer.

The ``.idx`` layout (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``; all little-endian)::

    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    uint64   version (1)
    uint8    dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    uint64   sequence count N
    uint64   document count D (entries of the document index, which starts with 0)
    int32    sequence lengths [N]     (tokens)
    int64    sequence pointers [N]    (byte offsets into .bin)
    int64    document indices [D]     (sequence index where each document starts; last == N)
    int8     sequence modes [N]       (only in the multimodal variant; detected here from the file size)

Each sequence is one sample; the ``.bin`` is the single shard. Every field is validated on open (sizes, ranges,
monotonic document index) with numpy over the memory-mapped index, and errors name the file and sample. The pair
must also agree the way Megatron writes it: each pointer a multiple of the item size and the running sum of the
lengths before it (sequences back to back from byte 0), and the ``.bin`` exactly as long as the last sequence's end.
So an ``.idx`` beside another dataset's ``.bin``, or with its dtype code changed to one of another width, is refused
instead of yielding wrong tokens. (A dtype changed to another of the same width, int16 for uint16, leaves every byte
where it was and cannot be told from the files.)

Example::

    write_megatron_dataset("/tmp/toy", [np.arange(5), np.arange(3)], np.uint16)
    ds = MegatronDataset("/tmp/toy")      # or open_dataset("/tmp/toy")
    ds.lookup(np.array([1]))              # Extents(shard=[0], offset=[10], length=[6])
    MegatronDataset("/tmp/toy", fingerprint="content").fingerprint   # also hashes every byte of the .bin
"""
from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from ..errors import FormatError
from foresight.checksum import file_xxh3
from .types import Dataset, Extents, Modality

__all__ = ["MEGATRON_MAGIC", "MEGATRON_DTYPES", "MegatronDataset", "write_megatron_dataset"]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in MEGATRON_DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # 34 bytes
_CHECK_BLOCK = 1 << 22  # sequences checked per numpy pass: bounds the temporaries (~100 MiB) on huge indexes
FINGERPRINTS = ("index", "content")


class MegatronDataset(Dataset):
    """A Megatron-LM ``.idx``/``.bin`` pair behind the :class:`~foresight.format.Dataset` contract, zero-copy.

    ``fingerprint``: ``"index"`` (default, instant) hashes the ``.idx`` and the ``.bin`` size, so a ``.bin`` whose
    bytes changed in place at the same size keeps the fingerprint; ``"content"`` also hashes the whole ``.bin``
    (xxh3, streamed once on first use of :attr:`fingerprint`; reads the whole file).
    """

    kind = "megatron"

    def __reduce__(self) -> tuple:
        # Mapped files do not travel between processes: reopen (and revalidate) by prefix.
        return (MegatronDataset, (self.path,))

    def __init__(self, prefix: str | os.PathLike, *, fingerprint: str = "index") -> None:
        super().__init__()
        if fingerprint not in FINGERPRINTS:
            raise ValueError(f"fingerprint must be one of {FINGERPRINTS}, got {fingerprint!r}")
        self.fingerprint_kind = fingerprint
        prefix = os.fspath(prefix)
        if prefix.endswith((".idx", ".bin")):
            prefix = prefix[:-4]
        self.path = os.path.abspath(prefix)
        self.idx_path = self.path + ".idx"
        bin_path = self.path + ".bin"
        self.shard_paths = [bin_path]
        self.align = 0
        try:
            self.bin_bytes = os.stat(bin_path).st_size
        except OSError as e:
            raise FormatError(f"Megatron .bin missing or unreadable: {e.strerror}", path=bin_path) from None
        self._parse_index()
        self.num_samples = int(self.sequence_lengths.shape[0])
        self.modalities = [Modality.TOKENS.label]
        self._bytes: np.ndarray | None = None
        self._fingerprint: str | None = None

    def _parse_index(self) -> None:
        p = self.idx_path
        try:
            with open(p, "rb") as f:
                head = f.read(_HEADER.size)
                size = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise FormatError(f"Megatron .idx missing or unreadable: {e.strerror}", path=p) from None
        if len(head) < _HEADER.size:
            raise FormatError(f"truncated .idx header: {len(head)} of {_HEADER.size} bytes", path=p, offset=0)
        magic, version, code, n, d = _HEADER.unpack(head)
        if magic != MEGATRON_MAGIC:
            raise FormatError(f"bad magic {magic!r}, expected {MEGATRON_MAGIC!r}", path=p, offset=0)
        if version != 1:
            raise FormatError(f"unsupported .idx version {version} (known: 1)", path=p, offset=9)
        if code not in MEGATRON_DTYPES:
            raise FormatError(f"unknown dtype code {code}; allowed: {sorted(MEGATRON_DTYPES)}", path=p, offset=17)
        self.token_dtype = MEGATRON_DTYPES[code]
        base = _HEADER.size + 12 * n + 8 * d  # Python ints: no overflow on absurd counts
        if size == base:
            multimodal = False
        elif size == base + n:
            multimodal = True
        else:
            raise FormatError(
                f".idx is {size} bytes but {n} sequences and {d} document entries need {base} (or {base + n} "
                f"with modes)", path=p,
            )
        if d < 1:
            raise FormatError("document index is empty (it must start with 0)", path=p, offset=base - 8 * d)
        try:
            mm = np.memmap(p, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise FormatError(f"cannot map .idx: {e}", path=p) from None
        o = _HEADER.size
        self._idx_map = mm
        self.sequence_lengths = np.frombuffer(mm, np.int32, n, o)
        self.sequence_pointers = np.frombuffer(mm, np.int64, n, o + 4 * n)
        self.document_indices = np.frombuffer(mm, np.int64, d, o + 12 * n)
        self.sequence_modes = np.frombuffer(mm, np.int8, n, base) if multimodal else None
        self._validate(n)

    def _validate(self, n: int) -> None:
        p, bin_path, lengths, ptr = self.idx_path, self.shard_paths[0], self.sequence_lengths, self.sequence_pointers
        dt = self.token_dtype

        def fail(msg: str, i: int, note: str = "", **context: Any) -> None:
            raise FormatError(f"{msg} (length {int(lengths[i])}, pointer {int(ptr[i])}){note}{self._dtype_hint()}",
                              path=p, sample=i, offset=int(ptr[i]), **context)

        for a in range(0, n, _CHECK_BLOCK):  # per block of millions of sequences, never per sequence
            lens, ptrs = lengths[a : a + _CHECK_BLOCK], ptr[a : a + _CHECK_BLOCK]
            if (bad := lens < 0).any():
                fail("negative sequence length", a + _first(bad))
            if (bad := (ptrs < 0) | (ptrs > self.bin_bytes)).any():
                fail(f"sequence pointer outside the {self.bin_bytes}-byte .bin", a + _first(bad), bin=bin_path)
            if (bad := lens.astype(np.int64) * dt.itemsize > self.bin_bytes - ptrs).any():
                fail(f"sequence runs past the end of the {self.bin_bytes}-byte .bin", a + _first(bad), bin=bin_path)
            if (bad := ptrs % dt.itemsize != 0).any():
                fail(f"sequence pointer is not a multiple of the {dt.itemsize}-byte {dt.name} item size",
                     a + _first(bad))
        bad_at, end = self._running_sum(dt.itemsize)
        if bad_at >= 0:
            fail(f"sequence pointer is not byte {end}, where the previous sequence ends", bad_at,
                 "; Megatron writes sequences back to back from byte 0")
        if end != self.bin_bytes:
            raise FormatError(
                f".bin is {self.bin_bytes} bytes but the sequences of {os.path.basename(p)} end at byte {end}: this "
                f".bin does not belong to this .idx (another dataset's, or bytes appended){self._dtype_hint()}",
                path=bin_path, idx=p,
            )
        doc = self.document_indices
        if int(doc[0]) != 0:
            raise FormatError(f"document index starts at {int(doc[0])}, not 0", path=p, offset=_HEADER.size + 12 * n)
        if doc.size > 1 and (bad := doc[1:] < doc[:-1]).any():
            k = _first(bad) + 1
            raise FormatError(f"document index decreases at entry {k}", path=p,
                              offset=_HEADER.size + 12 * n + 8 * k)
        if int(doc[-1]) != n:
            raise FormatError(f"document index ends at {int(doc[-1])}, not at the sequence count {n}", path=p)

    def _running_sum(self, itemsize: int) -> tuple[int, int]:
        """``(first sequence whose pointer is not the running sum of lengths * itemsize or -1, where it should
        start)``; with -1 the second value is the end of the last sequence. Lengths must be non-negative."""
        lengths, ptr = self.sequence_lengths, self.sequence_pointers
        end = 0
        for a in range(0, int(lengths.shape[0]), _CHECK_BLOCK):
            nbytes = lengths[a : a + _CHECK_BLOCK].astype(np.int64) * itemsize
            # No int64 overflow: a block sums to < 2**56 bytes, and `end` is reached only through pointers that
            # matched, which lie inside the .bin.
            starts = np.cumsum(nbytes) - nbytes + end
            if (bad := ptr[a : a + _CHECK_BLOCK] != starts).any():
                i = _first(bad)
                return a + i, int(starts[i])
            end = int(starts[-1] + nbytes[-1])
        return -1, end

    def _dtype_hint(self) -> str:
        """On an inconsistent pair: say so when the pointers and the .bin fit another item width (a dtype code
        changed). Only runs on the error path."""
        if (self.sequence_lengths < 0).any():
            return ""
        for size in sorted({dt.itemsize for dt in MEGATRON_DTYPES.values()} - {self.token_dtype.itemsize}):
            bad_at, end = self._running_sum(size)
            if bad_at < 0 and end == self.bin_bytes and end:
                names = ", ".join(sorted(dt.name for dt in MEGATRON_DTYPES.values() if dt.itemsize == size))
                code = _CODE_OF[self.token_dtype]
                return (f"; the pointers and the .bin fit {size}-byte items ({names}): is the dtype code "
                        f"{code} ({self.token_dtype.name}) wrong?")
        return ""

    @property
    def fingerprint(self) -> str:
        """xxh3-128 of the whole ``.idx`` plus the ``.bin`` size; with ``fingerprint="content"`` also the ``.bin``'s
        xxh3 (then prefixed ``content:`` so that it never equals an index-only fingerprint of the same files)."""
        if self._fingerprint is None:
            h = xxhash.xxh3_128()
            h.update(memoryview(self._idx_map))
            h.update(struct.pack("<Q", self.bin_bytes))
            if self.fingerprint_kind == "content":
                h.update(file_xxh3(self.shard_paths[0]).encode())
            prefix = "content:" if self.fingerprint_kind == "content" else ""
            self._fingerprint = prefix + h.hexdigest()
        return self._fingerprint

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    def lookup(self, ids: np.ndarray) -> Extents:
        ids = self._check_ids(ids)
        return Extents(
            np.zeros(ids.size, np.int32),
            self.sequence_pointers[ids],
            self.sequence_lengths[ids].astype(np.int64) * self.token_dtype.itemsize,
        )

    def sample_bytes(self) -> np.ndarray:
        if self._bytes is None:
            self._bytes = self.sequence_lengths.astype(np.int64) * self.token_dtype.itemsize
        return self._bytes

    def token_counts(self) -> np.ndarray:
        return self.sequence_lengths.astype(np.int64)

    def modality_codes(self) -> np.ndarray:
        return np.zeros(self.num_samples, np.uint8)

    def checksums(self) -> None:
        return None

    def meta(self, i: int) -> dict[str, Any]:
        i = int(self._check_ids(i)[0])
        out: dict[str, Any] = {"document": int(np.searchsorted(self.document_indices, i, side="right") - 1)}
        if self.sequence_modes is not None:
            out["mode"] = int(self.sequence_modes[i])
        return out

    def tokens(self, i: int) -> np.ndarray:
        """Sample ``i`` as a numpy array of ``token_dtype`` (a copy read with ``pread``)."""
        return np.frombuffer(self.read(i, verify=False), dtype=self.token_dtype)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _sequences(doc: Any) -> list[np.ndarray]:
    if isinstance(doc, (list, tuple)) and doc and all(isinstance(x, np.ndarray) for x in doc):
        return list(doc)
    return [np.asarray(doc)]


def write_megatron_dataset(prefix: str | os.PathLike, docs: Iterable[Any], dtype: np.dtype | type | str, *,
                           modes: Sequence[int] | None = None) -> tuple[str, str]:
    """Write ``prefix.bin``/``prefix.idx`` from the published layout (independent of Megatron's own code).

    ``docs``: each item is one document, either a 1-D token array (one sequence) or a list of 1-D numpy arrays
    (several sequences). ``modes``: one int8 per sequence, which makes it the multimodal variant.
    Returns ``(idx_path, bin_path)``.
    """
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(f"dtype {dt} has no Megatron code; allowed: {[str(d) for d in MEGATRON_DTYPES.values()]}")
    prefix = os.fspath(prefix)
    lengths: list[int] = []
    doc_index = [0]
    with open(prefix + ".bin", "wb") as f:
        for doc in docs:
            for seq in _sequences(doc):
                arr = np.ascontiguousarray(seq, dtype=dt).reshape(-1)
                f.write(arr.tobytes())
                lengths.append(arr.size)
            doc_index.append(len(lengths))
    n = len(lengths)
    lens = np.array(lengths, dtype=np.int32)
    pointers = np.zeros(n, np.int64)
    if n:
        np.cumsum(lens[:-1].astype(np.int64) * dt.itemsize, out=pointers[1:])
    if modes is not None and len(modes) != n:
        raise ValueError(f"{len(modes)} modes for {n} sequences")
    with open(prefix + ".idx", "wb") as f:
        f.write(_HEADER.pack(MEGATRON_MAGIC, 1, _CODE_OF[dt], n, len(doc_index)))
        f.write(lens.tobytes())
        f.write(pointers.tobytes())
        f.write(np.array(doc_index, dtype=np.int64).tobytes())
        if modes is not None:
            f.write(np.asarray(modes, dtype=np.int8).tobytes())
    return prefix + ".idx", prefix + ".bin"
