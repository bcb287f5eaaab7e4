"""The client side: :class:`NodeSource`, a loader decode stage whose decoding happens on the storage nodes.

It plugs into the loader where a :class:`~foresight.loader.MediaDecodeStage` goes and wraps one: per step it asks
every node that holds some of the step's samples for its part (one ``DoGet`` per node, in parallel), and assembles
the tensors in plan order exactly as the stage would have. Whatever a node does not deliver -- it is down, slow
(the call's deadline passes), restarted (it forgot the job: the source registers again), or it answered with raw
bytes under its CPU guard -- is decoded here by the wrapped stage with the same (seed, epoch, sample) keys, from
the bytes the loader already read (or the node's raw bytes). Every sample of the step is in the batch once, at its
position: none lost, repeated or reordered. A node that failed is retried after a backoff, and used again once back.

Without the loader, :meth:`NodeSource.iterate` yields the batches itself and reads on this host only the samples it
must decode here, so with healthy nodes the host neither reads nor decodes (the paper's host-CPU saving).

Copies: on the node the decoded batch tensor is the Arrow values buffer (zero copy until gRPC writes it); here the
received tensors view Arrow's buffers, and stacking each modality into the (pinned) batch tensor is the one copy
(``stats["copied_bytes"]``); raw parts are gathered once before decoding.

Example::

    stage = MediaDecodeStage([ds], specs, seed=1)
    source = NodeSource(stage, plan, etcd="http://127.0.0.1:2379", token="s3cret-token", job="run-7")
    with Loader(plan, datasets=ds, decode=stage, source=source) as loader:
        for batch in loader:
            batch["video"], batch["video_index"]       # as with the stage alone, bit for bit
    source.close()
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import uuid
from collections import deque
from typing import Any, Iterator

import numpy as np
import pyarrow.flight as flight

from foresight.errors import NodeError
from foresight.cluster.membership import DEFAULT_PREFIX, Cluster
from foresight.loader.batch import Batch
from foresight.loader.options import resolve_rank
from foresight.media import output_hash
from foresight.node.client_links import NodeLink, NodeLinks
from foresight.node.client_replies import asked_once, assign_nodes, subset_rows, verify_raw
from foresight.node.jobs import spec_digest
from foresight.node.protocol import (GUARD_REPLIES, KIND_DEFERRED, KIND_RAW, corrupt_positions, decode_blocks,
                                     deferred_positions, raw_samples)
from foresight.source import (LocalPartReader, PartBytes, decode_part, lookup_samples, modality_codes,
                              pin_by_default, spec_codes, stack_samples)

log = logging.getLogger("foresight.node.client")


class NodeSource(NodeLinks):
    """See the module docstring. Keyword-only options.

    Args:
        stage: the :class:`~foresight.loader.MediaDecodeStage` (specs, seed, datasets) nodes and fallback share.
        plan: the plan the loader follows (its digest and rank view are registered with the nodes).
        etcd: etcd endpoint(s) to find nodes; or ``nodes``: node locations (single node without etcd).
        token: the job's token (at least 8 characters), sent on every call.
        job: job id (default: a random one); rank ``r`` registers on the nodes as ``<job>.<r>``.
        rank, world_size: leave them out: a Loader given this source sets its own (:meth:`bind_rank`); without a
            Loader (:meth:`iterate`) they come from ``torch.distributed`` when initialised, else 0 and 1. Given
            and different from the Loader's, the Loader refuses them.
        lead: steps each node prepares ahead; queue_bytes: cap of each node's queue for this job.
        timeout: deadline of one step's call in seconds (a slower node is treated as down for this step).
        register_timeout: deadline of a registration (the node opens the datasets and plan, starts a pool).
        retry_s: first backoff before a failed node is tried again (doubles per failure, at most 30 s; 0: next step).
        tls_root, cert: CA PEM path for ``grpc+tls`` nodes; (chain, key) PEM paths for mutual TLS.
        guard_reply: what a node under its CPU guard answers: ``"raw"`` (the sample bytes, decoded here: for a host
            whose own path to the shards is slower than the node link) or ``"defer"`` (positions only: this host
            reads and decodes those samples itself, as host-side decode would; for shared storage, where
            shipping the bytes through the node only adds a copy and the wire).
        spot_check: 0 (off) or N: 1 in N samples a node decoded is also decoded here and compared by
            :func:`~foresight.media.output_hash` (``stats["spot_checked"]``, ``stats["spot_mismatches"]``, and a
            warning naming node, step and sample per mismatch); the host's tensor is the one in the batch. Nodes
            always check the sample bytes against the shard maps' xxh3; this also catches a node whose decode
            libraries differ from the host's in a way the spec digest does not see.
    """

    def __init__(self, stage: Any, plan: Any, *, token: str, etcd: str | None = None, nodes: list[str] | None = None,
                 job: str | None = None, rank: int | None = None, world_size: int | None = None, lead: int = 2,
                 queue_bytes: int = 256 << 20, timeout: float = 30.0, retry_s: float = 1.0,
                 tls_root: str | None = None, cert: tuple[str, str] | None = None,
                 prefix: str | None = None, refresh_s: float = 2.0, register_timeout: float = 60.0,
                 guard_reply: str = "raw", spot_check: int = 0) -> None:
        if (etcd is None) == (nodes is None):
            raise ValueError("give etcd=<endpoint> or nodes=[locations], not both and not neither")
        if not isinstance(token, str) or len(token) < 8:
            raise ValueError("token must be a string of at least 8 characters")
        self.stage, self.plan, self.token = stage, plan, token
        self.job = job or f"job-{uuid.uuid4().hex[:12]}"
        self._given_rank = (rank, world_size)  # what the caller named; a Loader that differs is an error
        self.rank, self.world_size = resolve_rank(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        self.node_job = f"{self.job}.{self.rank}"
        self.lead, self.queue_bytes = int(lead), int(queue_bytes)
        self.timeout, self.retry_s, self.refresh_s = float(timeout), float(retry_s), float(refresh_s)
        self.register_timeout = max(float(register_timeout), self.timeout)
        self.tls_root, self.cert = tls_root, cert
        if guard_reply not in GUARD_REPLIES:
            raise ValueError(f"guard_reply must be one of {GUARD_REPLIES}, got {guard_reply!r}")
        self.guard_reply = guard_reply
        if isinstance(spot_check, bool) or not isinstance(spot_check, int) or spot_check < 0:
            raise ValueError(f"spot_check must be an integer >= 0 (check 1 in N node-decoded samples), got "
                             f"{spot_check!r}")
        self.spot_check = spot_check
        self._spot_seen = 0
        self.datasets = stage.datasets
        self._fingerprints = [str(ds.fingerprint) for ds in self.datasets]
        self._spec_dicts = {k: v.to_dict() for k, v in stage.specs.items()}
        self._spec_digest = spec_digest(stage.specs)
        self._codes = spec_codes(stage.specs)
        self._static = list(nodes) if nodes is not None else None
        self.cluster = None
        self._job_reg = None
        if etcd is not None:
            self.cluster = Cluster(etcd, prefix=prefix or DEFAULT_PREFIX)
        self._nodes: dict[str, NodeLink] = {}
        self._local_io: LocalPartReader | None = None  # reads here (one region reused step after step), on need
        self._refreshed = 0.0
        self._degraded = False  # some part was decoded here last step: look for nodes on every step until not
        self._step = 0
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="foresight-node-fetch")
        self.stats: dict[str, Any] = {"steps": 0, "parts_remote": 0, "parts_raw": 0, "parts_deferred": 0,
                                      "parts_failed": 0, "samples_corrupt": 0, "samples_remote": 0, "samples_raw": 0,
                                      "samples_deferred": 0, "samples_local": 0, "bytes_read_here": 0,
                                      "bytes_received": 0, "copied_bytes": 0, "reregistered": 0, "plans_uploaded": 0,
                                      "spot_checked": 0, "spot_mismatches": 0}
        if self.cluster is not None:
            self._job_reg = self.cluster.register_job(self.job, self.rank, self._job_record)

    def bind_rank(self, rank: int, world_size: int) -> None:
        """Serve ``rank`` of ``world_size``: the :class:`~foresight.loader.Loader` given this source calls it with
        its own (resolved from its arguments or ``torch.distributed``), so the nodes prepare that rank's share.
        A rank or world size given to this source that differs is a :class:`ValueError` naming both.

        Example::

            source = NodeSource(stage, plan, nodes=[loc], token=TOKEN)       # no rank here
            Loader(plan, datasets=ds, source=source, rank=1, world_size=2)          # the source serves rank 1 of 2
        """
        given_rank, given_world = self._given_rank
        if (given_rank is not None and int(given_rank) != rank) or (
                given_world is not None and int(given_world) != world_size):
            raise ValueError(f"NodeSource was given rank={given_rank}, world_size={given_world} but the Loader it "
                             f"serves is rank {rank} of world size {world_size}: give NodeSource the Loader's "
                             "(or leave them out: it takes the Loader's)")
        if (rank, world_size) == (self.rank, self.world_size):
            return
        with self._lock:
            self._unregister_nodes()  # registered as another rank: the nodes prepared that rank's share
            self.rank, self.world_size = int(rank), int(world_size)
            self.node_job = f"{self.job}.{self.rank}"
            if self._job_reg is not None:
                self._job_reg.close()
                self._job_reg = self.cluster.register_job(self.job, self.rank, self._job_record)

    # -- one step ------------------------------------------------------------------------------------------
    def decodes(self, dataset: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
        """True where this source delivers the sample decoded (its modality has a spec): a loader that hands its
        steps to this source need not read those (``Loader(..., source=...)``); the others it reads as usual."""
        return np.isin(modality_codes(self.datasets, dataset, sample_ids), list(self._codes.values()))

    def __call__(self, fields: dict, *, stats=None, first_item: int = 0) -> dict:
        """Decode one step (the loader's decode-stage interface). ``fields`` may carry the step's bytes (``data``,
        ``offsets``, ``lengths``); samples whose offset is negative, or all of them without ``data``, were not
        read by the caller and are read here when this host must decode them."""
        step = int(fields["step"])
        self._step = step
        samples = np.asarray(fields["sample_ids"])
        dataset = np.asarray(fields["dataset"])
        n = len(samples)
        codes = modality_codes(self.datasets, dataset, samples)
        shard = lookup_samples(self.datasets, dataset, samples)[0].astype(np.int64)
        wanted = np.flatnonzero(np.isin(codes, list(self._codes.values())))
        with self._lock:
            self._refresh(force=self._degraded or any(x.registered is None for x in self._nodes.values()))
            nodes = self._usable()
            owner = assign_nodes(wanted, dataset, shard, nodes)
            futures = {}
            for i, node in enumerate(nodes):
                positions = wanted[owner == i]
                if len(positions):
                    futures[node.node_id] = (node, positions, self._pool.submit(self._fetch, node, step))
            blocks: list[tuple[str, np.ndarray, Any]] = []
            raw_parts: list[tuple] = []
            covered = np.zeros(n, dtype=bool)
            deferred = np.zeros(n, dtype=bool)  # positions a guarded node asked this host to read and decode
            corrupt = np.zeros(n, dtype=bool)  # positions whose bytes failed their checksum on the node
            held: dict[int, tuple[str, Any]] = {}  # spot-checked position -> (node, the node's tensor)
            for node_id, (node, positions, fut) in futures.items():
                try:
                    kind, table = fut.result()
                    bad = corrupt_positions(table.schema)
                    if kind == KIND_RAW:
                        pos, data, offs, lens = raw_samples(table.to_batches())
                    elif kind == KIND_DEFERRED:
                        pos = deferred_positions(table.to_batches())
                    else:
                        got = decode_blocks(table.to_batches())
                except flight.FlightUnauthenticatedError:
                    raise
                except Exception as e:
                    self.stats["parts_failed"] += 1
                    self._mark_down(node, e)
                    continue
                # only the positions this node was asked for, each once: a confused node cannot add or repeat one
                if len(bad):  # the node's copy of these samples is damaged: this part failed for them
                    bad = bad[asked_once(bad, positions)]
                    corrupt[bad] = True
                    self.stats["parts_failed"] += 1
                    self.stats["samples_corrupt"] += len(bad)
                    log.warning("a node's copy of samples fails their checksum; decoding them here",
                                extra={"node": node_id, "step": step, "dataset": dataset[bad[:32]].tolist(),
                                       "samples": samples[bad[:32]].tolist()})
                if kind == KIND_DEFERRED:  # its guard is on: this host reads and decodes them, as asked
                    keep = asked_once(pos, positions)
                    deferred[pos[keep]] = True
                    self.stats["samples_deferred"] += int(keep.sum())
                elif kind == KIND_RAW:
                    keep = asked_once(pos, positions)
                    keep[keep] = ~covered[pos[keep]]
                    try:
                        verify_raw(self.datasets, fields, pos[keep], data, offs[keep], lens[keep])
                    except (ValueError, NodeError) as e:  # corrupt or wrong bytes: decode that part from our read
                        self.stats["parts_failed"] += 1
                        self._mark_down(node, e)
                        continue
                    covered[pos[keep]] = True
                    raw_parts.append((pos[keep], data, offs[keep], lens[keep]))
                    self.stats["samples_raw"] += int(keep.sum())
                else:
                    for name, pos, tensors in got:
                        keep = asked_once(pos, positions)
                        keep[keep] = (codes[pos[keep]] == self._codes.get(name, -2)) & ~covered[pos[keep]]
                        covered[pos[keep]] = True
                        self.stats["samples_remote"] += int(keep.sum())
                        if self.spot_check:  # held back: decoded here too, the host's tensor goes in the batch
                            kept = np.flatnonzero(keep)
                            spot = np.zeros(len(pos), dtype=bool)
                            spot[kept[self._spot_picks(len(kept))]] = True
                            if spot.any():
                                for p, t in zip(pos[spot], subset_rows(tensors, spot)):
                                    held[int(p)] = (node_id, t)
                                keep &= ~spot
                        if not keep.all():  # the node sent something it was not asked for, or a spot check
                            tensors = subset_rows(tensors, keep)
                        blocks.append((name, pos[keep], tensors))
                node.failures = 0
                self.stats[{KIND_RAW: "parts_raw", KIND_DEFERRED: "parts_deferred"}.get(kind, "parts_remote")] += 1
        self.stats["steps"] += 1
        local = wanted[~covered[wanted]]
        failed = int((~deferred[local]).sum())  # a node failed us, not one that deferred by design
        self._degraded = bool((~deferred[local] & ~corrupt[local]).any())  # a node is down: look for others
        self.stats["samples_local"] += failed
        if len(local):
            blocks.extend(self._decode_here(fields, local, first_item, stats))
        if raw_parts:
            blocks.extend(self._decode_raw(fields, raw_parts, first_item, stats))
        if held:
            blocks.extend(self._spot_compare(fields, held, first_item, stats))
        return self._assemble(fields, blocks)

    def _spot_picks(self, count: int) -> np.ndarray:
        """Which of the next ``count`` node-decoded samples are spot-checked: every ``spot_check``-th one."""
        seen = self._spot_seen + np.arange(count)
        self._spot_seen += count
        return seen % self.spot_check == 0

    def _spot_compare(self, fields: dict, held: dict, first_item: int, stats) -> list:
        """Decode the held samples here and compare each with the node's tensor by ``output_hash``; the host's
        tensors go into the batch either way (so a mismatch never reaches the model), a mismatch is counted and
        logged with its node, step and sample."""
        positions = np.asarray(sorted(held), dtype=np.int64)
        host = self._decode_here(fields, positions, first_item, stats)
        self.stats["spot_checked"] += len(positions)
        for name, pos, tensors in host:
            for p, t in zip(pos, tensors):
                node_id, theirs = held[int(p)]
                if output_hash(theirs) != output_hash(t):
                    self.stats["spot_mismatches"] += 1
                    log.warning("a node's decoded tensor differs from the host's decode of the same sample",
                                extra={"node": node_id, "step": int(fields["step"]), "modality": name,
                                       "dataset": int(np.asarray(fields["dataset"])[p]),
                                       "sample": int(np.asarray(fields["sample_ids"])[p])})
        return host

    def _decode_here(self, fields: dict, positions: np.ndarray, first_item: int, stats) -> list:
        dataset = np.asarray(fields["dataset"])[positions]
        samples = np.asarray(fields["sample_ids"])[positions]
        if "data" in fields and (np.asarray(fields["offsets"])[positions] >= 0).all():  # the loader read them
            part = PartBytes(fields["data"], np.asarray(fields["offsets"])[positions],
                             np.asarray(fields["lengths"])[positions])
        else:  # not read by the caller (iterate(), or a loader given this source): read just these samples now
            part = self._read_here(dataset, samples)
        return decode_part(self.stage, part, step=fields["step"], dataset=dataset, samples=samples,
                           positions=positions, first_item=first_item, stats=stats)

    def _read_here(self, dataset: np.ndarray, samples: np.ndarray) -> PartBytes:
        """Read samples of the step on this host through the read path (:class:`~foresight.source.LocalPartReader`);
        steps are decoded by one thread (:meth:`iterate`'s helper or the loader's), so the engine opened on first
        use has one user."""
        if self._local_io is None:
            self._local_io = LocalPartReader(self.datasets)
        part = self._local_io.read_samples(dataset, samples)
        self.stats["bytes_read_here"] += part.bytes_read
        return part

    def iterate(self, *, start_step: int = 0, end_step: int | None = None, prefetch: int = 1) -> Iterator:
        """This rank's batches straight from the nodes, without the loader: the host reads only the samples it
        must decode itself (a node down, slow or corrupt), so with healthy nodes it reads and decodes nothing.

        Yields :class:`~foresight.loader.Batch` es with ``step``, ``sample_ids``, ``dataset`` and, per modality with a
        spec, the stacked tensor and its ``<modality>_index`` (as with the loader); samples of other modalities are
        not read here (use the loader path for steps that mix in such samples). ``prefetch`` steps are asked for
        ahead on a helper thread.

        Example::

            for batch in source.iterate(start_step=resume_step):
                model(batch["video"].to("cuda", non_blocking=True))
        """
        end = self.plan.num_steps if end_step is None else min(int(end_step), self.plan.num_steps)
        pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="foresight-node-iterate")
        pending: deque = deque()
        step = int(start_step)
        try:
            while step < end or pending:
                while step < end and len(pending) <= prefetch:
                    pending.append((step, pool.submit(self._step_alone, step)))
                    step += 1
                s, fut = pending.popleft()
                yield Batch(s, fut.result())
        finally:
            for _, fut in pending:
                fut.cancel()
            pool.shutdown(wait=True)

    def _step_alone(self, step: int) -> dict:
        start, stop = self.plan.rank_items(step, self.rank, self.world_size)
        pieces = self.plan.pieces(start, stop)
        fields = {"step": step, "sample_ids": np.array(pieces.sample, dtype=np.int64),
                  "dataset": np.array(pieces.dataset, dtype=np.int32)}
        return self(fields, first_item=start)

    def _decode_raw(self, fields: dict, raw_parts: list, first_item: int, stats) -> list:
        """Decode raw sample bytes from the nodes with the stage; one node's part is used in place."""
        if len(raw_parts) == 1:
            positions, data, offsets, lengths = raw_parts[0]
        else:
            shift = np.cumsum([0] + [p[1].nbytes for p in raw_parts[:-1]])
            positions = np.concatenate([p[0] for p in raw_parts])
            data = np.concatenate([p[1] for p in raw_parts])
            offsets = np.concatenate([p[2] + k for p, k in zip(raw_parts, shift)])
            lengths = np.concatenate([p[3] for p in raw_parts])
            self.stats["copied_bytes"] += data.nbytes
        return decode_part(self.stage, PartBytes(data, offsets, lengths), step=fields["step"],
                           dataset=np.asarray(fields["dataset"])[positions],
                           samples=np.asarray(fields["sample_ids"])[positions], positions=positions,
                           first_item=first_item, stats=stats)

    def _assemble(self, fields: dict, blocks: list) -> dict:
        """Each modality's blocks into one (pinned) tensor in plan order, as the stage alone would give: one
        ``index_copy_`` per block (the one copy on this side); a list when shapes differ within the step."""
        import torch  # lazy: torch is an optional extra (foresight[torch]); only decode outputs need it

        out = dict(fields)
        pin = pin_by_default()
        for name in self.stage.specs:
            mine = [(pos, t) for m, pos, t in blocks if m == name and len(pos)]
            if not mine:
                continue
            order = np.sort(np.concatenate([pos for pos, _ in mine]))
            tensors = [t for _, t in mine]
            stackable = all(isinstance(t, torch.Tensor) for t in tensors) and len(
                {(tuple(t.shape[1:]), t.dtype) for t in tensors}) == 1
            if stackable:
                batch = torch.empty((len(order), *tensors[0].shape[1:]), dtype=tensors[0].dtype, pin_memory=pin)
                for pos, t in mine:
                    batch.index_copy_(0, torch.from_numpy(np.searchsorted(order, pos)), t)
                self.stats["copied_bytes"] += batch.numel() * batch.element_size()
            else:  # shapes differ: the stage itself returns a list here
                rows = sorted(((int(p), t) for pos, ts in mine for p, t in zip(pos, ts)), key=lambda r: r[0])
                batch = stack_samples([t for _, t in rows], pin=pin)
            out[name] = batch
            out[f"{name}_index"] = order.astype(np.int64)
        return out

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unregister from the nodes (best effort) and etcd."""
        self._unregister_nodes()
        for n in list(self._nodes.values()):
            if n.client is not None:
                n.client.close()
        self._pool.shutdown(wait=True)
        if self._local_io is not None:
            self._local_io.close()
            self._local_io = None
        if self._job_reg is not None:
            self._job_reg.close()
            self._job_reg = None

    def __enter__(self) -> "NodeSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["NodeSource"]
