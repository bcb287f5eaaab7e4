"""On-disk formats: foresight shards (``.bin`` + Arrow ``.map`` + ``manifest.json``) and Megatron-LM ``.idx/.bin``.

Both kinds sit behind one read contract, :class:`Dataset` (``lookup`` ids -> extents, checksums, meta), so the
plan, I/O and loader layers never care which one they read.

Example::

    from foresight.format import DatasetWriter, open_dataset
    with DatasetWriter("out/", token_dtype="uint16") as w:
        w.add_many(tokens, lengths, modality="tokens")
    ds = open_dataset("out/")
    ext = ds.lookup(np.arange(ds.num_samples))
"""
from .manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from .megatron import MegatronDataset, write_megatron_dataset
from .pack_media import pack_media
from .pack_megatron import pack_megatron
from .pack_text import pack_jsonl, pack_parquet
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
    "pack_megatron",
    "pack_parquet",
    "write_megatron_dataset",
]
