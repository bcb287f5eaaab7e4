"""``foresight node serve`` options that mount checkpoint replication on a storage node (``--site`` turns it on).

Light on purpose (argparse only): the node's CLI imports it to build its parser; the replication machinery
(torch, Flight, etcd) loads only when a node is started with ``--site``.

Example::

    foresight node serve --root /data/ckpt --etcd http://10.0.0.5:2379 --site train-a --route eval-b=grpc://gw:9000
"""
from __future__ import annotations

import argparse
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint replication")
    g.add_argument("--site", default=None, help="this node's site; mounts checkpoint replication")
    g.add_argument("--route", action="append", default=[], metavar="SITE=URL",
                   help="Flight endpoint (e.g. a WAN gateway) of another site's node; others are found in etcd")
    g.add_argument("--replication-token", default="", help="shared by the sites of one deployment")
    g.add_argument("--replication-unit-mib", type=int, default=32, help="transfer unit size (units.UNIT_BYTES)")
    g.add_argument("--replication-unit-bytes", type=int, default=None, help=argparse.SUPPRESS)  # tests: tiny units
    g.add_argument("--replication-streams", type=int, default=2, help="units in flight per sender")
    g.add_argument("--replication-ttl", type=int, default=3600, help="seconds a received replica stays registered")
    g.add_argument("--replication-fifo", action="store_true", help="no priority lane: arrival order (a baseline)")


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
