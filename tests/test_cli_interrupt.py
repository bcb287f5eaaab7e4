"""``foresight pack`` stopped by Ctrl-C, and its progress bar over the whole work (tokenizing included).

A real ``python -m foresight pack`` subprocess with a ``module:function`` tokenizer written here: the tokenizer marks
where the pack is (a file, a line on stderr), so the test waits on events, never on time.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from cli_helpers import cli_env

TOKENIZER = '''
import os, sys, time
calls = 0
def encode(texts):
    global calls
    calls += 1
    print(f"\\nTOKENIZE {calls}", file=sys.stderr, flush=True)  # own line: the bar ends none
    if calls == 2 and os.environ.get("TOK_BLOCK_FILE"):  # the first block is written: park here until killed
        open(os.environ["TOK_BLOCK_FILE"], "w").close()
        time.sleep(600)
    return [[len(t) % 1000, 1, 2] for t in texts]
'''


def write_corpus(path, blocks: float) -> None:
    """JSONL of about ``blocks`` x 8 MiB (the packer's JSON block), so the tokenizer is called once per block."""
    line = json.dumps({"text": "lorem ipsum dolor sit amet " * 40}) + "\n"
    with open(path, "w") as f:
        f.write(line * (int(blocks * (8 << 20)) // len(line) + 1))


def start_pack(tmp_path, *extra: str, **env: str) -> subprocess.Popen:
    (tmp_path / "slow_tok.py").write_text(TOKENIZER)
    return subprocess.Popen([sys.executable, "-m", "foresight", "pack", "corpus.jsonl", "out",
                             "--tokenizer", "slow_tok:encode", *extra], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(**env))


def test_ctrl_c_during_pack_is_one_line_exit_130_and_leaves_nothing(tmp_path):
    write_corpus(tmp_path / "corpus.jsonl", blocks=2)
    marker = tmp_path / "second-block"
    proc = start_pack(tmp_path, "--no-progress", TOK_BLOCK_FILE=str(marker))
    try:
        for _ in range(1200):  # bounded wait for the event: the pack is mid-way, one block written
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), proc.communicate()[1]
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")], "nothing written yet"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.splitlines() if line and not line.startswith("TOKENIZE")]
    assert proc.returncode == 130, err
    assert lines == ["foresight pack: interrupted"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "second-block", "slow_tok.py"]


def test_pack_bar_counts_tokenizing_so_it_finishes_with_the_work(tmp_path):
    write_corpus(tmp_path / "corpus.jsonl", blocks=2.5)  # the last block half full: 80% before it
    proc = start_pack(tmp_path, TQDM_MININTERVAL="0")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    events = [s.strip() for s in err.replace("\r", "\n").split("\n") if s.strip()]
    calls = [i for i, e in enumerate(events) if e.startswith("TOKENIZE")]
    bars = [i for i, e in enumerate(events) if e.startswith("pack corpus.jsonl:")]
    assert len(calls) >= 3, events
    # The bar moves between the tokenizer's calls, and reaches 100% only after the last one.
    assert all(any(a < b < c for b in bars) for a, c in zip(calls, calls[1:])), events
    done = [i for i in bars if "100%" in events[i]]
    assert len(done) == 1 and done[0] > calls[-1], events
