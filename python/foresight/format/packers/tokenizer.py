"""Tokenizers for packing text: a local ``tokenizer.json`` through the ``tokenizers`` library, or ``module:function``.

A tokenizer here is a callable ``list[str] -> list[list[int]]`` (one call per batch of rows); a ``vocab_size``
attribute lets the packer store uint16 ids when every id fits (vocab_size <= 65536), else uint32.

Example::

    tok = load_tokenizer("gpt2/tokenizer.json")     # or a folder holding tokenizer.json
    tok(["hello world", "foo"])                      # -> [[31373, 995], [21943]]
    tok = load_tokenizer("my_project.tok:encode")   # your own function (cwd is importable, as with python -m)
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence

from ...errors import FormatError

__all__ = ["Tokenizer", "HFTokenizer", "load_tokenizer"]

Tokenizer = Callable[[Sequence[str]], Sequence[Sequence[int]]]
_MODULE_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` as a batch callable; special tokens are added as its post-processor says."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise FormatError("--tokenizer with a tokenizer.json needs the tokenizers library: pip install tokenizers",
                              path=path) from None
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise FormatError(f"not a tokenizers tokenizer.json: {str(e)[:300]}", path=path) from None
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        # encode_batch_fast skips the offsets we never use (tokenizers >= 0.20).
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._encode(list(texts))]  # one Rust call for the batch, threads inside

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _import_function(spec: str) -> Tokenizer:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's own module beside the data
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise FormatError(f"cannot load tokenizer {spec!r}: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise FormatError(f"tokenizer {spec!r} is not callable (want a function list[str] -> list[list[int]])")
    return obj


def load_tokenizer(spec: str | os.PathLike | Tokenizer) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json`` path (or a folder holding one), a ``module:function``, or a callable."""
    if callable(spec):
        return spec
    text = os.fspath(spec)
    if os.path.isdir(text):
        text = os.path.join(text, "tokenizer.json")
    if os.path.isfile(text):
        return HFTokenizer(text)
    if _MODULE_FUNCTION.fullmatch(text):
        return _import_function(text)
    raise FormatError("no such tokenizer: give a tokenizer.json file (or a folder holding one) or module:function",
                      path=text)
