"""Observability: the per-step hook, every stats field documented, and the default log output (a real child
process: pytest configures logging in its own)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from foresight.format import DatasetWriter, open_dataset
from foresight.loader import Loader, LoaderStats
from foresight.plan import build_plan


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("obs")
    rng = np.random.default_rng(0)
    with DatasetWriter(str(root / "ds")) as w:
        for i in range(40):
            w.add(rng.integers(0, 256, int(rng.integers(10, 5000)), dtype=np.uint8).tobytes(), modality="bytes")
    ds = open_dataset(str(root / "ds"))
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=8, num_steps=5)
    plan.save(str(root / "plan"))
    return ds, plan, root


def test_on_step_gets_a_snapshot_per_batch(setup):
    ds, plan, _ = setup
    seen = []
    with Loader(ds, plan, on_step=seen.append) as loader:
        steps = [b.step for b in loader]
    assert [s["step"] for s in seen] == steps == list(range(5))
    assert [s["steps"] >= i + 1 for i, s in enumerate(seen)] == [True] * 5
    assert seen[-1]["samples"] == 40 and seen[-1]["backend"] in ("uring", "pread")
    assert set(LoaderStats().as_dict()) <= set(seen[-1])
    seen[0]["steps"] = -1  # a snapshot, not the live counters
    assert loader.stats.steps == 5


def test_every_stats_field_is_documented():
    doc = LoaderStats.__doc__
    names = [f.name for f in dataclasses.fields(LoaderStats) if not f.name.startswith("_")] + ["amplification"]
    missing = [n for n in names if f"        {n}" not in doc]
    assert not missing, f"LoaderStats fields without a line in its docstring: {missing}"


def test_every_stats_field_is_explained_in_the_config_docs():
    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    table = text[text.index("### Loader statistics"):]
    names = [f.name for f in dataclasses.fields(LoaderStats) if not f.name.startswith("_")] + ["amplification"]
    missing = [n for n in names if f"\n| `{n}` |" not in table]
    assert not missing, f"LoaderStats fields without a row in docs/config.md: {missing}"
    assert "requested=612 B read=4.0 KiB" in str(LoaderStats(bytes_requested=612, bytes_read=4096))


SCRIPT = textwrap.dedent("""
    import logging, sys
    if sys.argv[2] == "configured":
        logging.basicConfig(level=logging.WARNING, format="APP %(name)s %(message)s")
    from foresight.loader import Loader
    with Loader(sys.argv[1]) as loader:
        for batch in loader:
            pass
    if sys.argv[2] == "configured-later":
        logging.basicConfig(level=logging.WARNING, format="APP %(name)s %(message)s")
        with Loader(sys.argv[1]) as loader:
            pass
    print("done")
""")


def _run(plan_dir, mode, env_value=None):
    env = dict(os.environ)
    env.pop("FORESIGHT_LOG", None)
    if env_value is not None:
        env["FORESIGHT_LOG"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(plan_dir), mode], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    return out.stderr


def test_unconfigured_logging_is_quiet_at_construction_by_default(setup):
    _, _, root = setup
    assert "foresight" not in _run(root / "plan", "plain")  # default warning: nothing fell back, nothing said
    for level in ("info", "INFO", "Info"):  # standard level names, any case: the start-up summary
        lines = [line for line in _run(root / "plan", "plain", level).splitlines() if line.startswith("foresight")]
        assert len(lines) == 1, lines
        assert "loader rank 0/1, backend=" in lines[0] and "B host memory (" in lines[0] and "pinned" in lines[0]


def test_foresight_log_takes_standard_level_names(setup):
    _, _, root = setup
    for quiet in ("off", "warning", "WARNING", "warn", "error", "critical"):
        err = _run(root / "plan", "plain", quiet)
        assert "foresight" not in err, (quiet, err)
    debug = _run(root / "plan", "plain", "DEBUG")
    assert "loader rank 0/1" in debug and "foresight: Arena:" in debug  # other modules' records too
    bad = _run(root / "plan", "plain", "loud")
    assert "FORESIGHT_LOG='loud' is not one of off, none, debug, info, warning, warn, error, critical" in bad


def test_configured_logging_is_left_alone(setup):
    _, _, root = setup
    assert _run(root / "plan", "configured") == ""  # WARNING level: no INFO line, no handler of ours
    later = _run(root / "plan", "configured-later", "info")
    assert later.count("loader rank 0/1") == 1  # the first loader's line from our handler; the second is INFO
    assert "APP" not in later
