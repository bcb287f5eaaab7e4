"""On-disk formats: foresight shards (``.bin`` + Arrow ``.map`` + ``manifest.json``) and Megatron-LM ``.idx/.bin``.

Both kinds sit behind one read contract, :class:`Dataset` (``lookup`` ids -> extents, checksums, meta), so the
plan, I/O and loader layers never care which one they read.

Example::

    from foresight.format import DatasetWriter, open_dataset
    with DatasetWriter("out/", token_dtype="uint16") as w:
        w.add_many(tokens, lengths, modality="tokens")
    ds = open_dataset("out/")
    ext = ds.lookup(np.arange(ds.num_samples))

The packers live in :mod:`foresight.format.packers` (``packers.text``, ``packers.media``, ``packers.megatron``);
their functions are exported here.
"""
from .manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from .megatron import MegatronDataset, write_megatron_dataset
from .packers import pack_jsonl, pack_media, pack_megatron, pack_parquet, pack_records, pack_webdataset
from .reader import ShardedDataset, open_dataset
from .types import TOKEN_DTYPES, Dataset, Extents, Modality
from .writer import DatasetWriter

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TOKEN_DTYPES",
    "Dataset",
    "DatasetWriter",
    "Extents",
    "MegatronDataset",
    "Modality",
    "ShardedDataset",
    "open_dataset",
    "pack_jsonl",
    "pack_media",
    "pack_webdataset",
    "pack_megatron",
    "pack_parquet",
    "pack_records",
    "write_megatron_dataset",
]
