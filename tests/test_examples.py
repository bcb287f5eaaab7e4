"""Every example in examples/ runs, as a user would run it, in its small (--smoke) setting."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from installed import require
from process_diagnostics import kill_and_reap

from foresight.testing.tether import start_tethered

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "python"))
RUN_TIMEOUT_S = 300  # one launch's bound (a hung example), far above its run on a loaded 2-core machine


def run(argv: list[str], timeout: int = RUN_TIMEOUT_S, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run an example in a session of its own, so that a hung one is killed with the nodes, etcd and ranks it
    started (a bound for a hung test, not a timing assertion). Its output goes to files, not pipes: a node it left
    running would hold a pipe open, and reading to its end would wait for that node. That output is printed too,
    whatever happens (pytest shows it with any failure: an assertion on the result, a hang, pytest-timeout).
    ``env``: variables added to the example's environment."""
    with tempfile.TemporaryDirectory(prefix="foresight-example-") as logs:
        out_path, err_path = Path(logs, "stdout"), Path(logs, "stderr")
        with open(out_path, "w") as out_file, open(err_path, "w") as err_file:
            proc = start_tethered(argv, cwd=ROOT, env={**ENV, **(env or {})}, stdout=out_file, stderr=err_file, text=True)
        try:
            proc.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
        finally:
            try:
                kill_and_reap(proc, f"example {argv}", group=True)  # and whatever it left running
            finally:
                out, err = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
                print(f"$ {' '.join(argv)}  (exit {proc.returncode})\n{out}", flush=True)
                print(err, file=sys.stderr, flush=True)
    if hung:
        raise AssertionError(f"{argv} still running after {timeout} s\n{out[-3000:]}\n{err[-6000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def launches(n: int) -> pytest.MarkDecorator:
    """pytest-timeout's bound for a test of ``n`` launches: theirs added up (and a margin), so that a hung launch is
    ended by :func:`run`, which names it, rather than the whole test by pytest-timeout."""
    return pytest.mark.timeout(n * RUN_TIMEOUT_S + 120)


def example(name: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, str(EXAMPLES / name), *args], **kw)


def torchrun(name: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(EXAMPLES / name), *args], **kw)


def steps_logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow  # three torchrun launches of 2 ranks
@launches(3)
def test_llm_megatron_torchrun_kill_and_exact_resume(tmp_path):
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    torchrun("llm_megatron_torchrun.py", "--smoke", "--out", str(ref))
    killed = torchrun("llm_megatron_torchrun.py", "--smoke", "--out", str(crashed), "--kill-at-step", "9",
                      check=False)
    assert killed.returncode != 0, "rank 1 was SIGKILLed: torchrun must report the job failed"
    assert "rank 1: SIGKILL at step 9 as asked by --kill-at-step: an intended crash" in killed.stdout
    before = steps_logged(crashed)
    assert max(e["step"] for e in before) < 11  # the run really stopped early
    resumed = torchrun("llm_megatron_torchrun.py", "--smoke", "--out", str(crashed))
    assert "resumed from step-" in resumed.stdout
    for rank in (0, 1):  # each rank compared the steps it repeated, and says how many
        line = next(x for x in resumed.stdout.splitlines() if x.startswith(f"rank {rank}: compared the "))
        assert line.endswith("losses: equal") and int(line.split()[4]) > 0, line
    want = {(e["rank"], e["step"]): e for e in steps_logged(ref)}
    got = steps_logged(crashed)
    assert {(e["rank"], e["step"]) for e in got} == set(want)  # every step of both ranks ran
    for entry in got:  # before the kill and after the resume: same batch, bit-identical loss
        assert entry == want[(entry["rank"], entry["step"])], entry
    assert len(got) > len(want)  # the steps after the last complete checkpoint ran twice, identically


@pytest.mark.slow  # two torchrun launches of 2 ranks
@launches(2)
def test_llm_megatron_kill_waits_for_a_lagging_rank(tmp_path):
    """Rank 0 logs step 8 late and rank 1 is killed at step 9 once the step-8 checkpoint is complete
    (tests/lagging_rank): rank 0 still logged step 8, the one step the resume repeats, so both ranks compare it.
    Before the example's barrier at the kill, torchrun ended rank 0 first and it had nothing to compare (seen once
    under load, without the injected delay)."""
    lagging = {"FORESIGHT_TEST_LAGGING_RANK": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "lagging_rank"), ENV["PYTHONPATH"]])}
    killed = torchrun("llm_megatron_torchrun.py", "--smoke", "--out", str(tmp_path), "--kill-at-step", "9",
                      check=False, env=lagging)
    assert killed.returncode != 0
    assert os.path.exists(tmp_path / "ckpt" / "step-000008" / ".metadata")  # the resume repeats step 8 alone
    resumed = torchrun("llm_megatron_torchrun.py", "--smoke", "--out", str(tmp_path))
    assert "resumed from step-000008 at step 8" in resumed.stdout
    for rank in (0, 1):
        assert f"rank {rank}: compared the 1 steps repeated after the resume with the killed run's batches and " \
               "losses: equal" in resumed.stdout


def test_dataloader_dropin_resumes_exactly(tmp_path):
    proc = example("dataloader_dropin.py", "--smoke", "--out", str(tmp_path))
    assert "compared the 4 batches after the resume point (and the 4 before) with the uninterrupted run's: " \
           "equal: True" in proc.stdout


@launches(2)
def test_dataloader_dropin_with_a_plan_too_short_to_compare_anything_fails(tmp_path):
    from foresight import build_plan, open_dataset
    from foresight.format import pack_jsonl

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"tokens": list(range(i, i + 40))}) + "\n"
                                              for i in range(50)))
    data = open_dataset(pack_jsonl(str(tmp_path / "c.jsonl"), str(tmp_path / "data"), column="tokens",
                                   progress=False))
    build_plan([(data, 1.0)], seed=1, global_batch_size=8, seq_len=32, num_steps=4).save(str(tmp_path / "plan"))
    proc = example("dataloader_dropin.py", "--smoke", "--out", str(tmp_path), "--plan", str(tmp_path / "plan"),
                   check=False)  # --smoke trains 8 steps, resuming after 4: a 4-step plan leaves none to compare
    assert proc.returncode == 2 and "leaves no step to compare" in proc.stderr, proc.stderr
    proc = example("dataloader_dropin.py", "--steps", "4", "--out", str(tmp_path), "--plan", str(tmp_path / "plan"),
                   "--workers", "0")
    assert "compared the 2 batches after the resume point" in proc.stdout and "equal: True" in proc.stdout


def test_media_node_pushdown_and_raw_fallback_match_host_decode(tmp_path):
    proc = example("media_node_pushdown.py", "--smoke", "--out", str(tmp_path))
    assert "the guard's raw fallback give the same tensors and losses: True" in proc.stdout
    assert "'samples_remote': 12, 'samples_raw': 0" in proc.stdout  # pushdown: every sample decoded on the node
    assert "'samples_remote': 0, 'samples_raw': 12" in proc.stdout  # guard engaged: raw bytes, decoded here


def test_replicate_and_merge_at_the_evaluation_site(tmp_path):
    require("etcd")
    proc = example("replicate_and_merge.py", "--smoke", "--out", str(tmp_path))
    assert "ready at eval-b" in proc.stdout
    assert f"from eval-b:{tmp_path}/eval-site/vlm/step-00000004" in proc.stdout  # the local replica was merged
    assert "the merged safetensors equal the full state dict: True" in proc.stdout


def test_restart_with_hints_spreads_reads_and_restores(tmp_path):
    require("etcd")
    proc = example("restart_with_hints.py", "--smoke", "--out", str(tmp_path))
    assert "hint .metadata: 64 readers -> 4 copies" in proc.stdout  # ceil(64 / 16 safe readers), on 4 nodes
    assert "failed 0" in proc.stdout
    assert "reads spread over 4 nodes (without hints: 2); rank 0 restored the model: True" in proc.stdout


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_says_how_to_run_it(name):
    source = (EXAMPLES / name).read_text()
    assert source.startswith('"""') and "Run it" in source and "--smoke" in source, name
    assert name in (EXAMPLES / "README.md").read_text(), f"examples/README.md does not list {name}"
