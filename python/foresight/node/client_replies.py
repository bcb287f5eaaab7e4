"""What :class:`~foresight.node.client.NodeSource` checks about the nodes' parts of a step: which node serves each
sample, each position a node answers taken once and only if it was asked, the rows kept, and raw bytes checked
against the shard maps before they are decoded here.

Example::

    owner = assign_nodes(wanted, dataset, shard, nodes)   # node index per wanted position, -1: decode here
    keep = asked_once(reply_positions, positions)         # a confused node cannot add or repeat a position
    tensors = subset_rows(tensors, keep)
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from foresight.errors import NodeError


def assign_nodes(wanted: np.ndarray, dataset: np.ndarray, shard: np.ndarray, nodes: Sequence[Any]) -> np.ndarray:
    """For each wanted position, the index in ``nodes`` of the node that serves it (-1: none; decoded here).
    ``nodes[i].served`` is, per dataset, the set of shards the node serves or None (all).

    Among several nodes serving a shard, the shard's number picks one, so a dataset placed nowhere in
    particular is still spread over the nodes that hold it."""
    owner = np.full(len(wanted), -1, dtype=np.int64)
    if not nodes or not len(wanted):
        return owner
    keys = np.stack([dataset[wanted].astype(np.int64), shard[wanted]], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    for u, (d, s) in enumerate(uniq):  # a loop over the step's distinct shards, not its samples
        holders = [i for i, node in enumerate(nodes)
                   if node.served[int(d)] is None or int(s) in node.served[int(d)]]
        if holders:
            owner[inverse.reshape(-1) == u] = holders[int(s) % len(holders)]
    return owner


def verify_raw(datasets: Sequence[Any], fields: dict, positions: np.ndarray, data: np.ndarray, offsets: np.ndarray,
               lengths: np.ndarray) -> None:
    """A node's raw bytes must be the packed ones: lengths and xxh3 checked against the shard maps."""
    dataset = np.asarray(fields["dataset"])[positions]
    samples = np.asarray(fields["sample_ids"])[positions]
    for d in np.unique(dataset):
        mask = dataset == d
        if not np.array_equal(lengths[mask], datasets[int(d)].sample_bytes()[samples[mask]]):
            raise NodeError("raw bytes from a node have the wrong lengths", step=fields["step"])
        datasets[int(d)].verify_packed(samples[mask], data, offsets[mask])


def asked_once(pos: np.ndarray, asked: np.ndarray) -> np.ndarray:
    """True at the first occurrence of each value of ``pos`` that is in ``asked``: a confused node cannot add or
    repeat a position."""
    keep = np.zeros(len(pos), dtype=bool)
    keep[np.unique(pos, return_index=True)[1]] = True
    return keep & np.isin(pos, asked)


def subset_rows(tensors, mask: np.ndarray):
    """The rows of a stacked tensor, or the items of a list of tensors, where ``mask`` is True."""
    if isinstance(tensors, list):
        return [t for t, k in zip(tensors, mask) if k]
    return tensors[torch_index(mask)]


def torch_index(mask: np.ndarray):
    """``mask``'s True indices as a torch index tensor."""
    import torch  # lazy: torch is an optional extra (foresight[torch]); only decode outputs need it

    return torch.from_numpy(np.flatnonzero(mask))


__all__ = ["asked_once", "assign_nodes", "subset_rows", "torch_index", "verify_raw"]
