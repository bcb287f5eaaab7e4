"""The loader's decode stage for media datasets: one step's raw samples -> the tensors a training step takes.

The loader thread calls the stage right after a step's reads complete, while the next steps' reads are still in
the ring; the stage fans the samples out over a :class:`foresight.media.DecodePool` (PyAV and Pillow release the
GIL), most expensive first, and stacks each modality's outputs into one (pinned, when CUDA is present) tensor.
Every random choice is keyed by ``(seed, epoch, sample id)``, where ``epoch`` counts how many times the plan has
cycled through that sample's dataset, so the storage node and the host produce the same tensors.
A stage may be used in the parent and then handed to forked ``DataLoader`` workers: each process decodes on
threads of its own (see :class:`foresight.media.DecodePool`), and a decode that gives no result within
``timeout_s`` raises :class:`~foresight.errors.DecodeTimeoutError` instead of stalling the step forever.

Example::

    stage = MediaDecodeStage([ds], {"video": TransformSpec(modality="video", size=(224, 224)),
                                    "image": TransformSpec(modality="image", size=(224, 224), crop="random_resized")},
                             seed=1)
    with Loader(plan, datasets=ds, decode=stage) as loader:
        for batch in loader:
            batch["video"], batch["video_index"]     # (n, T, 3, 224, 224) uint8, positions in the step
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from foresight.format import Modality
from foresight.source.decode import pin_by_default, stack_samples
from foresight.source.meta import sample_metas
from foresight.source.modality import modality_codes, sample_epochs, spec_codes


class MediaDecodeStage:
    """Decodes the samples of each step whose modality has a spec; other samples pass through as bytes.

    ``threads``/``codec_threads``/``timeout_s`` configure its :class:`foresight.media.DecodePool`.
    """

    def __init__(self, datasets: Any, specs: Mapping[str, Any], *, seed: int, threads: int | None = None,
                 codec_threads: int = 1, timeout_s: float | None = 300.0) -> None:
        from foresight.media import DecodePool  # lazy: the media extra (PyAV, Pillow) is optional for the loader

        self.datasets: Sequence = list(datasets) if isinstance(datasets, (list, tuple)) else [datasets]
        allowed = {m.label for m in Modality}
        for name in specs:
            if name not in allowed:
                raise ValueError(f"spec for unknown modality {name!r}; allowed: {sorted(allowed)}")
        self.specs = dict(specs)
        self.seed = int(seed)
        self._codes = spec_codes(self.specs)
        self._pool = DecodePool(threads, codec_threads=codec_threads, timeout_s=timeout_s)

    def __call__(self, fields: dict, *, stats=None, first_item: int = 0) -> dict:
        data: np.ndarray = fields["data"]
        offsets, lengths = np.asarray(fields["offsets"]), np.asarray(fields["lengths"])
        dataset, samples = np.asarray(fields["dataset"]), np.asarray(fields["sample_ids"])
        # A storage node or a fallback decodes a subset of a step: ``fields["items"]`` then gives each sample's
        # plan item (its epoch key); a whole step's items are ``first_item + position``.
        items = (np.asarray(fields["items"], dtype=np.int64) if "items" in fields
                 else first_item + np.arange(len(samples), dtype=np.int64))
        codes = modality_codes(self.datasets, dataset, samples)
        epochs = sample_epochs(self.datasets, dataset, items)
        # Every decoded sample's meta (video keyframes, probe results) in one batch per shard, not one per sample.
        decoded = np.flatnonzero(np.isin(codes, list(self._codes.values())))
        metas = np.empty(len(samples), dtype=object)
        metas[decoded] = sample_metas(self.datasets, dataset[decoded], samples[decoded])
        handles = []
        for name, spec in self.specs.items():
            of_modality = np.flatnonzero(codes == self._codes[name])
            # The pool takes one epoch per call: split the (rare) step that straddles an epoch boundary.
            for epoch in np.unique(epochs[of_modality]):
                idx = of_modality[epochs[of_modality] == epoch]
                views = [data[offsets[i] : offsets[i] + lengths[i]] for i in idx]
                handle = self._pool.submit(spec, views, metas[idx].tolist(), samples[idx].tolist(), seed=self.seed,
                                           epoch=int(epoch))
                handles.append((name, idx, handle))
        out = dict(fields)
        results: dict[str, list] = {}
        for name, idx, handle in handles:
            t0 = time.perf_counter()
            tensors = handle.result()
            if stats is not None:
                stats.add_decode(name, time.perf_counter() - t0)
            results.setdefault(name, []).extend(zip(idx.tolist(), tensors))
        pin = pin_by_default() if results else False
        for name, pairs in results.items():
            pairs.sort(key=lambda p: p[0])
            out[name] = stack_samples([t for _, t in pairs], pin=pin)
            out[f"{name}_index"] = np.array([i for i, _ in pairs], dtype=np.int64)
        return out

    def close(self) -> None:
        self._pool.close()


__all__ = ["MediaDecodeStage"]
