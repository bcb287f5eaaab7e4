"""The replica planner: how many copies of each hinted file, and on which nodes, before a synchronized restart.

replicas(file) = ceil(expected concurrent readers / safe readers per replica), never fewer than the base replication
and capped by the nodes available, a per-file cap and the job's quota (extra bytes and extra replicas). Hot files come
first (most readers), then small ones (most readers served per byte copied), so a tight quota goes where it pays.
Copies go to distinct nodes, least loaded first, the load projected as the plan places readers on them. Every cap
that bit is recorded with its reason; files whose hot bytes are a small part of them are reported with the bytes the
file granularity copies in vain.

Placement has a cost, and a copy must pay for it. When the nodes' service rate is known (``node_bytes_per_s`` and,
optionally, ``node_requests_per_s``: each node's limit), each copy beyond what the holders and the base replication
give is weighed: with ``c`` copies the file's readers wait about ``readers x t_read / c`` at the copies' nodes
(``t_read`` = one read's time there, ``max(size / bytes_per_s, 1 / requests_per_s)``), so copy ``c + 1`` saves
``readers x t_read x (1/c - 1/(c+1))``. It costs ``placement_cost_s`` (the control path: plan, task pick-up, copy
registered, readers told; fixed, whatever the size) plus its source read, ``t_read``. Copies are added while the
saving exceeds the cost; the first one that does not pay stops the file, recorded as ``capped_by="placement_cost"``.
So when host sharing already cut the readers to one per host, a file that the existing copies serve nearly as fast
gets no copy and the restart is not held up by placement. Without a known rate the rule is off (the formula alone).

A read schedule can hide placement: when the readers first read their cold files (per-rank shards, each on the base
copies) and the hinted files after, the placement runs meanwhile. ``lead_s`` is that head start
(:func:`cold_lead_s`: the cold bytes and reads spread over the nodes at their service rate); the fixed cost counts only
beyond it, ``max(0, placement_cost_s - lead_s)``, while the copy's source read still costs its ``t_read``.

When the readers are not held for the copies (``join``: they read from the copies that exist, and new ones take the
readers that come after they are registered), the base copies serve meanwhile, so nothing waits for placement; a
copy helps if the base copies still have readers left when it lands, ``readers x t_read > have x L`` with ``L =
max(0, P - lead_s) + t_read`` its landing. How many then is a question of the file's finish, not of concurrent
readers (:func:`finish_replicas`): with ``c`` copies the file's reads take the copies' node time, each new copy
serving from when it lands (its source read queued at the ``have`` holders: the ``k``-th lands at ``max(0, P - lead)
+ ceil(k / have) x t_read``) and its source read taken from the holders, so ``T(c) = (readers x t_read + (c - have)
x t_read + sum of the landings) / c``; the count is the ``c`` (up to the node cap, beyond the formula's) that ends
the file's reads soonest. With the cold reads first, the hot reads have every node: a file that keeps its base
copies busy well past the landing goes on every node, at ``size`` bytes a copy.

Example::

    plan = plan_replicas(hints, nodes={"n0": 0.2, "n1": 0.5, "n2": 0.1}, holders={".metadata": ["n0"]},
                         safe_readers=64, quota_bytes=8 << 30)
    for f in plan.files: print(f.path, f.replicas, f.new_nodes, f.capped_by)
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from foresight.replication.hints import FileHint, HintError

DEFAULT_BASE_REPLICAS = 3
DEFAULT_SAFE_READERS = 64  # concurrent readers one replica serves before its node's queue dominates the read


@dataclass
class FilePlan:
    path: str
    size: int
    readers: int
    wanted: int  # replicas the formula asks for
    replicas: int  # replicas after the caps
    holders: list[str]  # nodes that already hold it
    new_nodes: list[str]  # nodes that get a new copy
    capped_by: str | None = None  # "nodes", "per_file", "placement_cost", "quota_bytes", "quota_replicas"
    granularity_waste: int = 0  # bytes per extra copy that no hot reader needs
    sized_by: str = "formula"  # "formula" (readers / safe readers) or "finish" (readers not held: finish_replicas)

    @property
    def copy_bytes(self) -> int:
        return self.size * len(self.new_nodes)


@dataclass
class ReplicaPlan:
    files: list[FilePlan] = field(default_factory=list)

    @property
    def copy_bytes(self) -> int:
        return sum(f.copy_bytes for f in self.files)

    @property
    def new_replicas(self) -> int:
        return sum(len(f.new_nodes) for f in self.files)

    def wasteful(self, *, min_fraction: float = 0.5) -> list[FilePlan]:
        """Files copied mostly for bytes no hot reader needs (a layout that isolates hot tensors would avoid it)."""
        return [f for f in self.files if f.new_nodes and f.size and f.granularity_waste / f.size >= min_fraction]


def wanted_replicas(readers: int, safe_readers: int, base: int) -> int:
    """The formula: ceil(readers / safe readers per replica), at least the base replication."""
    if safe_readers < 1:
        raise HintError(f"safe readers per replica {safe_readers} < 1")
    return max(base, math.ceil(readers / safe_readers))


def cold_lead_s(cold_bytes: int, cold_reads: int, nodes: int, *, node_bytes_per_s: float | None,
                node_requests_per_s: float | None = None) -> float:
    """How long ``nodes`` nodes at their service rate take to serve the reads a restart does before its hinted
    files (``cold_reads`` reads of ``cold_bytes`` in total): the time placement has to land its copies unseen.
    0 without a known rate or nodes.

    Example::

        cold_lead_s(512 * (32 << 10), 512, 8, node_bytes_per_s=4 << 20, node_requests_per_s=200)   # 0.5
    """
    if cold_bytes < 0 or cold_reads < 0:
        raise HintError(f"cold bytes {cold_bytes} and cold reads {cold_reads} must be >= 0")
    if nodes < 1 or not node_bytes_per_s or node_bytes_per_s <= 0:
        return 0.0
    lead = cold_bytes / (nodes * node_bytes_per_s)
    if node_requests_per_s:
        lead = max(lead, cold_reads / (nodes * node_requests_per_s))
    return lead


def paying_replicas(readers: int, size: int, have: int, target: int, *, node_bytes_per_s: float | None,
                    node_requests_per_s: float | None = None, placement_cost_s: float = 0.0,
                    lead_s: float = 0.0, join: bool = False) -> int:
    """Copies (``have`` <= result <= ``target``) worth their placement: copy ``c + 1`` is added while it saves the
    readers more time than it costs (see the module docstring): ``max(0, placement_cost_s - lead_s)`` plus its
    source read; with ``join`` (readers not held for the copies) none pays unless the base copies would still be busy
    with the file when one lands, and then the count up to ``target`` that ends the file's reads soonest
    (:func:`finish_replicas`). ``node_bytes_per_s`` None: ``target``.

    Example::

        paying_replicas(64, 256 << 10, 3, 4, node_bytes_per_s=4 << 20, placement_cost_s=0.5)   # 3: saves 0.33 s
        paying_replicas(512, 256 << 10, 3, 8, node_bytes_per_s=4 << 20, placement_cost_s=0.5)  # 8
        paying_replicas(64, 256 << 10, 3, 4, node_bytes_per_s=4 << 20, placement_cost_s=0.5, lead_s=0.5)  # 4
    """
    if not node_bytes_per_s or node_bytes_per_s <= 0:
        return target
    t_read = size / node_bytes_per_s
    if node_requests_per_s:
        t_read = max(t_read, 1.0 / node_requests_per_s)
    cost = max(0.0, placement_cost_s - max(0.0, lead_s)) + t_read
    if join:
        return finish_replicas(readers, t_read, have, target, land_s=cost - t_read) if \
            readers * t_read > max(1, have) * cost else have
    c = max(1, have)
    while c < target and readers * t_read * (1 / c - 1 / (c + 1)) > cost:
        c += 1
    return max(have, min(c, target))


def finish_time_s(readers: int, t_read: float, have: int, copies: int, *, land_s: float) -> float:
    """When ``copies`` copies (``have`` of them there from the start) end ``readers`` reads of ``t_read`` each: the
    new ones land ``land_s`` after the start plus their source reads, queued ``have`` at a time at the holders, and
    those reads take holder time too (see the module docstring). ``inf`` when a copy would land after the end."""
    have = max(1, have)
    landings = [land_s + math.ceil(k / have) * t_read for k in range(1, copies - have + 1)]
    end = (readers * t_read + len(landings) * t_read + sum(landings)) / max(1, copies)
    return end if not landings or landings[-1] < end else math.inf


def finish_replicas(readers: int, t_read: float, have: int, cap: int, *, land_s: float) -> int:
    """The copy count in ``have..cap`` that ends the file's reads soonest (:func:`finish_time_s`; the fewest on a
    tie), for readers that are not held for the copies.

    Example::

        finish_replicas(64, 0.0625, 3, 8, land_s=0.0)   # 8: 1.33 s on the 3 base copies, 0.59 s on 8
        finish_replicas(64, 0.0625, 3, 8, land_s=1.5)   # 3: copies landing after 1.5 s end nothing sooner
    """
    have = max(1, have)
    best = min(range(have, max(have, cap) + 1), key=lambda c: (finish_time_s(readers, t_read, have, c,
                                                                               land_s=land_s), c))
    return best


def plan_replicas(hints: Sequence[FileHint], nodes: Mapping[str, float], *,
                  holders: Mapping[str, Sequence[str]] | None = None, safe_readers: int = DEFAULT_SAFE_READERS,
                  base_replicas: int = DEFAULT_BASE_REPLICAS, max_per_file: int | None = None,
                  quota_bytes: int | None = None, quota_replicas: int | None = None,
                  node_bytes_per_s: float | None = None, node_requests_per_s: float | None = None,
                  placement_cost_s: float = 0.0, lead_s: float = 0.0, join: bool = False) -> ReplicaPlan:
    """Plan replicas for ``hints`` over ``nodes`` (node id -> current load in concurrent readers).

    ``holders`` lists the nodes that already hold each file (the base replicas); they count toward the total and
    never get a second copy. Quotas bound the *new* copies of this job. ``node_bytes_per_s``,
    ``node_requests_per_s`` (a node's service rate) and ``placement_cost_s`` weigh each copy above the base
    replication against its placement (:func:`paying_replicas`), less the ``lead_s`` a cold-first read schedule
    gives it, or by the ``join`` rule when the readers are not held for the copies; without a rate every wanted
    copy is placed.
    """
    holders = holders or {}
    unknown = sorted({n for hs in holders.values() for n in hs} - set(nodes))
    if unknown:
        raise HintError(f"holders name nodes that are not available: {unknown}")
    # projected load per node: current load plus the readers each copy will take; a heap finds the freest
    load = dict(nodes)
    bytes_left = quota_bytes if quota_bytes is not None else math.inf
    replicas_left = quota_replicas if quota_replicas is not None else math.inf
    plan = ReplicaPlan()
    for h in sorted(hints, key=lambda h: (-h.readers, h.size, h.path)):
        have = list(dict.fromkeys(holders.get(h.path, ())))
        wanted = wanted_replicas(h.readers, safe_readers, base_replicas)
        target, capped = wanted, None
        for limit, reason in ((len(nodes), "nodes"), (max_per_file, "per_file")):
            if limit is not None and target > limit:
                target, capped = limit, reason
        by_finish = join and bool(node_bytes_per_s)  # readers not held: sized by the file's finish, up to the cap
        if by_finish:
            cap = min(x for x in (len(nodes), max_per_file) if x is not None)
            target, capped = max(target, cap), "nodes" if cap == len(nodes) else "per_file"
        floor = max(len(have), min(base_replicas, target))  # the base replication is not weighed
        paying = paying_replicas(h.readers, h.size, floor, target, node_bytes_per_s=node_bytes_per_s,
                                 node_requests_per_s=node_requests_per_s, placement_cost_s=placement_cost_s,
                                 lead_s=lead_s, join=join)
        if paying < target:
            target, capped = paying, "placement_cost"
        extra = max(0, target - len(have))
        if extra and h.size and extra * h.size > bytes_left:
            extra, capped = int(bytes_left // h.size), "quota_bytes"
        if extra > replicas_left:
            extra, capped = int(replicas_left), "quota_replicas"
        heap = [(load[n], n) for n in nodes if n not in have]
        heapq.heapify(heap)
        new = [heapq.heappop(heap)[1] for _ in range(min(extra, len(heap)))]
        total = len(have) + len(new)
        per_replica = h.readers / max(1, total)
        for n in have + new:
            load[n] += per_replica
        bytes_left -= h.size * len(new)
        replicas_left -= len(new)
        plan.files.append(FilePlan(h.path, h.size, h.readers, wanted, total, have, new, capped,
                                   h.granularity_waste, "finish" if by_finish else "formula"))
    return plan
