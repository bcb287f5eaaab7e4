"""The cluster room: what the storage node and replication both build on.

* :mod:`.membership` (:class:`Cluster`): nodes under leases, shard placement, jobs and issued tokens in etcd (the
  key layout is documented there).
* :mod:`.auth`: per-call credentials (the ``x-foresight-job``/``x-foresight-token`` headers), job admission, TLS,
  and :func:`connect` (a Flight client with them).
* :mod:`.requests`: field checks every Flight handler runs before acting on a request.
* :mod:`.throttle` (:class:`ServiceLimit`): a node's service limit (bytes and requests per second).
* :mod:`.metrics` (:class:`NodeMetrics`): Prometheus counters (needs the ``node`` extra's prometheus-client).

Example::

    from foresight.cluster import Cluster, ServiceLimit, connect

    cluster = Cluster("http://127.0.0.1:2379")
    client = connect(cluster.nodes()["n1"]["location"])
    limit = ServiceLimit.parse("32M:400")
"""
from __future__ import annotations

from foresight.cluster.auth import call_options, connect
from foresight.cluster.membership import DEFAULT_PREFIX, Cluster
from foresight.cluster.throttle import ServiceLimit

__all__ = ["DEFAULT_PREFIX", "Cluster", "ServiceLimit", "call_options", "connect"]
