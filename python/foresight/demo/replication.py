"""The demo's replication section: its checkpoint sent to an evaluation site while it is saved, merged there.

Two sites on loopback as real processes (``foresight.testing.sites``: ``foresight node serve --site``, no etcd: the
training site routes ``eval-b`` to the evaluation site's address). The step the demo checkpointed mid-training is
saved again by a :class:`~foresight.checkpoint.Checkpointer` with a :class:`~foresight.replication.policy.Replication`
under the training site's root (a node sends only what lies under its root): its units leave as the data file is
written, the replica is published after the commit, and the evaluation site merges it into one safetensors file
per module group. Reported: commit -> replica ready, the bytes left to send at the commit; checked: the replica
loads equal to the training run's checkpoint, and the merged model equals its model.

Example::

    sites = start_sites("demo-out")
    measured = replicate_checkpoint(sites, "demo-out", step=12)
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import load_file

from foresight.checkpoint import Checkpointer, load
from foresight.replication.policy import Replication
from foresight.testing.sites import SiteProcess

UNIT_BYTES = 256 << 10  # the toy checkpoint (~1.3 MB) in several units, so some leave while the file is written
START_TIMEOUT_S = 60.0
WAIT_S = 120.0
JOB = "demo"


def start_sites(out: str) -> tuple[SiteProcess, SiteProcess]:
    """The evaluation site ``eval-b``, then the training site ``train-a`` routing to it (raises if either fails)."""
    ev = SiteProcess("eval-b", os.path.join(out, "eval-site"), unit_bytes=UNIT_BYTES, timeout=START_TIMEOUT_S)
    try:
        tr = SiteProcess("train-a", os.path.join(out, "train-site"), routes={"eval-b": ev.url},
                         unit_bytes=UNIT_BYTES, timeout=START_TIMEOUT_S)
    except BaseException:
        ev.stop()
        raise
    return ev, tr


def stop_sites(sites: tuple[SiteProcess, SiteProcess]) -> None:
    """Both at once (each drains for a few seconds)."""
    ev, tr = sites
    evaluation = threading.Thread(target=ev.stop, name="demo-stop-eval-b")
    evaluation.start()
    try:
        tr.stop()
    finally:
        evaluation.join()


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every tensor of a nested state (dicts, lists), by its dotted path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}{i}.")
    elif hasattr(obj, "dtype") and hasattr(obj, "shape"):
        yield prefix[:-1], obj


def _same(a: dict, b: dict) -> bool:
    return bool(a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def replicate_checkpoint(sites: tuple[SiteProcess, SiteProcess], checkpoint_root: str, step: int) -> dict[str, Any]:
    ev, tr = sites
    saved = load(step, root=checkpoint_root)  # the training run's checkpoint: what the replica must equal
    rep = Replication(every=step, site="eval-b", node=tr.url, job=JOB, unit_bytes=UNIT_BYTES,
                      merge={"groups": {"model.": "model", "optim.": "optim"}})
    try:
        with Checkpointer(os.path.join(tr.root, JOB), replicate=rep) as ckpt:
            t0 = time.perf_counter()
            src = ckpt.save(saved.state_dict, step, extra_state=saved.extra_state).wait().path
            save_s = time.perf_counter() - t0
        info = rep.wait(step, timeout=WAIT_S)
        merged = ev.call("replica.merged", {"name": rep.name(step), "timeout": WAIT_S})
    finally:
        rep.close()
    replica = load(step, root=os.path.dirname(info["path"]))
    want = dict(_tensors(saved.state_dict))
    loads_equal = _same(dict(_tensors(replica.state_dict)), want) and replica.extra_state == saved.extra_state
    model = {k: v for p in merged["paths"].get("model", []) for k, v in load_file(p).items()}
    merged_equal = _same(model, {k: v for k, v in want.items() if k.startswith("model.")})
    got = {
        "replica loads equal": loads_equal,
        "merged model equals": merged_equal,
        "save (s)": round(save_s, 3),
        "commit -> replica ready (s)": round(info["ready_at"] - info["committed_at"], 3),
        "bytes left at commit": f"{info['bytes_left_at_commit']} of {info['bytes_sent']}",
        "units": info["units"],
        "merged at": os.path.dirname(next(iter(merged["paths"].values()))[0]) if merged["paths"] else None,
    }
    print(f"  {src} -> eval-b at {info['path']}: {info['units']} units of {UNIT_BYTES >> 10} KiB, "
          f"{info['bytes_left_at_commit']} of {info['bytes_sent']} bytes left to send at the commit, ready "
          f"{got['commit -> replica ready (s)']} s after it; loads equal: {loads_equal}; "
          f"merged to {sorted(merged['paths'])}, model equal: {merged_equal}")
    return got
