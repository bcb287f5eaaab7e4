"""The restart storm's arithmetic: what each way of serving the hot files must move from the storage nodes, and the
least time the bed's resources allow for it (its *floor*), with the resource that sets it.

Each node serves at most ``b`` bytes and ``r`` requests per second (its service limit); the bed has no other cap on
a transfer (no per-connection limit: a reader keeps one channel per node and the limit is the node's). A mode's
floor is the largest of:

* ``node bandwidth``: every byte the nodes serve (hot reads, the ranks' shards, copies made on the restore's clock)
  over all ``N`` nodes, ``bytes / (N b)``;
* ``requests``: every read over all nodes, ``reads / (N r)``;
* ``hot holders``: a hot file's reads over the nodes that hold it, ``readers x max(size / b, 1 / r) / copies``
  (3 base copies; 5 uniform; the plan's copies for hinted modes, as if there from the start: a lower bound).

Hot readers are the ranks, or the hosts when a host's ranks share (one fetch per host). The measured time over the
floor is what the rest costs: placement, the order of the reads, and CPU (the bench reports the machine's busy
share during each storm: near 1, the processes waited for a core).

Example::

    floor = mode_floor(nodes=8, node_bytes_per_s=4 << 20, node_requests_per_s=200, ranks=512, ranks_per_host=8,
                       hot={".metadata": 1060, "__0_data.bin": 262144}, shard_bytes=32768, shared=True,
                       copies={".metadata": 3, "__0_data.bin": 3})
    floor["floor_s"], floor["bound"]        # 1.33, "hot holders (3 copies of __0_data.bin)"
"""
from __future__ import annotations

import math
from collections.abc import Mapping


def mode_floor(*, nodes: int, node_bytes_per_s: float, node_requests_per_s: float | None, ranks: int,
               ranks_per_host: int, hot: Mapping[str, int], shard_bytes: int, shared: bool,
               copies: Mapping[str, int], copy_bytes: int = 0) -> dict:
    """The floor of one mode (see the module docstring): bytes and reads from the nodes, each resource's time, the
    largest (``floor_s``) and what sets it (``bound``)."""
    hosts = math.ceil(ranks / ranks_per_host)
    readers = hosts if shared else ranks
    hot_bytes = readers * sum(hot.values())
    cold_bytes = ranks * shard_bytes
    node_bytes = hot_bytes + cold_bytes + copy_bytes
    reads = readers * len(hot) + ranks
    times = {f"node bandwidth ({nodes} nodes)": node_bytes / (nodes * node_bytes_per_s)}
    if node_requests_per_s:
        times[f"requests ({nodes} nodes)"] = reads / (nodes * node_requests_per_s)
    for f, size in hot.items():
        t_read = max(size / node_bytes_per_s, 1 / node_requests_per_s if node_requests_per_s else 0.0)
        n = max(1, min(nodes, copies.get(f, 3)))
        times[f"hot holders ({n} copies of {f})"] = readers * t_read / n
    bound = max(times, key=times.get)
    return {"hot_readers": readers, "hot_bytes": hot_bytes, "cold_bytes": cold_bytes, "copy_bytes": copy_bytes,
            "node_bytes": node_bytes, "node_reads": reads, "times_s": times, "floor_s": times[bound], "bound": bound}


def bed_line(nodes: int, node_bytes_per_s: float, node_requests_per_s: float | None) -> str:
    """The bed's aggregate rates, for the report."""
    req = f", {nodes * node_requests_per_s:.0f} requests/s" if node_requests_per_s else ""
    return (f"{nodes} nodes x {node_bytes_per_s / 2**20:.0f} MiB/s = {nodes * node_bytes_per_s / 2**20:.0f} MiB/s "
            f"aggregate{req}; no per-connection cap")


__all__ = ["bed_line", "mode_floor"]
