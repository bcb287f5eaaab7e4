"""Mount checkpoint replication on a storage node from ``foresight node serve`` options (``--site`` turns it on;
the options are defined in :mod:`foresight.node.cli`, which must not import torch to build its parser). The service
is built before the node server answers its first call and mounted right after the server is constructed.

Example::

    foresight node serve --root /data/ckpt --etcd http://10.0.0.5:2379 --site train-a --route eval-b=grpc://gw:9000
"""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import socket
from typing import Any

from foresight.cluster.auth import is_loopback_address


def prepare_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~foresight.replication.service.ReplicationService` the options ask for (None without
    ``--site``), built before the node server starts answering, so :func:`mount_from_args` right after the server
    is constructed leaves no window in which a restarted site refuses units ("no DoPut for 'replica.unit'")."""
    if not getattr(args, "site", None) or not os.path.isdir(args.root):
        return None  # no replication; or no root: the node server names the problem
    check_token_policy(args.host, args.replication_token, getattr(args, "replication_no_token", False))
    if not positive_finite(args.replication_max_wait_s):  # 0: every wait answered at once, its caller asks again
        raise SystemExit(f"foresight node serve: --replication-max-wait-s {args.replication_max_wait_s:g} is not a "
                         "positive number of seconds (the longest one replicate.wait call holds a server thread)")
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
                              fifo=args.replication_fifo, retry_s=args.replication_retry_s,
                              max_wait_s=args.replication_max_wait_s)


def positive_finite(x: float) -> bool:
    """Whether ``x`` is a usable cap: a wait capped at 0 s (or less, or nan) returns at once and its caller, told
    to ask again, asks in a busy loop; an infinite one is no cap."""
    return math.isfinite(x) and x > 0


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (only this machine's callers reach it)."""
    if host == "localhost":
        return True
    try:
        return is_loopback_address(ipaddress.ip_address(host.strip("[]")))
    except ValueError:  # a host name: loopback only if every address it resolves to is
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(is_loopback_address(ipaddress.ip_address(i[4][0].split("%")[0])) for i in infos)


def check_token_policy(host: str, token: str, no_token: bool) -> None:
    """Replication without a token takes every caller's word: on a non-loopback address that is anyone on the
    network (send, abort, read checkpoints), so it needs the operator's explicit ``--replication-no-token``.
    The node's own job calls always carry a token; this mirrors that for the node-to-node replication calls."""
    if token or no_token or is_loopback(host):
        return
    raise SystemExit(f"foresight node serve: --site on --host {host} (not loopback) needs --replication-token "
                     "(shared by the sites of one deployment); pass --replication-no-token to serve replication "
                     "unauthenticated on a trusted network")


def mount_from_args(server: Any, service: Any) -> Any:
    """Mount ``service`` (from :func:`prepare_from_args`; None: nothing) on ``server``; returns it."""
    if service is not None:
        service.mount(server)
    return service
