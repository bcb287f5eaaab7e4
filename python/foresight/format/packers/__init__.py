"""Packers: turn the data users have into foresight shards. One module per input kind, named for the input (so no
module shares a name with a function exported from :mod:`foresight.format`):

* :mod:`.text`: JSONL / ``.jsonl.gz`` / Parquet files, globs and folders (a Hugging Face dataset), text or token ids,
  optional tokenizer (:mod:`.tokenizer`); :mod:`.inputs` expands and orders the inputs;
* :mod:`.media`: a folder of images, audio and video, one file per sample, with captions;
* :mod:`.webdataset`: WebDataset tar shards (a media member and its json/txt/cls per key), streamed, through the
  media packer's probe;
* :mod:`.megatron`: a Megatron-LM ``.idx``/``.bin`` pair;
* :mod:`.progress`: the one progress bar each of them shows.

Example::

    from foresight.format import pack_media, pack_records
    pack_records(["hf_dataset/"], "tokens/", split="train", tokenizer="tokenizer.json")
    pack_media("photos/", "media/", captions="captions.jsonl")
"""
from .media import pack_media
from .megatron import pack_megatron
from .text import pack_jsonl, pack_parquet, pack_records
from .webdataset import pack_webdataset

__all__ = ["pack_jsonl", "pack_media", "pack_megatron", "pack_parquet", "pack_records", "pack_webdataset"]
