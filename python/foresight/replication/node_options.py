"""Mount checkpoint replication on a storage node from ``foresight node serve`` options (``--site`` turns it on;
the options are defined in :mod:`foresight.node.cli`, which must not import torch to build its parser). The service
is built before the node server answers its first call and mounted right after the server is constructed.

Example::

    foresight node serve --root /data/ckpt --etcd http://10.0.0.5:2379 --site train-a --route eval-b=grpc://gw:9000
"""
from __future__ import annotations

import argparse
import os
from typing import Any


def prepare_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~foresight.replication.service.ReplicationService` the options ask for (None without
    ``--site``), built before the node server starts answering, so :func:`mount_from_args` right after the server
    is constructed leaves no window in which a restarted site refuses units ("no DoPut for 'replica.unit'")."""
    if not getattr(args, "site", None) or not os.path.isdir(args.root):
        return None  # no replication; or no root: the node server names the problem
    # verifying a DCP replica unpickles its .metadata, which imports torch.distributed.checkpoint (seconds on a
    # busy host): pay that once at start-up, not inside the first replica's commit-to-ready time
    import torch.distributed.checkpoint.metadata  # noqa: F401

    from foresight.replication.service import ReplicationService  # lazy: loads torch (node.cli's parser must not)

    try:
        routes = dict(r.split("=", 1) for r in args.route)
    except ValueError:
        raise SystemExit(f"--route wants SITE=URL, got {args.route}") from None
    etcd = args.etcd.split(",")[0] if args.etcd else None
    return ReplicationService(args.site, args.root, etcd=etcd, routes=routes, token=args.replication_token,
                              unit_bytes=args.replication_unit_bytes or args.replication_unit_mib << 20,
                              streams=args.replication_streams, replica_ttl=args.replication_ttl,
                              fifo=args.replication_fifo, retry_s=args.replication_retry_s)


def mount_from_args(server: Any, service: Any) -> Any:
    """Mount ``service`` (from :func:`prepare_from_args`; None: nothing) on ``server``; returns it."""
    if service is not None:
        service.mount(server)
    return service
