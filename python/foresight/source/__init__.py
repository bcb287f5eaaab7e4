"""foresight.source: the read path. A step's part (plan pieces: dataset, sample, offset, length) into bytes and
tensors, one implementation for the loader, the storage node's job and the node client's local fallback, so "the
same tensors on host and node" holds by construction.

Layer: above ``io``, ``media``, ``format``, ``bucket`` and ``plan``; below ``loader`` and ``node``. Each step once:

* ``extents``: plan pieces -> file extents (:func:`step_extents`, :class:`FileTable`); whole samples of
  ``(dataset, sample)`` pairs (:func:`lookup_samples`, :func:`sample_extents`);
* ``modality``: each sample's modality code and epoch key (:func:`modality_codes`, :func:`spec_codes`,
  :func:`sample_epochs`);
* ``reads``: extents -> coalesced transfers -> a region -> one engine batch (:func:`coalesce_extents`,
  :class:`Reads`, :func:`read_extents`, :data:`ALIGN`, the one alignment of every read);
* ``reader``: where bytes come from (:class:`PartReader`; :class:`LocalPartReader`, this host's shard files);
* ``decode`` / ``media_stage``: bytes -> tensors (:class:`MediaDecodeStage`, :func:`decode_part`,
  :func:`stack_samples`); ``meta``: per-sample meta JSON, batched (:func:`sample_metas`).

A new source of bytes is one class implementing :class:`PartReader` (``read_samples(dataset, samples) ->
PartBytes``, ``close()``); everything after the read (checksums, decode, stacking) is shared. The object-store tier
(:mod:`foresight.bucket`) already reads through :class:`LocalPartReader`: a ``BucketDataset``'s ``lookup`` fetches
what its local cache lacks, then the cache files are read like any shard (see :mod:`foresight.source.reader`).

Example::

    from foresight.source import LocalPartReader, MediaDecodeStage, decode_part

    stage = MediaDecodeStage([ds], specs, seed=1)
    reader = LocalPartReader([ds])
    part = reader.read_samples(dataset_ids, sample_ids)
    blocks = decode_part(stage, part, step=0, dataset=dataset_ids, samples=sample_ids,
                         positions=np.arange(len(sample_ids)), first_item=0)
"""
from foresight.source.decode import StepDecoder, decode_part, pin_by_default, stack_samples
from foresight.source.extents import (FileTable, MapsOnly, StepExtents, extents_without_fetching, lookup_samples,
                                      sample_extents, sample_shards, step_extents)
from foresight.source.media_stage import MediaDecodeStage
from foresight.source.meta import meta_fields, sample_metas
from foresight.source.modality import dataset_modality_codes, modality_codes, sample_epochs, spec_codes
from foresight.source.reader import LocalPartReader, PartReader
from foresight.source.reads import (ALIGN, PartBytes, Reads, ReusableRegion, anonymous_region, coalesce_extents,
                                    read_extents, round_up)

__all__ = ["ALIGN", "FileTable", "LocalPartReader", "MapsOnly", "MediaDecodeStage", "PartBytes", "PartReader", "Reads",
           "ReusableRegion", "StepDecoder", "StepExtents", "anonymous_region", "coalesce_extents",
           "dataset_modality_codes", "decode_part", "extents_without_fetching", "lookup_samples", "meta_fields",
           "modality_codes", "pin_by_default", "read_extents", "round_up", "sample_epochs", "sample_extents",
           "sample_metas", "sample_shards", "spec_codes", "stack_samples", "step_extents"]
