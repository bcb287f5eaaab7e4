"""A slot is sized for the alignment its step really costs: token plans of documents far smaller than the 4 KiB
alignment (each piece its own aligned transfer) read every step into the pinned arena, never a one-off buffer."""
from __future__ import annotations

import json

import numpy as np

from foresight import build_plan, open_dataset
from foresight.format import pack_jsonl
from foresight.loader import Loader


def test_tiny_documents_fit_their_slot(tmp_path):
    rng = np.random.default_rng(0)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for _ in range(400):  # 8-100 tokens: pieces of 16-200 bytes, each a 4 KiB-aligned read
            f.write(json.dumps({"tokens": rng.integers(0, 256, rng.integers(8, 100)).tolist()}) + "\n")
    data = open_dataset(pack_jsonl(str(tmp_path / "docs.jsonl"), str(tmp_path / "data"), column="tokens",
                                   progress=False))
    plan = build_plan([(data, 1.0)], seed=1, global_batch_size=8, seq_len=32, num_steps=12)
    with Loader(data, plan, prefetch=2) as loader:
        steps = sum(1 for _ in loader)
        stats = loader.stats.as_dict()
    assert steps == 12 and stats["slot_overflows"] == 0, stats
