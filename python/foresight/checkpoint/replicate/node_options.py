"""Mount checkpoint replication on a storage node from ``foresight node serve`` options (``--site`` turns it on;
the options are defined in :mod:`foresight.node.cli`, which must not import torch to build its parser).

Example::

    foresight node serve --root /data/ckpt --etcd http://10.0.0.5:2379 --site train-a --route eval-b=grpc://gw:9000
"""
from __future__ import annotations

import argparse
from typing import Any


def mount_from_args(server: Any, args: argparse.Namespace) -> Any:
    """A :class:`~foresight.checkpoint.replicate.service.ReplicationService` mounted on ``server``, or None."""
    if not getattr(args, "site", None):
        return None
    # verifying a DCP replica unpickles its .metadata, which imports torch.distributed.checkpoint (seconds on a
    # busy host): pay that once at start-up, not inside the first replica's commit-to-ready time
    import torch.distributed.checkpoint.metadata  # noqa: F401

    from foresight.checkpoint.replicate.service import ReplicationService

    try:
        routes = dict(r.split("=", 1) for r in args.route)
    except ValueError:
        raise SystemExit(f"--route wants SITE=URL, got {args.route}") from None
    etcd = args.etcd.split(",")[0] if args.etcd else None
    svc = ReplicationService(args.site, server.root, etcd=etcd, routes=routes, token=args.replication_token,
                             unit_bytes=args.replication_unit_bytes or args.replication_unit_mib << 20,
                             streams=args.replication_streams, replica_ttl=args.replication_ttl,
                             fifo=args.replication_fifo)
    svc.mount(server)
    return svc
