"""The README's headline figures are the committed quick run's: the table between the markers is exactly what
bench/report.py computes from bench/reference/quick/*.json, so a figure cannot be edited by hand or outlive its run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from report import HEADLINES_BEGIN, HEADLINES_END, headlines  # noqa: E402


def test_readme_headlines_are_computed_from_the_committed_run():
    ref = ROOT / "bench" / "reference" / "quick"
    index = json.loads((ref / "index.json").read_text())
    results = {name: json.loads((ref / f"{name}.json").read_text()) for name, entry in index["benches"].items()
               if not entry.get("failure") and (ref / f"{name}.json").exists()}
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(HEADLINES_BEGIN), readme.index(HEADLINES_END) + len(HEADLINES_END)
    assert readme[start:end] == headlines(results), "re-render with: python bench/run_all.py --render --preset quick"


def test_benchmarks_md_names_the_committed_run():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert "bench/run_all.py --preset quick" in text and "bench/reference/quick/" in text
    for name in json.loads((ROOT / "bench" / "reference" / "quick" / "index.json").read_text())["benches"]:
        assert (ROOT / "bench" / "reference" / "quick" / f"{name}.json").exists()
