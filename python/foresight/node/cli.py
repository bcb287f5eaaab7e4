"""``foresight node {serve, status, place, job-token}``: run a storage node, print what nodes are doing, place
shards, issue a job's token.

Example::

    foresight node serve --root /data --port 7000 --etcd http://127.0.0.1:2379 --metrics-port 9100
    foresight node serve --root s3://data/root --cache-dir /nvme/cache --cache-budget 500G   # datasets in a bucket
    foresight node status --etcd http://127.0.0.1:2379          # or --node grpc://127.0.0.1:7000
    foresight node place --etcd http://127.0.0.1:2379 /data/media --nodes n1,n2
    foresight node job-token --etcd http://127.0.0.1:2379 --job run-7      # prints run-7's new token
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from foresight.bucket.opener import open_dataset
from foresight.cluster.auth import call_options, connect
from foresight.cluster.membership import Cluster
from foresight.cluster.throttle import ServiceLimit, parse_amounts
from foresight.format.cli import parse_size
from foresight.node.limits import WorkLimits
from foresight.node.logs import setup_json_logging
from foresight.node.server import NodeServer
from foresight.node.stream_drain import CANCEL_WAIT_S, DEFAULT_SHUTDOWN_GRACE_S
from foresight.replication.node_options import mount_from_args, prepare_from_args

#: Environment variable holding the nodes' admin token (``--admin-token`` of ``node serve`` and ``node status``).
ADMIN_TOKEN_ENV = "FORESIGHT_NODE_ADMIN_TOKEN"
#: SIGTERM to exit is at most ``--shutdown-grace-s`` plus this: cancelling streams, leaving etcd, freeing jobs.
EXIT_MARGIN_S = CANCEL_WAIT_S + 10.0


def url_host(host: str) -> str:
    """``host`` as a URL's host: an IPv6 address bracketed (``::`` -> ``[::]``), anything else as given. Unbracketed,
    ``grpc://:::7000`` is no location, so ``--host ::`` could not serve."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="node_command", metavar="ACTION", required=True)
    s = sub.add_parser("serve", help="serve a data root over Arrow Flight (foreground; SIGTERM stops it cleanly)")
    s.add_argument("--root", required=True,
                   help="data root: datasets and plans are named relative to it; or s3://bucket/prefix: datasets in "
                        "a bucket, read through --cache-dir")
    s.add_argument("--cache-dir", default=None,
                   help="an s3:// root's local cache (node-local NVMe; default $FORESIGHT_BUCKET_CACHE): the "
                        "datasets' fetched bytes and the plans clients upload")
    s.add_argument("--cache-budget", type=parse_size, default=None,
                   help="bytes each bucket dataset's cache may hold, e.g. 50G (default: no limit); over it, what the "
                        "jobs' plans need furthest in the future is evicted")
    s.add_argument("--cache-lookahead", type=int, default=8,
                   help="steps of each job's plan fetched from the bucket ahead of the step the node reads "
                        "(default %(default)s)")
    s.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=0, help="0 picks a free port (see --ready-file)")
    s.add_argument("--node-id", default=None,
                   help="this node's name in etcd and metrics (default: hostname and port)")
    s.add_argument("--etcd", default=None, help="etcd endpoint(s), comma-separated; none: a single node")
    s.add_argument("--ttl", type=int, default=10, help="lease TTL in seconds (a dead node drops out within it)")
    s.add_argument("--tls-cert", default=None, help="PEM certificate: serve grpc+tls (with --tls-key)")
    s.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    s.add_argument("--client-ca", default=None, help="require client certificates signed by this CA (mutual TLS)")
    s.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV, ""),
                   help=f"what node status (and replicas.stats) must present (default ${ADMIN_TOKEN_ENV}); none: "
                        "they are answered to callers on this host only")
    s.add_argument("--max-jobs", type=int, default=8, help="jobs registered at once (more are refused)")
    s.add_argument("--max-jobs-per-caller", type=int, default=None,
                   help="distinct jobs one caller (TLS identity, else host) may register at once (default: half of "
                        "--max-jobs)")
    s.add_argument("--admission", choices=("open", "issued"), default="open",
                   help="issued: only jobs whose token was issued in etcd (node job-token) register; open: a job "
                        "with no issued token is bound by its first caller's token (default %(default)s)")
    s.add_argument("--max-queue-bytes", type=int, default=1 << 30,
                   help="bytes of prepared steps one job's queue may hold (a job asking more gets this)")
    s.add_argument("--max-lead", type=int, default=8,
                   help="steps a job may have prepared ahead of the step it asks for")
    s.add_argument("--cpu-threshold", type=float, default=80.0, help="percent; 0 = always raw")
    s.add_argument("--cpu-measure", choices=("process", "cgroup", "machine"), default="process",
                   help="whose CPU the guard measures: the node's process tree, its cgroup, or the whole machine "
                        "(default %(default)s)")
    s.add_argument("--decode-threads", type=int, default=None,
                   help="threads of each job's decode pool (default: the CPU count)")
    s.add_argument("--workers", type=int, default=1, help="threads preparing steps ahead")
    s.add_argument("--job-idle-s", type=float, default=600.0,
                   help="a job not heard from for this many seconds is dropped, freeing its slot and memory")
    s.add_argument("--max-plan-bytes", type=int, default=256 << 20, help="largest plan a client may upload")
    s.add_argument("--rescan-s", type=float, default=10.0,
                   help="rescan the root for datasets added, removed or repacked every this many seconds (0: only "
                        "when a job registers a dataset the node does not know)")
    s.add_argument("--max-output-bytes-per-sample", type=int, default=256 << 20,
                   help="refuse jobs whose specs can give a larger decoded sample (0: no cap; default 256 MiB)")
    s.add_argument("--max-step-bytes", type=int, default=2 << 30,
                   help="refuse jobs whose step part (rank's samples x largest sample) can be larger (default 2 GiB)")
    s.add_argument("--max-decode-bytes-per-job", type=int, default=4 << 30,
                   help="refuse jobs whose decoding (threads' working sets + the step) can take more (default 4 GiB)")
    s.add_argument("--shutdown-grace-s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="on SIGTERM, seconds streams in flight may run on before they are cancelled; the process "
                        f"exits within this plus {EXIT_MARGIN_S:.0f} s (default %(default)s)")
    s.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0 picks one)")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address /metrics listens on (0.0.0.0: every interface, for a Prometheus on another host)")
    s.add_argument("--ready-file", default=None, help="write {node, location, metrics_port, pid} here when serving")
    s.add_argument("--log-level", default="INFO", help="JSON log lines at this level (DEBUG, INFO, WARNING, ERROR)")
    s.add_argument("--service-limit", default=None,
                   help="checkpoint reads this node serves per second, BYTES[K|M|G][:REQUESTS] (e.g. 64M:500)")
    s.add_argument("--replica-quota", default="64G:4096",
                   help="per job: extra bytes and copies its replication hints may place, BYTES[K|M|G]:COPIES")
    s.add_argument("--safe-readers", type=int, default=None, help="concurrent readers one replica serves well")
    s.add_argument("--placement-cost-s", type=float, default=None,
                   help="seconds placing one hinted copy costs a restart beyond its bytes; a copy is placed only when "
                        "it saves the readers more at --service-limit (default: 2 x the task poll, 0.5 s)")
    _add_replication_arguments(s)
    st = sub.add_parser("status", help="per node and job: queue depth, lead, bytes, fallbacks; CPU")
    st.add_argument("--etcd", default=None, help="etcd endpoint(s), comma-separated: every registered node")
    st.add_argument("--node", action="append", default=None, help="node location (repeatable) instead of etcd")
    st.add_argument("--tls-root", default=None, help="PEM CA that signed the nodes' certificates (grpc+tls)")
    st.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    st.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV, ""),
                    help=f"the nodes' --admin-token (default ${ADMIN_TOKEN_ENV}); none: ask nodes on this host only")
    p = sub.add_parser("place", help="place a dataset's shards on nodes and record it in etcd")
    p.add_argument("dataset", help="the dataset directory (read for its fingerprint and shard count)")
    p.add_argument("--etcd", required=True, help="etcd endpoint(s), comma-separated")
    p.add_argument("--nodes", default=None, help="comma-separated node ids (default: live nodes holding it)")
    t = sub.add_parser("job-token", help="issue (or rotate) a job's token in etcd and print it; nodes admit the "
                                         "job's registrations only with it")
    t.add_argument("--etcd", required=True, help="etcd endpoint(s), reached with the operator's credentials")
    t.add_argument("--job", required=True, help="the job's name, as given to NodeSource(job=...)")


def run(args: argparse.Namespace) -> int:
    return {"serve": _serve, "status": _status, "place": _place, "job-token": _job_token}[args.node_command](args)


def _add_replication_arguments(p: argparse.ArgumentParser) -> None:
    """Predictive checkpoint replication to another site (``--site`` mounts it; see replication/).
    Defined here, not imported: importing foresight.checkpoint loads torch, which `node status` must not pay."""
    g = p.add_argument_group("checkpoint replication")
    g.add_argument("--site", default=None, help="this node's site; mounts checkpoint replication")
    g.add_argument("--route", action="append", default=[], metavar="SITE=URL",
                   help="Flight endpoint (e.g. a WAN gateway) of another site's node; others are found in etcd")
    g.add_argument("--replication-token", default="", help="shared by the sites of one deployment; required when "
                   "--host is not a loopback address (unless --replication-no-token)")
    g.add_argument("--replication-no-token", action="store_true",
                   help="serve replication with no token on a non-loopback --host: anyone reaching the port may "
                        "send, abort or read checkpoints (a trusted network only)")
    g.add_argument("--replication-unit-mib", type=int, default=32, help="transfer unit size in MiB (large tensors are cut into units; small ones packed)")
    g.add_argument("--replication-unit-bytes", type=int, default=None, help=argparse.SUPPRESS)  # tests: tiny units
    g.add_argument("--replication-streams", type=int, default=2, help="units in flight per sender")
    g.add_argument("--replication-ttl", type=int, default=3600, help="seconds a received replica stays registered")
    g.add_argument("--replication-fifo", action="store_true", help="no priority lane: arrival order (a baseline)")
    g.add_argument("--replication-max-wait-s", type=float, default=300.0,
                   help="longest one replicate.wait call holds a server thread; a caller waiting longer asks again "
                        "(default %(default)s)")
    g.add_argument("--replication-retry-s", type=float, default=60.0,
                   help="how long a sender waits for a site that is down or restarting")


def _serve(args: argparse.Namespace) -> int:
    import logging

    setup_json_logging(args.log_level)
    log = logging.getLogger("foresight.node")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("foresight node serve: give both --tls-cert and --tls-key, or neither")
    scheme = "grpc+tls" if args.tls_cert else "grpc"
    # every option checked before anything starts: a bad value is an error at once, with or without etcd (these
    # two were read only when the replica manager started, so without --etcd a typo served silently)
    args.service_limit_parsed = ServiceLimit.parse(args.service_limit)
    args.replica_quota_parsed = parse_amounts(args.replica_quota, "--replica-quota")
    cluster = None
    node_id_box: list[str] = []
    if args.etcd:
        cluster = Cluster(args.etcd)
    elif args.admission == "issued":
        raise SystemExit("foresight node serve: --admission issued needs --etcd (tokens are issued there)")

    replication = prepare_from_args(args)  # its slow imports before the node answers: mounted before serving
    server = NodeServer(
        args.root, location=f"{scheme}://{url_host(args.host)}:{args.port}",
        tls=(args.tls_cert, args.tls_key) if args.tls_cert else None, client_ca=args.client_ca,
        node_id=args.node_id, max_jobs=args.max_jobs, max_queue_bytes=args.max_queue_bytes, max_lead=args.max_lead,
        cpu_threshold=args.cpu_threshold, cpu_measure=args.cpu_measure, decode_threads=args.decode_threads,
        workers=args.workers, job_idle_s=args.job_idle_s, max_plan_bytes=args.max_plan_bytes,
        limits=WorkLimits(args.max_output_bytes_per_sample, args.max_step_bytes, args.max_decode_bytes_per_job),
        rescan_s=args.rescan_s, shutdown_grace_s=args.shutdown_grace_s,
        served_shards=(lambda fp: cluster.served_shards(node_id_box[0], fp)) if cluster else None,
        admission=args.admission, issued_tokens=cluster.job_token_digest if cluster else None,
        max_jobs_per_caller=args.max_jobs_per_caller, cache_dir=args.cache_dir, cache_budget=args.cache_budget,
        cache_lookahead=args.cache_lookahead, admin_token=args.admin_token)
    node_id_box.append(server.node_id)
    mount_from_args(server, replication)
    metrics_port = (server.metrics.serve_http(args.metrics_port, args.metrics_host)
                    if args.metrics_port is not None else None)
    registration = None
    if cluster is not None:
        def record() -> dict:
            return {"node": server.node_id, "instance": server.instance, "location": server.location,
                    "datasets": server.datasets, "plans": server.plans, "metrics_port": metrics_port,
                    "load": {"cpu_percent": server.guard.cpu_percent, "guard": server.guard.engaged,
                             "jobs": len(server._jobs)}}

        registration = cluster.register_node(server.node_id, record, ttl=args.ttl)
    replicas = _mount_replicas(server, cluster, args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"node": server.node_id, "location": server.location, "metrics_port": metrics_port,
                       "pid": os.getpid(), "instance": server.instance}, f)
        os.replace(tmp, args.ready_file)
    while not stop.wait(0.5):
        pass
    log.info("signal received, shutting down", extra={"node": server.node_id})
    _exit_by(args.shutdown_grace_s + EXIT_MARGIN_S, log)
    if registration is not None:
        registration.close()  # leave the cluster first: clients stop choosing this node
    if replicas is not None:
        replicas.close()
    if replication is not None:
        replication.close()
    if not server.stop():  # gRPC stuck even after cancelling: the bound holds anyway
        logging.shutdown()
        os._exit(0)
    return 0


def _exit_by(seconds: float, log) -> None:
    """The documented bound on SIGTERM-to-exit: whatever hangs in the shutdown (etcd, replication, gRPC), the
    process exits ``seconds`` after the signal, saying so."""
    def force() -> None:
        log.error("shutdown took longer than its bound; exiting now", extra={"bound_s": seconds})
        import logging

        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


def _mount_replicas(server, cluster, args: argparse.Namespace):
    """The replica manager (replication hints, checkpoint reads under the service limit); needs etcd."""
    if cluster is None:
        return None
    from foresight.replication.replica_manager import ReplicaManager  # lazy: loads torch (node status must not)

    quota_bytes, quota_copies = args.replica_quota_parsed
    kw = {"safe_readers": args.safe_readers} if args.safe_readers else {}
    if args.placement_cost_s is not None:
        kw["placement_cost_s"] = args.placement_cost_s
    return ReplicaManager(server, cluster, limit=args.service_limit_parsed, lease_ttl=args.ttl,
                          quota_bytes=int(quota_bytes), quota_replicas=int(quota_copies), **kw)


def _node_statuses(args: argparse.Namespace) -> list[dict]:
    import pyarrow.flight as flight

    if args.node:
        locations = args.node
    elif args.etcd:
        locations = [r["location"] for _, r in sorted(Cluster(args.etcd).nodes().items())]
    else:
        raise SystemExit("foresight node status: give --etcd or --node")
    out = []
    for loc in locations:
        try:
            client = connect(loc, tls_root=args.tls_root)
            res = list(client.do_action(flight.Action("status", b"{}"),
                                        call_options(None, args.admin_token or None, timeout=10)))
            out.append(json.loads(res[0].body.to_pybytes()))
            client.close()
        except Exception as e:  # one unreachable node must not hide the others
            out.append({"location": loc, "error": str(e)[:200]})
    return out


def _status(args: argparse.Namespace) -> int:
    statuses = _node_statuses(args)
    if args.json:
        print(json.dumps(statuses, indent=1, default=str))
        return 0
    for s in statuses:
        if "error" in s:
            print(f"{s['location']}  UNREACHABLE  {s['error']}")
            continue
        print(f"node {s['node']}  {s['location']}  cpu {s['cpu_percent']:.0f}% "
              f"({s.get('cpu_measure', 'machine')})  "
              f"guard {'ON (raw or deferred)' if s['guard_engaged'] else 'off'}  jobs {len(s['jobs'])}/{s['max_jobs']}")
        t = s.get("served", {})
        print(f"  served in all: {(t.get('bytes_decoded', 0) + t.get('bytes_raw', 0)) / 2**20:.1f} MiB, "
              f"{t.get('samples_decoded', 0)} samples decoded, {t.get('samples_raw', 0)} raw, "
              f"{t.get('samples_deferred', 0)} deferred to their hosts")
        corrupt = s.get("corrupt_samples", {})
        if corrupt:  # the node's copy of these datasets is damaged: their clients decode those samples themselves
            print(f"  samples failing their checksum here: {sum(corrupt.values())} ("
                  + ", ".join(f"{d} {n}" for d, n in sorted(corrupt.items())) + "); not served, decoded by clients")
        dec = ", ".join(f"{m} {v:.2f}s" for m, v in sorted(s["decode_seconds"].items())) or "-"
        print(f"  decode time by modality: {dec}")
        for job, j in sorted(s["jobs"].items()):
            served = j.get("bytes_decoded", 0) + j.get("bytes_raw", 0)
            samples = j.get("samples_decoded", 0) + j.get("samples_raw", 0) + j.get("samples_deferred", 0)
            print(f"  job {job}: queue {j.get('queue_depth', 0)} steps, lead {j.get('lead', 0)}, "
                  f"{j.get('queue_bytes', 0) / 2**20:.1f} MiB queued, served {served / 2**20:.1f} MiB / {samples} "
                  f"samples, fallback rate {j['fallback_rate']:.2f}")
    return 0


def _place(args: argparse.Namespace) -> int:
    ds = open_dataset(args.dataset)
    cluster = Cluster(args.etcd)
    fp = str(ds.fingerprint)
    if args.nodes:
        nodes = [n for n in args.nodes.split(",") if n]
    else:
        nodes = sorted(i for i, r in cluster.nodes().items()
                       if any(d.get("fingerprint") == fp for d in r.get("datasets", {}).values()))
    if not nodes:
        print(f"foresight node place: no live node holds dataset {args.dataset} ({fp})", file=sys.stderr)
        return 1
    assignment = cluster.place(fp, num_shards=len(ds.shard_paths), nodes=nodes)
    print(json.dumps({"dataset": fp, "placement": {f"{s:06d}": n for s, n in assignment.items()}}))
    return 0


def _job_token(args: argparse.Namespace) -> int:
    print(Cluster(args.etcd).issue_job_token(args.job))
    return 0
