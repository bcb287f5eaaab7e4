"""The local cache of a bucket dataset: sparse shard files with the objects' own layout, and which samples they hold.

Each shard object has a local file of its full size (sparse: only fetched bytes take disk space). A sample is
the unit of presence, because it is the unit the map checksums: ``present`` is one byte per sample (global id) in
``.foresight-cache/present``, mapped shared, so every process of the host sees the same index.

Safety under concurrent processes (ranks of one host, restarts):

- one fetch per byte per host: a process takes POSIX record locks (``fcntl.lockf``) on the index bytes of the
  samples it is about to fetch, in ascending order (no lock cycle between processes), re-reads the index under them
  and fetches only what is still missing; a second process wanting the same samples waits, then finds them present
  (while the holder makes progress: one stopped while holding them is a ``lock_timeout`` after ``lock_wait_s``,
  :mod:`foresight.bucket.lockwait`);
- coalescing runs only between samples that are absent: a present sample is never fetched again as part of a gap
  (nor its bytes rewritten while another process reads them); an absent sample that a transfer holds whole (a gap)
  is checked and marked too, when no other process holds its lock;
- never a torn sample marked present: bytes are checked against the map's xxh3 (the project's
  :func:`~foresight.checksum.xxh3_many`, one native call), written, and only then marked; a process killed before
  that leaves its samples unmarked, its locks vanish with it, and the next reader refetches. Written bytes sit in
  the page cache, which outlives any process; only a machine crash can lose bytes whose mark reached the disk, so
  instead of an ``fdatasync`` per fetch the first open after a reboot re-hashes the marked samples
  (:meth:`SampleCache.scrub`; the boot id is recorded next to the index);
- fetched bytes are written through the page cache: the loader reads them back within a few steps, and writing
  large GETs past it (``cache.writer.direct = True``, :mod:`foresight.io.direct_write`) measured slower end to end
  in bench/object_store.py (token 3,272-3,439 vs 3,575-3,827 samples/s buffered, 6.6-8.1 vs 5.1-5.7 CPU-s/GB;
  media 74-78 vs 76-78 samples/s at 2.8-3.4 vs 2.3-2.6 CPU-s/GB; alternating runs at 10 ms): the read-back from
  disk costs more than the page-cache copy it saves; the writes go in pieces of at most 1 MiB
  (:data:`~foresight.io.direct_write.BUFFERED_PIECE`: a whole 16 MiB GET written at once made multi-MiB folios,
  whose first touch on a VM reporting free memory to its host cost 4.5-6.5 CPU-s/GB of a media fill, 0-0.5 now);
- eviction clears a sample's mark first, then punches the whole 4 KiB blocks inside its extent out of the file
  (``fallocate(PUNCH_HOLE)``: blocks shared with a neighbour stay, so a neighbour's bytes never change);
- eviction never punches a sample that a reader of any process pins (:mod:`foresight.bucket.pins`: a shared lock
  on the sample's byte of ``.foresight-cache/pins``, dropped by the kernel when its holder dies).

Within one process a lock serialises fetches (the GETs of one fetch already run concurrently); a lookup whose
samples are all present takes no lock.

Example::

    cache = SampleCache(local_dir, fetcher, refs, shard_paths, lookup, checksums)
    cache.ensure(np.array([3, 17, 42]))      # fetched (coalesced) unless present; marked once written
    cache.evict(np.array([17]))              # unmarked, then its blocks punched out
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from foresight.checksum import xxh3_many
from foresight.errors import BucketError
from foresight.format.types import Extents

from .claims import Claims, FetchClaim
from .fetch import ObjectRef, RangedFetcher
from .lockwait import LOCK_WAIT_S, check_wait_s, wait_for_lock
from .pins import SamplePins, claim_unpinned, id_runs, open_pin_file
from foresight.io import IOEngine
from foresight.io.direct_write import CacheWriter

log = logging.getLogger("foresight.bucket")

__all__ = ["SampleCache", "CacheStats", "punch_hole", "allocate_index", "INDEX_DIR"]

INDEX_DIR = ".foresight-cache"
FETCH_CHUNK = 256 << 20  # bytes of samples fetched (and held in memory) at once
BLOCK = 4096
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, length: int) -> int:
    """Free the whole ``BLOCK``-sized blocks inside ``[offset, offset + length)`` of ``fd`` (size unchanged);
    the bytes read back as zeros. Returns the bytes punched (0 when no whole block lies inside)."""
    start = -(-offset // BLOCK) * BLOCK
    end = (offset + length) // BLOCK * BLOCK
    if end <= start:
        return 0
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, end - start) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")
    return end - start


def allocate_index(fd: int, entries: int, path: str) -> None:
    """Give the index file ``fd`` (``entries`` bytes) every block it will ever need, now. The index is a shared
    mapping: a mark stored into a page of a sparse file makes the file system allocate its block then, and on a
    full disk the kernel answers that store with SIGBUS, which kills the process without a word. Allocated here,
    a full disk is a ``cache_full`` :class:`BucketError` naming the index (at layout or open), never a dead rank."""
    if entries <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, entries)  # quick when already allocated; glibc writes zeros where unsupported
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise BucketError(f"cannot allocate the cache index: {os.strerror(e.errno)}" + (
            " (free the disk or use another cache directory)" if full else ""), "cache_full" if full else "cache",
            path=path) from None


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _around(starts: np.ndarray, lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces of ``[0, n)`` outside the extents ``[starts, starts + lengths)`` (sorted, disjoint): their starts
    and ends (empty pieces dropped)."""
    order = np.argsort(starts, kind="stable")
    cut_lo, cut_hi = starts[order], starts[order] + lengths[order]
    lo = np.concatenate(([0], cut_hi)).astype(np.int64)
    hi = np.concatenate((cut_lo, [n])).astype(np.int64)
    keep = hi > lo
    return lo[keep], hi[keep]


@dataclass
class CacheStats:
    """What the cache did since it was opened: samples found present (hits) or fetched (misses), samples fetched
    whole inside a coalesced gap and kept (``gap_samples``), corrupt entries found, evictions, and samples an
    eviction left because a reader (of any process) pinned them (``pinned_skips``), samples a lookup waited for
    because a prefetcher had claimed them (``claim_waits``), and fetched bytes of samples already present that a
    transfer crossed (a block fill's run), neither re-hashed nor written again (``skipped_bytes``)."""

    hits: int = 0
    misses: int = 0
    gap_samples: int = 0
    fetched_bytes: int = 0
    corrupt: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    pinned_skips: int = 0
    claim_waits: int = 0
    skipped_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class SampleCache:
    """Which samples of a dataset are in its local sparse files, and fetching/evicting them (see the module doc).

    ``lookup(ids) -> Extents`` and ``checksums`` (uint64 per sample) come from the dataset's maps; ``refs[s]``
    is the object behind ``shard_paths[s]``. A dataset without per-sample checksums (a Megatron pair) passes
    ``checksums=None`` and its ``num_samples``: its fetched bytes are then held to the objects' ETags alone (every
    GET carries ``If-Match``), and :meth:`scrub` has nothing to compare with.
    """

    def __init__(self, local_dir: str, fetcher: RangedFetcher, refs: Sequence[ObjectRef], shard_paths: Sequence[str],
                 lookup: Callable[[np.ndarray], Extents], checksums: np.ndarray | None, *,
                 num_samples: int | None = None, lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.local_dir = local_dir
        # how long a sample's lock (another process's fetch or eviction) is waited for while no sample is marked
        # or unmarked anywhere in the index (:mod:`foresight.bucket.lockwait`)
        self.lock_wait_s = check_wait_s(lock_wait_s)
        self.fetcher = fetcher
        self.refs = list(refs)
        self.lookup = lookup
        self.checksums = None if checksums is None else np.asarray(checksums, dtype=np.uint64)
        self.num_samples = len(self.checksums) if self.checksums is not None else int(num_samples)
        self.stats = CacheStats()
        self.max_gap: int | None = None  # the coalescer's gap for fetches that name none (None: the fetcher's)
        # One fetch, eviction or scrub at a time in this process (the record locks order processes, not threads);
        # a thread waiting to fetch re-checks its samples whenever a fetch lands a chunk, so it never waits on a
        # long fetch (a prefetcher's window) for samples another fetch already made present.
        self._cv = threading.Condition()
        self._busy = False
        self._stats_lock = threading.Lock()
        self._claims = Claims(self._cv, lambda: self.present,
                              lambda i: str(self.refs[int(self.lookup(np.array([i])).shard[0])].url))
        index_path = os.path.join(local_dir, INDEX_DIR, "present")
        self._index_fd = os.open(index_path, os.O_RDWR)
        entries = os.fstat(self._index_fd).st_size
        if entries != self.num_samples:
            os.close(self._index_fd)
            raise BucketError(f"cache index holds {entries} entries, the dataset {self.num_samples}", "checksum",
                              path=index_path)
        try:
            allocate_index(self._index_fd, entries, index_path)  # a copy laid out before the index was allocated
        except BaseException:
            os.close(self._index_fd)
            raise
        self._index_path = index_path
        self._index_id = _file_id(os.fstat(self._index_fd))
        self.present = np.memmap(index_path, dtype=np.uint8, mode="r+", shape=(self.num_samples,)) \
            if self.num_samples else np.zeros(0, np.uint8)
        self._fds = [os.open(p, os.O_RDWR) for p in shard_paths]
        self.writer = CacheWriter(shard_paths, self._fds, direct=False)  # buffered: read back soon (module doc)
        self._pin_fd = open_pin_file(os.path.join(local_dir, INDEX_DIR))  # this evictor's own open of the pin file

    def pins(self) -> SamplePins:
        """A new reader's pins on this cache's samples (:mod:`foresight.bucket.pins`): what it holds, no process's
        :meth:`evict` punches."""
        return SamplePins(os.path.join(self.local_dir, INDEX_DIR), wait_s=self.lock_wait_s, progress=self._marks)

    def claim(self, on_wanted: Callable[[], None], wait_s: float) -> FetchClaim:
        """A new claim (:mod:`foresight.bucket.claims`): the absent samples it holds, other callers of
        :meth:`ensure` in this process wait for instead of fetching them."""
        return self._claims.claim(on_wanted, wait_s)

    def close(self) -> None:
        self.writer.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._pin_fd >= 0:
            os.close(self._pin_fd)
            self._pin_fd = -1
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1
        self.present = np.zeros(0, np.uint8)

    # -- locks on index bytes --------------------------------------------------------------------------------------
    def _marks(self) -> int:
        """Samples marked in the shared index: what moves while any process's fetch (or eviction) goes on, the
        sign of progress a lock waiter looks for once per ``lock_wait_s``."""
        return int(np.count_nonzero(self.present))

    def _try_lock(self, start: int, n: int) -> bool:
        try:
            fcntl.lockf(self._index_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, n, start, os.SEEK_SET)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _lock_runs(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """Lock the index bytes of sorted unique ``ids`` (ascending runs), waiting while another process fetches
        or evicts them, at most ``lock_wait_s`` with no sample marked or unmarked anywhere (a holder stopped or
        stuck: ``lock_timeout`` naming the index and the samples)."""
        held = []
        try:
            for start, n in zip(*id_runs(ids)):
                start, n = int(start), int(n)
                wait_for_lock(lambda: self._try_lock(start, n), fd=self._index_fd, path=self._index_path,
                              what=f"sample{f's {start}-{start + n - 1}' if n > 1 else f' {start}'}" +
                              f" (another process is fetching or evicting {'them' if n > 1 else 'it'})",
                              wait_s=self.lock_wait_s, progress=self._marks)
                held.append((start, n))
        except BaseException:
            self._unlock(held)
            raise
        return held

    def _unlock(self, held: list[tuple[int, int]]) -> None:
        for start, n in held:
            fcntl.lockf(self._index_fd, fcntl.LOCK_UN, n, start, os.SEEK_SET)

    # -- the public operations -------------------------------------------------------------------------------------
    def cached_bytes(self) -> int:
        """Bytes of the samples marked present (the budget's measure)."""
        ids = np.flatnonzero(self.present.copy())  # a snapshot: other processes mark the shared index meanwhile
        return int(self.lookup(ids).length.sum()) if ids.size else 0

    def ensure(self, ids: np.ndarray, *, max_gap: int | None = None, span_present: bool = False,
               order: np.ndarray | None = None, max_inflight: int | None = None,
               claim: FetchClaim | None = None, max_transfer: int | None = None) -> int:
        """Make every sample of ``ids`` present (fetching the missing ones in coalesced GETs; ``max_gap`` overrides
        the cache's and the fetcher's for this call); returns how many were fetched. ``span_present``: a transfer
        may run across present samples (fetched, but neither re-hashed nor written again) instead of being cut
        at each of them (a block fill around a few present samples stays a few GETs). ``order`` (a rank per id of
        ``ids``): the missing samples are fetched in one coalesced fetch whose GETs go out lowest rank first, at
        most ``max_inflight`` bytes of them in flight (:meth:`RangedFetcher.fetch`), so they land in rank order at
        the link's full rate and a waiter for an early rank's samples returns when they land, not when the whole
        call ends (a prefetcher's fill, its blocks in the order the plan first needs them); ``max_inflight`` bounds
        what the call holds in memory. Raises :class:`BucketError` naming the object when a
        fetched sample's xxh3 differs from the map's (the object changed under the same ETag, or the store
        returned wrong bytes): nothing of that GET is marked (the checked samples of the call's other GETs are).
        Without ``claim`` (a lookup), absent samples that a claim holds are waited for, not fetched
        (:mod:`foresight.bucket.claims`; ``stats.claim_waits``); with it (a claim's owner fetching), none is.
        ``max_transfer`` (with ``order``): the cap on one GET of that fetch (:meth:`RangedFetcher.fetch`)."""
        self._check_copy()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids, first = np.unique(ids, return_index=True)
        rank = np.zeros(ids.size, np.int64) if order is None else np.asarray(order, dtype=np.int64)[first]
        absent = self.present[ids] == 0
        missing, rank = ids[absent], rank[absent]
        with self._stats_lock:
            self.stats.hits += int(ids.size - missing.size)
        if not missing.size:  # the common case, without waiting for another thread's fetch of other samples
            return 0
        waited = []

        def on_wait(n: int) -> None:  # counted once per call, however many times the claims are looked at
            if not waited:
                waited.append(n)
                self._count_claim_waits(n)

        while True:
            if claim is None:  # what a prefetcher is fetching or about to is waited for, not fetched here
                left = self._claims.wait(missing, on_wait)
                missing, rank = missing[left], rank[left]
                if not missing.size:
                    return 0
            with self._cv:
                if self._busy:  # another fetch of this process: once it ends, these may be present, or claimed
                    self._cv.wait()  # by a prefetcher meanwhile (then waited for above, not fetched here)
                    absent = self.present[missing] == 0
                    missing, rank = missing[absent], rank[absent]
                    if not missing.size:
                        return 0
                    continue
                if claim is None and self._claims.holds(missing):  # claimed since the wait above returned
                    continue
                self._busy = True
                break
        try:
            held = self._lock_runs(missing)
            try:
                absent = self.present[missing] == 0  # another thread or process may have fetched them
                missing, rank = missing[absent], rank[absent]
                if not missing.size:  # all of them (another process fetched them while we waited on their locks)
                    return 0
                gap = self.max_gap if max_gap is None else max_gap
                if order is not None:  # one fetch, its GETs in rank order, max_inflight bytes held at once
                    self._fetch(missing, gap, span_present, missing, priority=rank,
                                max_inflight=FETCH_CHUNK if max_inflight is None else max_inflight,
                                max_transfer=max_transfer)
                    return int(missing.size)
                ext = self.lookup(missing)
                # chunks of at most FETCH_CHUNK bytes: one fetch's bytes are held in memory until written
                chunk = np.cumsum(ext.length) // FETCH_CHUNK
                for part in np.split(missing, np.flatnonzero(np.diff(chunk)) + 1):
                    self._fetch(part, gap, span_present, missing)
                    with self._cv:
                        self._cv.notify_all()  # waiters whose samples this chunk held return now
                return int(missing.size)
            finally:
                self._unlock(held)
        finally:
            self._release()

    def _check_copy(self) -> None:
        """:class:`BucketError` (``changed``) when another open laid this copy out anew since this one opened it
        (the dataset's manifest changed in the bucket): its index and shard files were replaced by new ones, which
        reads by path now reach, while this cache holds the old ones; its marks say nothing about the new files."""
        try:
            same = _file_id(os.stat(self._index_path)) == self._index_id
        except FileNotFoundError:
            same = False
        if not same:
            raise BucketError("the cache copy was laid out anew by another open since this one opened it (the "
                              "dataset changed in the bucket, or that open found the copy damaged): reopen the "
                              "dataset", "changed", path=self.local_dir)

    def _count_claim_waits(self, n: int) -> None:
        with self._stats_lock:
            self.stats.claim_waits += n

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._cv:
            while self._busy:
                self._cv.wait()
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()

    def _segments(self, ids: np.ndarray, shard: np.ndarray, span_present: bool = False) -> np.ndarray:
        """A run id per sample of ``ids`` (sorted, missing): a new run at each shard change and (unless
        ``span_present``) wherever a present sample lies between two neighbours. Coalescing within runs only never
        fetches a present sample again as part of a gap (its bytes are here already)."""
        if ids.size < 2:
            return np.zeros(ids.size, dtype=np.int32)
        if span_present:
            return np.concatenate(([0], np.cumsum(shard[1:] != shard[:-1]))).astype(np.int32)
        lo = int(ids[0])
        before = np.cumsum(self.present[lo:int(ids[-1]) + 1], dtype=np.int64)  # present samples in [lo, id]
        a, b = ids[:-1], ids[1:]
        between = before[b - lo - 1] - before[a - lo]  # present samples strictly between neighbours (both missing)
        cut = (between > 0) | (shard[1:] != shard[:-1])
        return np.concatenate(([0], np.cumsum(cut))).astype(np.int32)

    @staticmethod
    def _gaps_inside(ids: np.ndarray, seg: np.ndarray, length: np.ndarray, tr) -> tuple[np.ndarray, np.ndarray]:
        """Samples between two neighbours of ``ids`` that one transfer holds whole (fetched anyway as its gap):
        their ids, and the transfer of each."""
        if ids.size < 2 or not tr.io_count:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        k = np.searchsorted(tr.t_dest, tr.x_dest, side="right") - 1
        a, b = ids[:-1], ids[1:]
        pair = (seg[1:] == seg[:-1]) & (k[1:] == k[:-1]) & (b > a + 1) & (length[1:] > 0) & (length[:-1] > 0)
        counts = (b - a - 1)[pair]
        if not counts.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        first = np.repeat(a[pair] + 1, counts)
        step = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return first + step, np.repeat(k[:-1][pair], counts)

    def _lock_free_runs(self, ids: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Lock what of ``ids`` no other process holds (never waits); returns the ids locked and the locks."""
        held, got = [], np.zeros(ids.size, dtype=bool)
        starts, counts = id_runs(ids)
        offsets = np.searchsorted(ids, starts)
        for start, n, at in zip(starts.tolist(), counts.tolist(), offsets.tolist()):
            try:
                fcntl.lockf(self._index_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, n, start, os.SEEK_SET)
            except OSError:
                continue  # another process is fetching or evicting them: leave them to it
            held.append((start, n))
            got[at:at + n] = True
        return ids[got], held

    def _fetch(self, ids: np.ndarray, max_gap: int | None = None, span_present: bool = False,
               held: np.ndarray | None = None, priority: np.ndarray | None = None,
               max_inflight: int | None = None, max_transfer: int | None = None) -> None:
        """Fetch ``ids`` (sorted, missing, their index bytes locked by the caller, as are those of ``held``): each
        GET's samples, and the absent ones it holds whole as a gap, are checked, written and marked on the
        fetcher's thread as it lands, while the other GETs are in flight (so a waiter for them returns then)."""
        ext = self.lookup(ids)
        seg = self._segments(ids, ext.shard, span_present)
        seg_shard = ext.shard[np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])]
        held = ids if held is None else held
        plan: dict[str, np.ndarray] = {}
        plan_lock = threading.Lock()

        def samples_by_transfer(tr) -> dict[str, np.ndarray]:
            """Every sample the transfers hold (``ids``, then the gap samples), grouped by transfer: made once."""
            with plan_lock:
                if not plan:
                    gap, gap_k = self._gaps_inside(ids, seg, ext.length, tr)
                    gap_ext = self.lookup(gap)
                    k = np.concatenate((np.searchsorted(tr.t_dest, tr.x_dest, side="right") - 1, gap_k))
                    by = np.argsort(k, kind="stable")
                    plan.update(
                        by=by, bounds=np.searchsorted(k[by], np.arange(tr.io_count + 1)),
                        id=np.concatenate((ids, gap)), gap=np.arange(k.size) >= ids.size,
                        where=np.concatenate((tr.x_dest, tr.t_dest[gap_k] + gap_ext.offset - tr.t_offset[gap_k])),
                        length=np.concatenate((ext.length, gap_ext.length)),
                        shard=np.concatenate((ext.shard, gap_ext.shard)),
                        offset=np.concatenate((ext.offset, gap_ext.offset)))
            return plan

        def landed(tr, data: np.ndarray, k: int) -> None:
            p = samples_by_transfer(tr)
            sel = p["by"][p["bounds"][k]:p["bounds"][k + 1]]
            # present gap samples (span_present: a fill's run crossing them) are neither re-hashed nor rewritten:
            # their bytes are in place (and may be being read); the writes go around them
            skip = p["gap"][sel] & (self.present[p["id"][sel]] != 0)
            skipped, sel = sel[skip], sel[~skip]
            if self.checksums is not None:
                self._check(data, p["where"][sel] - tr.t_dest[k], p["length"][sel], p["id"][sel], p["shard"][sel],
                            p["offset"][sel])
            mine, gap = p["id"][sel[~p["gap"][sel]]], p["id"][sel[p["gap"][sel]]]
            # absent gap samples are marked too when this process holds their lock (the caller's) or can take it now
            ours = np.isin(gap, held)
            extra, extra_held = self._lock_free_runs(gap[~ours])
            extra = np.concatenate((gap[ours], extra))
            try:
                n = int(tr.t_length[k])
                starts, ends = _around(p["where"][skipped] - tr.t_dest[k], p["length"][skipped], n)
                try:
                    shard, base = int(seg_shard[tr.t_file[k]]), int(tr.t_offset[k])
                    wrote = sum(self.writer.pwrite(shard, data[a:b], base + a)  # a few pieces: one per skipped
                                for a, b in zip(starts.tolist(), ends.tolist()))  # sample, most GETs one
                    if wrote != int((ends - starts).sum()):  # a short write: a full disk took part of it, never marked
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                except OSError as e:  # a full or failing cache disk: give back what this GET allocated, mark nothing
                    back = self.lookup(np.concatenate((mine, extra)))
                    for s, off, length in zip(back.shard.tolist(), back.offset.tolist(), back.length.tolist()):
                        punch_hole(self._fds[s], off, length)
                    full = e.errno == errno.ENOSPC
                    raise BucketError(f"cannot write the cache: {e.strerror}" + (" (lower the prefetcher's "
                                      "budget_bytes or free the disk)" if full else ""),
                                      "cache_full" if full else "cache", path=self.local_dir) from None
                self.present[mine] = 1
                self.present[extra] = 1  # fetched whole as gaps, checked: present too (the plan uses them later)
            finally:
                self._unlock(extra_held)
            with self._stats_lock:
                self.stats.misses += int(mine.size)
                self.stats.gap_samples += int(extra.size)
                self.stats.fetched_bytes += n
                self.stats.skipped_bytes += n - int((ends - starts).sum())
            with self._cv:
                self._claims.landed += 1
                self._cv.notify_all()  # waiters whose samples this GET held return now

        self.fetcher.fetch(self.refs, seg, ext.offset, ext.length, ref_of_file=seg_shard, max_gap=max_gap,
                           on_transfer=landed, priority=priority, max_inflight=max_inflight,
                           max_transfer=max_transfer)
        left = self.present[ids] == 0
        if left.any():  # empty samples: no GET holds them (their xxh3 is still the map's)
            if self.checksums is not None:
                self._check(np.zeros(1, np.uint8), np.zeros(int(left.sum()), np.int64), ext.length[left], ids[left],
                            ext.shard[left], ext.offset[left])
            self.present[ids[left]] = 1
            with self._stats_lock:
                self.stats.misses += int(left.sum())

    def _check(self, region: np.ndarray, where: np.ndarray, lengths: np.ndarray, check: np.ndarray,
               shard: np.ndarray, offset: np.ndarray) -> None:
        """Every fetched sample's xxh3 against the map's (one native call); raises naming the first that differs."""
        sums = xxh3_many(region, where, lengths)
        bad = np.flatnonzero(sums != self.checksums[check])
        if bad.size:
            i = int(bad[0])
            raise BucketError(f"sample {int(check[i])} fetched with xxh3 {int(sums[i]):016x}, the map says "
                              f"{int(self.checksums[check[i]]):016x} ({bad.size} samples differ)", "checksum",
                              object=str(self.refs[int(shard[i])].url), offset=int(offset[i]))

    def evict(self, ids: np.ndarray, *, keep: Callable[[], np.ndarray] | None = None) -> int:
        """Unmark ``ids`` and punch their blocks out of the sparse files; returns the sample bytes evicted.

        ``keep()`` names the samples a reader of this process may be reading now; it is asked once this call holds
        the cache (a fetch it waited for may have taken long, and readers moved on meanwhile), and those are never
        punched. Nor are the samples any reader of any process pins (:meth:`pins`): they are skipped, never waited
        for, and counted in ``stats.pinned_skips``."""
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        with self._exclusive():
            ids = ids[self.present[ids] != 0]
            if keep is not None:
                ids = ids[~np.isin(ids, keep())]
            if not ids.size:
                return 0
            with claim_unpinned(self._pin_fd, ids) as free:
                self.stats.pinned_skips += int(ids.size - free.size)
                return self._evict_claimed(free)

    def _evict_claimed(self, ids: np.ndarray) -> int:
        """:meth:`evict`'s work on ``ids`` that no reader pins (held so by the caller)."""
        if not ids.size:
            return 0
        held = self._lock_runs(ids)
        try:
            self.present[ids] = 0
            ext = self.lookup(ids)
            for s, off, n in zip(ext.shard.tolist(), ext.offset.tolist(), ext.length.tolist()):
                punch_hole(self._fds[s], off, n)  # one syscall per sample: there is no batched fallocate
            nbytes = int(ext.length.sum())
            self.stats.evicted += int(ids.size)
            self.stats.evicted_bytes += nbytes
            return nbytes
        finally:
            self._unlock(held)

    def unmark_all(self) -> int:
        """Forget every present sample (each is fetched again on use); returns how many were marked. What a cache
        without per-sample checksums (a Megatron pair) does where one with them would :meth:`scrub`."""
        with self._exclusive():
            n = int(np.count_nonzero(self.present))
            self.present[:] = 0
        return n

    def scrub(self, ids: np.ndarray | None = None, *, on_progress: Callable[[], None] | None = None) -> np.ndarray:
        """Re-hash the present samples of ``ids`` (all present ones by default) from the local files and unmark
        those whose bytes no longer match the map (a disk or a hand corrupted them): the next :meth:`ensure`
        refetches them. Returns the ids found corrupt (each logged once, counted in ``stats.corrupt``).
        ``on_progress()`` is called after each chunk re-hashed (an open's scrub holds the layout lock: its waiters
        see it move)."""
        if self.checksums is None:
            raise ValueError(f"{self.local_dir}: this dataset has no per-sample checksums (a Megatron pair): "
                             "nothing to scrub against; delete the cache directory to refetch it")
        ids = np.flatnonzero(self.present.copy()) if ids is None else np.unique(np.asarray(ids, dtype=np.int64))
        with self._exclusive():
            ids = ids[self.present[ids] != 0]
            if not ids.size:
                return ids
            ext = self.lookup(ids)
            fds = np.asarray(self._fds, dtype=np.int32)[ext.shard]
            chunk = np.cumsum(ext.length) // FETCH_CHUNK
            bad_parts = []
            with IOEngine(backend="auto") as engine:  # one batched read per chunk (GIL released), never per sample
                for part in np.split(np.arange(ids.size), np.flatnonzero(np.diff(chunk)) + 1):
                    lengths = ext.length[part]
                    dest = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
                    region = np.zeros(int(lengths.sum()) + 1, dtype=np.uint8)
                    engine.read_batch(fds[part], ext.offset[part], lengths,
                                      (region.ctypes.data + dest).astype(np.uint64), allow_eof=True)
                    bad_parts.append(ids[part][xxh3_many(region, dest, lengths) != self.checksums[ids[part]]])
                    if on_progress is not None:
                        on_progress()
            bad = np.concatenate(bad_parts)
            if bad.size:
                held = self._lock_runs(bad)
                try:
                    self.present[bad] = 0
                finally:
                    self._unlock(held)
                self.stats.corrupt += int(bad.size)
                log.warning("bucket cache: %d corrupt samples in %s (first id %d): unmarked, refetched on next use",
                            bad.size, self.local_dir, int(bad[0]))
            return bad
