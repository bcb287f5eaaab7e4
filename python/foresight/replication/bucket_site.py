"""An evaluation site that is a bucket: a job's checkpoints sent as multipart uploads while they are saved.

``Replication(site="s3://eval/replicas", job="llm")`` hands its hooks here instead of to a node (the training
process sends; no node is involved). Each data file is cut into the same units as on the node path
(:func:`~foresight.replication.units.unit_ends`) and each part of its multipart upload ends at a unit's end, units
under S3's 5 MiB part minimum coalesced (:func:`~foresight.bucket.multipart.part_ends`). A part leaves, on this
site's own threads, as soon as the writer reports its bytes written (read back from the data file through a
descriptor opened when the file was announced, so the commit's rename does not matter). Every request goes through
the bucket layer's retries (:class:`~foresight.bucket.fetch.RetryPolicy`); a part is sent with its MD5, which the
server checks.

Publish, after the source commit only, on one publisher thread: every part of every data file sent (what the
writer did not report is sent now), the stored parts listed and checked (number, size, ETag), each upload
completed and its object checked by a HEAD, the small files uploaded, and the checkpoint's marker written last:

* a Checkpointer save: ``<site>/<job>/step-00000100.seq-00000007/`` holding ``data.bin``, ``index.json`` and
  ``COMMIT`` (the commit's marker plus each object's size and ETag), the bucket tier's layout
  (:mod:`foresight.checkpoint.bucket_tier`): ``load(root="s3://eval/replicas/llm")`` restores it. The objects'
  names need the commit's sequence before the commit: the writer passes the one this save gets if it commits.
* a DCP save: ``<site>/<job>/<directory name>/`` holding each rank's data file and ``.metadata`` last
  (``ForesightStorageReader("s3://eval/replicas/llm/step-100")``). Each rank sends its own file; the
  coordinator completes them all at the commit: a rank's upload counts once the server lists every part its plan
  has, with the planned sizes (it waits up to ``rank_wait_s`` for all the ranks, then sends the file itself from
  the checkpoint directory, which the node path also requires to be shared).

A DCP rank's upload is tied to its save: right after creating it, the rank puts an empty journal entry
``<site>/<job>/.uploads/<directory>/<save id>/<file>/<upload id>`` (S3 lists no upload's metadata), and the
coordinator completes only the upload its save's entry names: an upload an earlier attempt at the same directory
left open (a save retried after a crash: same sizes, other bytes) is never completed. Once a publish's marker is in,
the uploads still open under its prefix are aborted (a create whose reply was lost and was retried left one; so did
earlier attempts), but for those another save of the directory journaled no earlier than this one (in progress).

Nothing is visible before the marker but completed objects of the publish in progress; an upload that is never
completed is invisible. A save that aborts, or a publish that fails, aborts every multipart upload open under its
prefix. A DCP save's abort first puts an abort record, ``<site>/<job>/.aborted/<save id>`` (the id the coordinator
hands every rank in the global plan), and a rank that creates an upload checks that record right after: an upload
created after the coordinator listed the open ones finds the record and aborts itself, so none stays open. A
failure is reported to the policy (which logs it, counts it and retries the publish from the committed directory,
whole); it never reaches the save.

Work is picked urgent steps first (:meth:`BucketSite.urgent`), else in the order queued, by the parts pool and the
publisher alike.

Retention (``keep``, ``replica_ttl``), after each publish on the publisher thread: the committed replicas beyond the
newest ``keep`` and those whose marker is ``replica_ttl`` seconds old are deleted, marker first (a reader never
finds a marker whose objects are going), never the newest committed one, never a set without a marker unless it is
older than the newest commit (a delete or publish cut short: the next pass finishes it); uploads still open are
not objects and are never touched. The policy and the order are the bucket tier's
(:func:`~foresight.checkpoint.bucket_tier.expired`, :func:`~foresight.checkpoint.bucket_tier.delete_set`).

Example::

    site = BucketSite("s3://eval/replicas/llm")
    site.start(100, "/ckpt/.tmp-step-100", [("data.bin", size)], seq=7)
    site.written(100, {"data.bin": 64 << 20})           # the parts ending by then leave
    site.publish(100, "/ckpt/step-00000100", on_error=print)
    site.wait(100)                                     # {"path": "s3://eval/replicas/llm/step-...", "ready_at": ...}
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from foresight.bucket.fetch import ObjectRef
from foresight.bucket.multipart import MultipartClient, Part, Upload, part_ends
from foresight.bucket.objects import BucketPrefix
from foresight.checkpoint import store
from foresight.checkpoint.bucket_tier import BucketTier, commit_name, delete_set, expired, is_commit_name
from foresight.errors import BucketError, CheckpointError
from foresight.replication.urgent_queue import UrgentFirst
from foresight.replication.units import DCP_METADATA, UNIT_BYTES, is_data_file, unit_ends

log = logging.getLogger("foresight.replicate")

RANK_WAIT_S = 120.0  # how long a DCP coordinator waits for another rank's parts before sending its file itself
ABORTS = ".aborted"  # <site>/<job>/.aborted/<save id>: a DCP save the coordinator aborted (ranks check it)
ABORT_RECORD_S = 24 * 3600.0  # an abort record is kept this long (a rank's upload created later than that leaks)
UPLOADS = ".uploads"  # <site>/<job>/.uploads/<prefix>/<save id>/<file>/<upload id>: a DCP save's upload, by its save


def journal_name(prefix: str, save: str, fname: str = "", upload_id: str = "") -> str:
    """The (empty) object that ties upload ``upload_id`` of ``<prefix>/<fname>`` to DCP save ``save``: S3 lists no
    upload's metadata, so this is how a coordinator finds the upload of *this* save, never an earlier attempt's.
    Shorter forms (no ``upload_id``, no ``fname``, no ``save``) are the folders to list."""
    return "/".join(p for p in (UPLOADS, prefix, save, fname, upload_id) if p)


def plan_parts(size: int, unit_bytes: int) -> list[int]:
    """The part ends of a ``size``-byte data file: unit ends, coalesced to S3's part minimum."""
    return part_ends(unit_ends(size, unit_bytes)) if size else []


@dataclass
class _FileSend:
    """One data file's multipart upload: parts leave as their bytes are written."""

    name: str  # the object's name under the site's prefix
    path: str
    fd: int
    size: int
    ends: list[int]
    upload: Upload | None = None
    parts: dict[int, Part] = field(default_factory=dict)
    futures: list[Future] = field(default_factory=list)
    submitted: int = 0  # parts handed to the pool (in order)
    lock: threading.Lock = field(default_factory=threading.Lock)  # submitting parts (the writer's thread)
    create_lock: threading.Lock = field(default_factory=threading.Lock)  # the upload, made by the first part

    def bounds(self, k: int) -> tuple[int, int]:
        return (self.ends[k - 1] if k else 0), self.ends[k]


@dataclass
class _Transfer:
    step: int
    prefix: str  # the checkpoint's key prefix under the site ("step-00000100.seq-00000007" or the DCP directory)
    save: str = ""  # a DCP save's id, the same on every rank (its abort record's name); "" for a Checkpointer save
    files: dict[str, _FileSend] = field(default_factory=dict)
    error: BaseException | None = None
    aborted: bool = False

    def settled(self) -> bool:
        """Every part handed out and finished (sent or failed)."""
        return all(fs.submitted == len(fs.ends) and all(f.done() for f in fs.futures) for fs in self.files.values())


class BucketSite:
    """Replicas of one job's checkpoints under ``url`` (``s3://bucket/prefix/job``); see the module doc.
    ``bucket_options``: keyword arguments of :class:`~foresight.bucket.objects.BucketPrefix` (``options``,
    ``retry``, ``part_concurrency``: parts in flight, default 8). ``keep``, ``replica_ttl``: retention (see the
    module doc; both None: replicas are kept)."""

    def __init__(self, url: str, *, unit_bytes: int | None = None, bucket_options: dict[str, Any] | None = None,
                 rank_wait_s: float = RANK_WAIT_S, keep: int | None = None,
                 replica_ttl: float | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        if replica_ttl is not None and replica_ttl < 0:
            raise ValueError(f"replica_ttl must be >= 0 seconds or None, got {replica_ttl}")
        self.keep, self.replica_ttl = keep, replica_ttl
        opts = dict(bucket_options or {})
        self.objects = BucketPrefix(url, **opts)
        self.url = self.objects.url
        self.unit_bytes = int(unit_bytes or UNIT_BYTES)
        self.rank_wait_s = rank_wait_s
        self.multipart = MultipartClient(self.objects.fetcher, opts.get("options"),
                                         max_connections=2 * self.objects.part_concurrency + 4)
        self._tier = BucketTier(str(self.url), objects=self.objects)  # the Checkpointer layout's retention
        self._urgent: set[int] = set()  # steps whose parts and publish go ahead of the others' (see urgent)
        self._parts = UrgentFirst(ThreadPoolExecutor(self.objects.part_concurrency,
                                                      thread_name_prefix="foresight-replica-part"), self._urgent,
                                   self._thread_error)
        self._publisher = UrgentFirst(ThreadPoolExecutor(1, thread_name_prefix="foresight-replica-publish"),
                                       self._urgent, self._thread_error)
        self._transfers: dict[int, _Transfer] = {}
        self._state: dict[int, tuple[str, Any]] = {}  # step -> ("publishing" | "done" | "failed", info)
        self._cond = threading.Condition()
        # parts_while_saving: parts handed out as the writer reported their bytes (before the commit);
        # parts_at_publish: parts the commit found unsent; files_sent_whole: data files sent whole at the publish
        # (not streamed, or sent again after a failed part); uploads_aborted_late: uploads created after their
        # save's abort, aborted by their creator; deleted: replicas retention deleted; thread_errors: errors
        # raised by this site's threads' work that nobody waits on (logged)
        self.stats = {"parts_while_saving": 0, "parts_at_publish": 0, "parts_sent": 0, "files_sent_whole": 0,
                      "published": 0, "uploads_aborted_late": 0, "deleted": 0, "retention_failures": 0,
                      "thread_errors": 0}

    # -- while the save writes -----------------------------------------------------------------------------------
    def start(self, step: int, directory: str, files: list[tuple[str, int]], *, seq: int | None = None,
              save: str = "") -> None:
        """``files`` (``[(name, size)]``) are being written in ``directory``; ``seq``: the commit sequence this
        save gets if it commits (a Checkpointer save), None for a DCP save (named by its directory). ``save``: a
        DCP save's id, the same on every rank (an upload created after the save's abort finds its record). Opens
        each file to read its parts back; sends nothing yet."""
        prefix = commit_name(step, seq) if seq is not None else os.path.basename(os.path.normpath(directory))
        with self._cond:
            for old, ot in list(self._transfers.items()):  # a DCP rank's sent files: no publish here closes them
                if old != step and self._state.get(old, ("",))[0] != "publishing" and ot.settled():
                    del self._transfers[old]
                    _close_files(ot)
            t = old_t = self._transfers.get(step)
            if t is None or t.prefix != prefix or t.aborted or t.save != save or any(f in t.files for f, _ in files):
                t = self._transfers[step] = _Transfer(step, prefix, save)
            self._state.pop(step, None)
        if old_t is not None and old_t is not t:  # an earlier attempt at this step that no hook ended: dropped
            old_t.aborted = True
            self._publisher.submit(step, self._drop, old_t)
        for fname, size in files:
            path = os.path.join(directory, fname)
            t.files[fname] = _FileSend(f"{prefix}/{fname}", path, os.open(path, os.O_RDONLY | os.O_CLOEXEC),
                                       int(size), plan_parts(int(size), self.unit_bytes))

    def written(self, step: int, written: dict[str, int]) -> None:
        """``written`` (``{file: bytes}``) of the files are on disk: the parts that end by then leave. Returns at
        once (the parts go to this site's threads)."""
        t = self._transfers.get(step)
        if t is None or t.aborted:
            return
        for fname, nbytes in written.items():
            fs = t.files.get(fname)
            if fs is not None:
                self._count("parts_while_saving", self._submit_parts(t, fs, int(nbytes)))

    def _thread_error(self, fn: Callable[..., Any], e: BaseException) -> None:
        self._count("thread_errors")
        log.error("replication to a bucket: %s failed on this site's thread: %s: %s", getattr(fn, "__name__", fn),
                  type(e).__name__, e)

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self.stats[name] += n

    def _submit_parts(self, t: _Transfer, fs: _FileSend, nbytes: int) -> int:
        with fs.lock:
            first = fs.submitted
            while fs.submitted < len(fs.ends) and fs.ends[fs.submitted] <= nbytes:
                fs.futures.append(self._parts.submit(t.step, self._send_part, t, fs, fs.submitted))
                fs.submitted += 1
            return fs.submitted - first

    def _send_part(self, t: _Transfer, fs: _FileSend, k: int) -> None:
        if t.aborted or t.error is not None:
            return
        try:
            with fs.create_lock:  # not fs.lock: a report never waits on this request
                if fs.upload is None:
                    if t.error is not None:  # an earlier part's create failed: the publish sends the file whole
                        return  # (an upload made now could come after the publish listed the open ones)
                    try:
                        fs.upload = self.multipart.create(fs.name)
                        if t.save:  # before the abort record's check: an abort that misses it finds the entry
                            self.objects.put(self._journal(t, fs), b"")
                    except BaseException as e:
                        if t.error is None:  # before the lock is released: the parts queued on it see it
                            t.error = e
                        raise
                    if self._aborted_meanwhile(t):  # the abort's listing may have missed it: never leave it open
                        self.multipart.abort(fs.upload)
                        self.objects.delete([self._journal(t, fs)])
                        self._count("uploads_aborted_late")
                        log.info("replication to a bucket: upload of %s created after its save was aborted; "
                                 "aborted", self.url.child(fs.name))
                if t.aborted:
                    return
            start, end = fs.bounds(k)
            data = _pread(fs.fd, start, end - start, fs.path)
            fs.parts[k + 1] = self.multipart.upload_part(fs.upload, k + 1, data)
            self._count("parts_sent")
        except BaseException as e:  # noqa: BLE001 - kept on the transfer: its publish resends the file whole
            if t.error is None:
                t.error = e
            log.warning("replication to a bucket: part %d of %s failed: %s", k + 1, self.url.child(fs.name), e)

    def _journal(self, t: _Transfer, fs: _FileSend) -> str:
        return journal_name(t.prefix, t.save, fs.name.rsplit("/", 1)[1], fs.upload.upload_id)

    def _aborted_meanwhile(self, t: _Transfer) -> bool:
        """Whether ``t``'s save was aborted: here (``t.aborted``, set before the abort lists the open uploads) or,
        for a DCP save, by its coordinator (whose abort record is put before it lists them). Checked after an
        upload is created: one created after that listing sees the flag or the record."""
        if not t.aborted and t.save and self.objects.fetcher.exists(f"{ABORTS}/{t.save}"):
            t.aborted = True
        return t.aborted

    # -- after the source commit -----------------------------------------------------------------------------------
    def publish(self, step: int, path: str, *, on_error: Callable[[BaseException], None]) -> None:
        """Publish committed checkpoint ``path`` once every part is in (on the publisher thread; returns at once).
        Its small files are read and its data files opened here, on the caller's thread: retention may delete
        the directory once this returns. ``on_error`` gets what failed (the uploads under its prefix aborted)."""
        with self._cond:
            self._state[step] = ("publishing", None)
        try:
            snap = _Committed.of(os.path.abspath(path))
        except (OSError, CheckpointError) as e:
            t = self._transfers.pop(step, None)
            if t is not None:  # its parts went to an upload no publish will complete (a retry sends it whole)
                t.aborted = True
                self._publisher.submit(step, self._abandon, t, False)
            self._failed(step, "", None, e, on_error)
            return
        self._publisher.submit(step, self._publish, step, snap, on_error)

    def _publish(self, step: int, snap: "_Committed", on_error: Callable[[BaseException], None]) -> None:
        t = self._transfers.pop(step, None)
        marker = snap.marker
        prefix = commit_name(step, marker.get("seq")) if marker is not None else os.path.basename(snap.path)
        try:
            if t is not None and t.prefix != prefix:  # named for another commit: never publish it under this one
                self._abandon(t)
                t = None
            if marker is None:  # a DCP directory saved again: its old marker must never list new objects
                self.objects.delete([f"{prefix}/{DCP_METADATA}"])
            objects = self._send_data(step, t, prefix, snap, ranks=marker is None and t is not None)
            for n, body in snap.small.items():  # index.json: small, whole
                ref = self.objects.put(f"{prefix}/{n}", body)
                objects[n] = {"size": ref.size, "etag": ref.etag}
            if marker is not None:  # last: the marker makes the set a commit (bucket_tier's layout)
                self.objects.put(f"{prefix}/{store.COMMIT}", store.sealed_marker(marker, objects=objects))
            else:
                self.objects.put(f"{prefix}/{DCP_METADATA}", snap.dcp_metadata)
            info = {"path": str(self.url.child(prefix)), "ready_at": time.time()}
            with self._cond:
                self._state[step] = ("done", info)
                self.stats["published"] += 1
                self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported through on_error (log line, count, retry)
            self._failed(step, prefix, t, e, on_error)
            return
        finally:
            snap.close()
            if t is not None:
                _close_files(t)
        self._sweep_logged(prefix, t.save if t is not None else "")
        self._retain_logged()

    # -- retention -------------------------------------------------------------------------------------------------
    def retain(self, now: float | None = None) -> list[str]:
        """Apply ``keep`` and ``replica_ttl`` to the replicas under the site (see the module doc); returns the
        names deleted. Runs after each publish (on the publisher thread, so never during one; :meth:`wait`
        returns before it), and callable by hand."""
        if self.keep is None and self.replica_ttl is None:
            return []
        deleted = [store.step_name(s) for s in self._tier.retain(self.keep, max_age_s=self.replica_ttl, now=now)]
        sets: dict[str, dict[str, ObjectRef]] = {}
        records: dict[str, ObjectRef] = {}
        for name, ref in self.objects.list().items():
            head, _, rest = name.partition("/")
            if head in (ABORTS, UPLOADS):
                records[name] = ref
            elif rest and not head.startswith(".") and not is_commit_name(head):
                sets.setdefault(head, {})[rest] = ref
        # DCP replicas: committed by their .metadata, in the order the server stored those
        dcp_done = sorted((n for n, objs in sets.items() if DCP_METADATA in objs),
                          key=lambda n: (sets[n][DCP_METADATA].modified or 0.0, n))
        doomed = expired(dcp_done, self.keep, self.replica_ttl, lambda n: sets[n][DCP_METADATA].modified, now)
        for n in doomed:
            delete_set(self.objects, n, list(sets[n]), DCP_METADATA)
        newest = sets[dcp_done[-1]][DCP_METADATA].modified if dcp_done else None
        for n, objs in sets.items():  # no publish runs now: a set without .metadata older than the newest is
            #                            a delete or a failed publish cut short (its retry sends it whole)
            if DCP_METADATA not in objs and newest is not None and \
                    all(r.modified is not None and r.modified <= newest for r in objs.values()):
                delete_set(self.objects, n, list(objs), DCP_METADATA)
        old = (time.time() if now is None else now) - ABORT_RECORD_S
        stale = [n for n, r in records.items() if r.modified is not None and r.modified < old]
        for n in stale:  # a journal entry this old: its save crashed long ago (a live one is swept by its publish)
            parts = n.split("/")
            if parts[0] == UPLOADS and len(parts) == 5:  # .uploads/<prefix>/<save>/<file>/<upload id>
                self.multipart.abort(Upload(f"{parts[1]}/{parts[3]}", parts[4]))
        if stale:
            self.objects.delete(stale)
        deleted += doomed
        self._count("deleted", len(deleted))
        return deleted

    def _retain_logged(self) -> None:
        try:
            gone = self.retain()
        except (BucketError, CheckpointError) as e:  # replicas kept one more round: logged, counted
            self._count("retention_failures")
            log.warning("replication to a bucket: retention under %s failed (retried after the next publish): %s",
                        self.url, e)
            return
        if gone:
            log.info("replication to a bucket: retention deleted %s under %s", gone, self.url)

    def _failed(self, step: int, prefix: str, t: _Transfer | None, e: BaseException,
                on_error: Callable[[BaseException], None]) -> None:
        if t is not None:  # its parts stopped first: none opens an upload after the listing below
            t.aborted = True
            for fs in t.files.values():
                for f in list(fs.futures):
                    f.exception()
        if prefix:
            self._abort_open(prefix)
            if t is not None:
                self._forget_logged(prefix, t.save)
        with self._cond:
            self._state[step] = ("failed", e)
            self._cond.notify_all()
        on_error(e)

    def _send_data(self, step: int, t: _Transfer | None, prefix: str, snap: "_Committed", *,
                   ranks: bool) -> dict[str, dict[str, Any]]:
        """Every data file of the commit in the bucket, completed and checked: ``{name: {size, etag}}``.
        ``ranks``: files this process did not announce are other DCP ranks' uploads, completed here once whole."""
        refs: dict[str, ObjectRef] = {}
        ranks_by = time.monotonic() + self.rank_wait_s  # one wait for every rank (they upload at once)
        for fname, (fd, size) in snap.data.items():
            fs = t.files.get(fname) if t is not None else None
            if fs is not None:  # ours: what the writer did not report leaves now
                if t.error is None:
                    self._count("parts_at_publish", self._submit_parts(t, fs, fs.size))
                for f in list(fs.futures):  # after an error too: none still reads the file or opens an upload
                    f.result()
                if t.error is None:
                    parts = [fs.parts[k] for k in sorted(fs.parts)]
                    refs[fname] = self._complete(fs.upload, parts) if fs.size else self.objects.put(fs.name, b"")
                    continue
            if fs is not None:
                log.warning("replication to a bucket: resending %s whole after %s", self.url.child(fs.name),
                            t.error)
            other = self._rank_upload(prefix, t.save, fname, size, ranks_by) if ranks and fs is None and size \
                else None
            if other is not None:
                refs[fname] = self._complete(*other)
            else:
                if ranks and fs is None and size:  # the wait is over: the ranks still missing get one look each
                    ranks_by = 0.0
                refs[fname] = self._send_whole(f"{prefix}/{fname}", fd, size, os.path.join(snap.path, fname),
                                               step=step)
        return {n: {"size": r.size, "etag": r.etag} for n, r in refs.items()}

    def _complete(self, up: Upload, parts: list[Part]) -> ObjectRef:
        self.multipart.verify_parts(up, parts)
        return self.multipart.complete(up, parts)

    def _send_whole(self, name: str, fd: int, size: int, path: str, *, step: int = -1) -> ObjectRef:
        """Send a committed data file (open as ``fd``) as a fresh multipart upload, its unit-aligned parts
        concurrently (an upload of it left open is aborted first)."""
        self._count("files_sent_whole")
        for up in self.multipart.open_uploads(name):
            if up.name == name:
                self.multipart.abort(up)
        if not size:
            return self.objects.put(name, b"")
        t = _Transfer(step, name)
        fs = t.files[name] = _FileSend(name, path, fd, size, plan_parts(size, self.unit_bytes))
        self._submit_parts(t, fs, size)
        for f in fs.futures:
            f.result()
        if t.error is not None:
            raise t.error
        return self._complete(fs.upload, [fs.parts[k] for k in sorted(fs.parts)])

    def _rank_upload(self, prefix: str, save: str, fname: str, size: int,
                     deadline: float) -> tuple[Upload, list[Part]] | None:
        """Another rank's upload of ``<prefix>/<fname>`` in save ``save`` (the one its journal entry names; an
        upload left open by an earlier attempt at this directory has the sizes of the plan too, not its bytes) once
        the server lists every part of its plan (waits until ``deadline``, the publish's one ``rank_wait_s`` for
        all ranks: looked up once past it); None when it does not come (the caller sends the file itself)."""
        name = f"{prefix}/{fname}"
        if not save:  # no save id (a single process): no upload can be told to be this save's
            return None
        ends = plan_parts(size, self.unit_bytes)
        want = [(k + 1, e - (ends[k - 1] if k else 0)) for k, e in enumerate(ends)]
        pause = 0.05
        while True:
            for uid in self._journaled(prefix, save, fname):
                try:
                    parts = self.multipart.list_parts(Upload(name, uid))
                except BucketError as e:  # aborted (the rank's own late abort): not this save's upload now
                    if e.reason != "not_found":
                        raise
                    continue
                if [(p.number, p.size) for p in parts] == want:
                    return Upload(name, uid), parts
            if time.monotonic() + pause > deadline:
                log.warning("replication to a bucket: no complete upload of %s from its rank after %.0f s; "
                            "sending it from here", self.url.child(name), self.rank_wait_s)
                return None
            time.sleep(pause)
            pause = min(1.0, pause * 2)

    def _journaled(self, prefix: str, save: str, fname: str) -> list[str]:
        """The upload ids journaled for ``<prefix>/<fname>`` in save ``save``."""
        return [n.rsplit("/", 1)[1] for n in self.objects.list(journal_name(prefix, save, fname))]

    def _forget(self, prefix: str, save: str) -> None:
        """Delete save ``save``'s journal entries under ``prefix`` (its uploads are completed or aborted)."""
        if save:
            gone = list(self.objects.list(journal_name(prefix, save)))
            if gone:
                self.objects.delete(gone)

    def _sweep(self, prefix: str, save: str) -> None:
        """After save ``save``'s publish under ``prefix``: abort the uploads still open there that no other save
        in progress owns (its own orphans: a create whose reply was lost and was retried, a rank's upload that
        came too late; and what earlier attempts at this prefix left open), and drop the journal entries of this
        save and of those attempts. Another save owns the uploads its journal names if it is not older than this
        one (an entry as recent as this save's first); a Checkpointer commit's prefix is its own alone."""
        saves: dict[str, list[tuple[str, float | None]]] = {}  # save -> [(entry, server time)]
        for n, ref in self.objects.list(journal_name(prefix, "")).items():
            parts = n.split("/")  # .uploads/<prefix>/<save>/<file>/<upload id>
            if len(parts) == 5:
                saves.setdefault(parts[2], []).append((n, ref.modified))
        mine = saves.pop(save, [])
        times = [m for _, m in mine]
        start = min((m for m in times if m is not None), default=None) if None not in times else None
        owned: set[str] = set()  # upload ids of saves in progress
        stale: list[str] = []  # journal entries of earlier attempts (their uploads aborted below)
        for entries in saves.values():
            newest = max(math.inf if m is None else m for _, m in entries)  # no time: taken as in progress
            if start is None or newest >= start:  # same second as this save's first: maybe in progress, kept
                owned.update(n.rsplit("/", 1)[1] for n, _ in entries)
            else:
                stale += [n for n, _ in entries]
        ups = [up for up in self.multipart.open_uploads(f"{prefix}/") if up.upload_id not in owned]
        for up in ups:
            self.multipart.abort(up)
        gone = [n for n, _ in mine] + stale
        if gone:
            self.objects.delete(gone)
        if ups:
            log.info("replication to a bucket: %d upload(s) left open under %s (not this save's completed ones) "
                     "aborted", len(ups), self.url.child(prefix))

    def _sweep_logged(self, prefix: str, save: str) -> None:
        try:
            self._sweep(prefix, save)
        except BucketError as e:  # the replica is published: an upload left open is invisible (the next sweeps)
            log.warning("replication to a bucket: cannot abort the uploads left open under %s: %s",
                        self.url.child(prefix), e)

    # -- an aborted save -------------------------------------------------------------------------------------------
    def abort(self, step: int) -> None:
        """The save of ``step`` failed: stop its parts and abort every upload open under its prefix (on the
        publisher thread, after the parts in flight)."""
        t = self._transfers.pop(step, None)
        if t is None:
            return
        t.aborted = True
        self._publisher.submit(step, self._abandon, t)

    def _abandon(self, t: _Transfer, record: bool = True) -> None:
        """Stop ``t``'s parts, close its files and abort its uploads; ``record``: a DCP save's abort record too."""
        t.aborted = True
        if t.save and record:  # before the listing below: a rank's upload that listing misses finds the record
            try:
                self.objects.put(f"{ABORTS}/{t.save}", b"")
            except BucketError as e:
                log.warning("replication to a bucket: cannot record the abort of %s (an upload another rank "
                            "creates later may stay open): %s", self.url.child(t.prefix), e)
        for fs in t.files.values():
            for f in list(fs.futures):
                f.exception()
        _close_files(t)
        self._abort_open(t.prefix)
        self._forget_logged(t.prefix, t.save)

    def _drop(self, t: _Transfer) -> None:
        """An earlier attempt at a step announced again (a save that failed where no hook here heard of it, e.g.
        on another DCP rank): its parts stopped, its files closed, its own uploads aborted (not the prefix's: the
        new attempt's are there)."""
        for fs in t.files.values():
            for f in list(fs.futures):
                f.exception()
        _close_files(t)
        for fs in t.files.values():
            if fs.upload is not None:
                try:
                    self.multipart.abort(fs.upload)
                    if t.save:  # its own entry only: the new attempt may be the same save
                        self.objects.delete([self._journal(t, fs)])
                except BucketError as e:  # nothing was completed: an upload left open stays invisible
                    log.warning("replication to a bucket: cannot abort the upload of %s from an earlier attempt: %s",
                                self.url.child(fs.name), e)
        log.info("replication to a bucket: %s announced again; the earlier attempt's uploads aborted",
                 self.url.child(t.prefix))

    def _forget_logged(self, prefix: str, save: str) -> None:
        try:
            self._forget(prefix, save)
        except BucketError as e:  # an entry left names an upload aborted: the prefix's next publish drops it
            log.warning("replication to a bucket: cannot delete the upload journal of %s: %s",
                        self.url.child(prefix), e)

    def _abort_open(self, prefix: str) -> None:
        try:
            self.multipart.abort_all(f"{prefix}/")
        except BucketError as e:  # nothing was completed: an upload left open stays invisible
            log.warning("replication to a bucket: cannot abort the uploads under %s: %s", self.url.child(prefix), e)

    def urgent(self, step: int) -> None:
        """Send ``step`` first: its parts not yet started and its publish go ahead of every other step's (queued
        work is picked when a thread frees up; what is already on the wire finishes)."""
        with self._cond:
            self._urgent.add(step)
            for old in sorted(self._urgent)[:-8]:  # a few recent steps
                self._urgent.discard(old)

    # -- waiting, closing ------------------------------------------------------------------------------------------
    def wait(self, step: int, timeout: float | None = None) -> dict[str, Any]:
        """Block until ``step``'s publish ends: its ``{"path", "ready_at"}``, or the failure (CheckpointError)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                kind, info = self._state.get(step, ("sending", None))
                if kind == "done":
                    return info
                if kind == "failed":
                    raise CheckpointError(f"replica not published in {self.url} (retried in the background): "
                                          f"{info}", step=step) from info
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CheckpointError(f"replica not published in {self.url} within {timeout} s", step=step)
                self._cond.wait(left)

    def failed(self, step: int) -> bool:
        with self._cond:
            return self._state.get(step, ("", None))[0] == "failed"

    def close(self) -> None:
        """Finish the publishes queued, send the parts reported, then close the clients."""
        self._publisher.pool.shutdown(wait=True)  # first: a publish still hands parts to the pool
        self._parts.pool.shutdown(wait=True)
        for t in list(self._transfers.values()):
            _close_files(t)
        self.multipart.close()
        self.objects.close()


@dataclass
class _Committed:
    """A committed checkpoint directory as :meth:`BucketSite.publish` found it: its marker, small files in memory,
    data files open (read from the descriptors even once retention deletes the directory)."""

    path: str
    marker: dict[str, Any] | None  # a Checkpointer commit's COMMIT; None for DCP
    dcp_metadata: bytes
    small: dict[str, bytes]
    data: dict[str, tuple[int, int]]  # name -> (fd, size)

    @classmethod
    def of(cls, path: str) -> "_Committed":
        names = sorted(n for n in os.listdir(path) if not n.endswith(".tmp"))
        if store.COMMIT not in names and DCP_METADATA not in names:
            raise CheckpointError("checkpoint is not committed (no COMMIT or .metadata)", path=path)
        marker = store.read_marker(path) if store.COMMIT in names else None
        small, data = {}, {}
        try:
            for n in names:
                full = os.path.join(path, n)
                if is_data_file(n):
                    fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
                    data[n] = (fd, os.fstat(fd).st_size)
                elif n == DCP_METADATA or (n != store.COMMIT and not n.startswith(".")):
                    with open(full, "rb") as f:
                        small[n] = f.read()
        except BaseException:
            for fd, _ in data.values():
                os.close(fd)
            raise
        return cls(path, marker, small.pop(DCP_METADATA, b""), small, data)

    def close(self) -> None:
        for fd, _ in self.data.values():
            os.close(fd)
        self.data = {}


def _pread(fd: int, offset: int, length: int, path: str) -> bytearray:
    buf = bytearray(length)
    view = memoryview(buf)
    got = 0
    while got < length:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"data file ended at {offset + got} bytes, a part needs {offset + length}",
                                  path=path)
        got += n
    return buf


def _close_files(t: _Transfer) -> None:
    for fs in t.files.values():
        if fs.fd >= 0:
            try:
                os.close(fs.fd)
            except OSError:
                pass
            fs.fd = -1
