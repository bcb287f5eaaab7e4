"""The object-store tier's basics against a real SeaweedFS on loopback: the server fixture, the client, URLs,
credentials from the standard places, the coalesced ranged fetcher and its one-line errors."""
from __future__ import annotations

import os

import numpy as np
import obstore
import pytest

from foresight import open_dataset
from foresight.bucket import BucketURL, RangedFetcher, RetryPolicy
from foresight.bucket.config import open_store, resolve_options
from foresight.errors import BucketError
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)

PAYLOAD = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()


def test_put_then_ranged_get(s3_env):
    url = BucketURL.parse("s3://smoke/objects")
    store = open_store(url)
    obstore.put(store, url.key("blob.bin"), PAYLOAD)
    got = obstore.get_range(store, url.key("blob.bin"), start=1000, length=5000)
    assert bytes(got) == PAYLOAD[1000:6000]


def test_fetch_coalesces_extents_into_few_gets(s3_env):
    url = BucketURL.parse("s3://smoke/coalesce")
    store = open_store(url)
    obstore.put(store, url.key("blob.bin"), PAYLOAD)
    with RangedFetcher(store, url, max_gap=1 << 20, max_transfer=1 << 20) as fetcher:
        ref = fetcher.head("blob.bin")
        assert ref.size == len(PAYLOAD) and ref.etag
        offsets = np.arange(0, len(PAYLOAD) - 4096, 64 << 10)
        lengths = np.full(len(offsets), 4096)
        before = fetcher.stats.requests
        got = fetcher.fetch([ref], np.zeros(len(offsets), np.int32), offsets, lengths)
        for i, off in enumerate(offsets.tolist()):
            assert got.view(i).tobytes() == PAYLOAD[off:off + 4096]
        # 48 extents 64 KiB apart in 3 MiB: 1 MiB transfers, so 3 GETs instead of 48
        assert fetcher.stats.requests - before == got.transfers.io_count == 3


def test_url_parsing():
    u = BucketURL.parse("s3://data/wiki/v1/")
    assert (u.bucket, u.prefix, u.key("m.json"), str(u.child("x"))) == ("data", "wiki/v1", "wiki/v1/m.json",
                                                                        "s3://data/wiki/v1/x")
    assert BucketURL.parse("s3://data").key("m") == "m"
    for bad in ("/local/path", "s3://Bad_Bucket/x", "s3://b", "s3://key:secret@data/x", "s3://data/a//b",
                "s3://data/tab\tkey", "s3://data/line\nbreak"):
        with pytest.raises(ValueError):
            BucketURL.parse(bad)


def test_profile_from_aws_config_files(tmp_path, monkeypatch, seaweed):
    """~/.aws/config + credentials of AWS_PROFILE reach the client when the environment does not set them."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    env = seaweed.env()
    (tmp_path / "config").write_text(f"[profile lake]\nendpoint_url = {env['AWS_ENDPOINT_URL']}\n"
                                     "region = us-east-1\n")
    (tmp_path / "credentials").write_text(f"[lake]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
                                          f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "lake")
    opts = resolve_options()
    assert opts["endpoint"] == env["AWS_ENDPOINT_URL"] and opts["client_options"]["allow_http"]
    url = BucketURL.parse("s3://smoke/profile")
    store = open_store(url)
    obstore.put(store, url.key("p.bin"), b"profile")
    assert bytes(obstore.get(store, url.key("p.bin")).bytes()) == b"profile"
    # the environment wins over the profile, as with the AWS CLI
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-the-environment")
    assert "secret_access_key" not in resolve_options()


def _one_line_error(excinfo, *secrets):
    text = str(excinfo.value)
    assert "\n" not in text and len(text) < 400
    for secret in secrets:
        assert secret not in text
    return text


def test_missing_object_bucket_and_wrong_keys_fail_in_one_line(s3_env):
    secret = s3_env.secret_key
    url = BucketURL.parse("s3://smoke/errors")
    store = open_store(url)
    obstore.put(store, url.key("here.bin"), b"x" * 10)
    fetcher = RangedFetcher(store, url, retry=RetryPolicy(attempts=2, budget_s=5))
    with pytest.raises(BucketError) as e:
        fetcher.head("absent.bin")
    assert e.value.reason == "not_found"
    assert "object not found" in _one_line_error(e, secret) and "s3://smoke/errors/absent.bin" in str(e.value)
    nobucket = BucketURL.parse("s3://no-such-bucket/x")
    with pytest.raises(BucketError) as e:
        RangedFetcher(open_store(nobucket), nobucket).head("m.json")
    assert "bucket not found" in _one_line_error(e, secret) and "no-such-bucket" in str(e.value)
    wrong = "wrong-secret-value-1234"
    os.environ["AWS_SECRET_ACCESS_KEY"] = wrong  # s3_env's monkeypatch restores it
    with pytest.raises(BucketError) as e:
        RangedFetcher(open_store(url), url).head("here.bin")
    assert e.value.reason == "denied"
    assert "access denied" in _one_line_error(e, secret, wrong)


def test_replaced_object_is_refused_by_name(s3_env):
    url = BucketURL.parse("s3://smoke/replaced")
    store = open_store(url)
    obstore.put(store, url.key("obj.bin"), PAYLOAD[:100000])
    with RangedFetcher(store, url) as fetcher:
        ref = fetcher.head("obj.bin")
        obstore.put(store, url.key("obj.bin"), PAYLOAD[1:100001])  # same size, other bytes
        with pytest.raises(BucketError) as e:
            fetcher.fetch([ref], np.zeros(1, np.int32), np.array([0]), np.array([100]))
    assert e.value.reason == "changed" and "s3://smoke/replaced/obj.bin" in str(e.value)


def test_fetch_keeps_a_steps_gets_in_flight_at_once(s3_env, monkeypatch):
    """A step of 64 one-sample GETs is one wave of requests, not four (latency-bound: each wave is a round trip).
    Every GET waits at a barrier of 64: it opens only when all of them are in flight together (with fewer threads
    it breaks after its timeout and the fetch fails)."""
    import threading

    url = BucketURL.parse("s3://smoke/wave")
    store = open_store(url)
    obstore.put(store, url.key("blob.bin"), PAYLOAD)
    barrier = threading.Barrier(64, timeout=20)
    real_call = RangedFetcher.call

    def call(self, what, fn, *args, **kwargs):
        barrier.wait()
        return real_call(self, what, fn, *args, **kwargs)

    with RangedFetcher(store, url) as fetcher:
        ref = fetcher.head("blob.bin")
        monkeypatch.setattr(RangedFetcher, "call", call)
        offsets = np.arange(64, dtype=np.int64) * (32 << 10)
        got = fetcher.fetch([ref], np.zeros(64, np.int32), offsets, np.full(64, 100), max_gap=0)
    assert got.transfers.io_count == 64
    assert all(got.view(i).tobytes() == PAYLOAD[off:off + 100] for i, off in enumerate(offsets.tolist()))


def test_fetch_sends_gets_by_priority_with_bounded_bytes_in_flight(s3_env, monkeypatch):
    """A prefetcher's fill is one fetch whose GETs must land one after another in the order the plan needs them,
    not share the link and land together at the end: ``priority`` orders the GETs (lowest rank first, a GET
    taking its lowest extent's rank) and ``max_inflight`` bounds the bytes in flight (one GET at least). Before,
    every GET of a fetch went out at once in object/offset order."""
    import threading

    url = BucketURL.parse("s3://smoke/priority")
    store = open_store(url)
    obstore.put(store, url.key("blob.bin"), PAYLOAD)
    lock = threading.Lock()
    state = {"inflight": 0, "most": 0}
    sent: list[int] = []
    real_get = RangedFetcher._get_range

    def get_range(self, ref, start, end):
        with lock:
            sent.append(start)
            state["inflight"] += end - start
            state["most"] = max(state["most"], state["inflight"])
        try:
            return real_get(self, ref, start, end)
        finally:
            with lock:
                state["inflight"] -= end - start

    with RangedFetcher(store, url, max_gap=0) as fetcher:
        ref = fetcher.head("blob.bin")
        monkeypatch.setattr(RangedFetcher, "_get_range", get_range)
        offsets = np.arange(12, dtype=np.int64) * (256 << 10)  # 12 GETs of 100 KiB, 256 KiB apart
        rank = np.array([5, 3, 11, 0, 7, 1, 9, 2, 10, 4, 8, 6])
        seen: list[bytes] = []
        got = fetcher.fetch([ref], np.zeros(12, np.int32), offsets, np.full(12, 100 << 10), priority=rank,
                            max_inflight=250 << 10, on_transfer=lambda tr, data, k: seen.append(data.tobytes()))
    assert got.transfers.io_count == 12 and len(seen) == 12
    assert sent == offsets[np.argsort(rank)].tolist()  # lowest rank first
    assert state["most"] <= 200 << 10  # two 100 KiB GETs fit in 250 KiB, a third does not
    assert sorted(seen) == sorted(PAYLOAD[o:o + (100 << 10)] for o in offsets.tolist())


def test_a_windowed_fetch_sends_the_next_get_while_the_last_ones_bytes_are_written(s3_env, monkeypatch):
    """The window counts bytes on the link: a GET leaves it once its bytes have arrived, before ``on_transfer``
    checks and writes them, so the link never waits on the disk. One GET's worth of window here: the first GET's
    ``on_transfer`` waits (bounded) until the second GET has gone out; before, that second GET went out only after
    it returned, so the wait timed out."""
    import threading

    url = BucketURL.parse("s3://smoke/window")
    store = open_store(url)
    obstore.put(store, url.key("blob.bin"), PAYLOAD)
    sent: list[int] = []
    second_sent = threading.Event()
    real_get = RangedFetcher._get_range

    def get_range(self, ref, start, end):
        sent.append(start)
        if len(sent) == 2:
            second_sent.set()
        return real_get(self, ref, start, end)

    overlapped: list[bool] = []

    def on_transfer(tr, data, k):
        if not overlapped:
            overlapped.append(second_sent.wait(20))

    with RangedFetcher(store, url, max_gap=0) as fetcher:
        ref = fetcher.head("blob.bin")
        monkeypatch.setattr(RangedFetcher, "_get_range", get_range)
        offsets = np.arange(3, dtype=np.int64) * (256 << 10)
        fetcher.fetch([ref], np.zeros(3, np.int32), offsets, np.full(3, 100 << 10), priority=np.arange(3),
                      max_inflight=100 << 10, on_transfer=on_transfer)
    assert overlapped == [True] and len(sent) == 3


def _no_aws_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)


def test_service_specific_endpoints_and_an_unknown_profile(tmp_path, monkeypatch, seaweed):
    """The SDKs' S3-specific endpoint wins over the generic one: ``AWS_ENDPOINT_URL_S3`` over ``AWS_ENDPOINT_URL``
    (and ``allow_http`` follows the one used), ``s3 = endpoint_url`` nested in the profile or in its ``services``
    section over the profile's ``endpoint_url``; an ``AWS_PROFILE`` no file holds is an error naming it."""
    _no_aws_env(monkeypatch)
    env = seaweed.env()
    url = BucketURL.parse("s3://smoke/service-endpoints")
    creds = tmp_path / "credentials"
    creds.write_text(f"[lake]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
                     f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "lake")
    wrong = "https://unused.invalid:1"
    configs = {
        "nested": f"[profile lake]\nendpoint_url = {wrong}\ns3 =\n    addressing_style = path\n"
                  f"    endpoint_url = {env['AWS_ENDPOINT_URL']}\n",
        "services": f"[profile lake]\nendpoint_url = {wrong}\nservices = local\n\n[services local]\ns3 =\n"
                    f"  endpoint_url = {env['AWS_ENDPOINT_URL']}\n",
        "env-s3": f"[profile lake]\nregion = us-east-1\ns3 =\n    addressing_style = path\n",
    }
    for kind, text in configs.items():
        (tmp_path / "config").write_text(text)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
        if kind == "env-s3":
            monkeypatch.setenv("AWS_ENDPOINT_URL", wrong)
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", env["AWS_ENDPOINT_URL"])
        assert resolve_options()["endpoint"] == env["AWS_ENDPOINT_URL"], kind
        assert resolve_options()["client_options"]["allow_http"], kind
        store = open_store(url)
        obstore.put(store, url.key(f"{kind}.bin"), kind.encode())
        with RangedFetcher(store, url, retry=RetryPolicy(attempts=1)) as fetcher:
            assert fetcher.get_object(f"{kind}.bin")[1] == kind.encode()
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(ValueError, match="AWS profile 'no-such-profile'.*not found") as e:
        open_store(url)
    assert env["AWS_SECRET_ACCESS_KEY"] not in str(e.value)


def test_a_refused_endpoint_never_quotes_the_credentials_or_query_it_carries(monkeypatch):
    """An endpoint the client cannot take is named in the error, but keys written into it (``https://KEY:SECRET@
    host``: how some tools take them) or a presigned-style query (``?X-Amz-Security-Token=...``) are not quoted,
    wherever the endpoint came from (options, the environment); the host is, so the error still says which."""
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    for name in [n for n in os.environ if n.startswith("AWS_ENDPOINT")]:
        monkeypatch.delenv(name)
    bad = ["https://AKIAEXAMPLEKEY:wJalrXUtnFEMIsecretKEY@s3.example.com",
           "s3.example.com/bucket?X-Amz-Security-Token=FQoGZXIvYXdzEXAMPLETOKEN&x=1",
           "https://s3.example.com/?X-Amz-Credential=AKIAEXAMPLEKEY#frag-secret",
           "ftp://user:pa55word-secret@s3.example.com:21/"]
    for endpoint in bad:
        for how in ("options", "env"):
            if how == "env":
                monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
            with pytest.raises(ValueError) as e:
                resolve_options({"endpoint": endpoint} if how == "options" else None)
            text = str(e.value)
            for secret in ("wJalrXUtnFEMIsecretKEY", "AKIAEXAMPLEKEY", "EXAMPLETOKEN", "frag-secret", "pa55word"):
                assert secret not in text, (how, text)
            assert "s3.example.com" in text and "\n" not in text, text


def test_an_endpoint_with_a_bad_port_or_host_is_refused_naming_it(monkeypatch, tmp_path):
    """An endpoint whose port is not a number, past 65535, or whose IPv6 host is not closed: opening a dataset
    through it raised urllib's bare "Port could not be cast to integer value as 'abc'" (the cache place is keyed by
    the endpoint's port), naming neither the endpoint nor where it came from; now the same one-line refusal as any
    endpoint the client cannot take."""
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    for name in [n for n in os.environ if n.startswith("AWS_ENDPOINT")]:
        monkeypatch.delenv(name)
    keys = {"access_key_id": "a", "secret_access_key": "b"}
    for endpoint in ("http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://[::1", "http://:8333"):
        with pytest.raises(ValueError) as e:
            open_dataset("s3://bkt/x", cache_dir=tmp_path / "cache", options={"endpoint": endpoint, **keys})
        text = str(e.value)
        assert text.startswith("S3 endpoint ") and "options['endpoint']" in text and "\n" not in text, text
        assert not os.path.exists(tmp_path / "cache"), endpoint


def test_endpoint_as_users_write_it(s3_env, monkeypatch):
    """A trailing slash, a double one or spaces around the endpoint still reach the server; one without a scheme
    (``127.0.0.1:8333``, a common slip) is a one-line error naming where it came from, not the client's panic."""
    url = BucketURL.parse("s3://smoke/endpoint-forms")
    endpoint = s3_env.endpoint
    obstore.put(open_store(url), url.key("e.bin"), b"endpoint")
    for form in (endpoint + "/", endpoint + "//", f"  {endpoint} "):
        monkeypatch.setenv("AWS_ENDPOINT_URL", form)
        with RangedFetcher(open_store(url), url, retry=RetryPolicy(attempts=1)) as fetcher:
            assert fetcher.get_object("e.bin")[1] == b"endpoint", form
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.setenv(var, endpoint[len("http://"):])
        with pytest.raises(ValueError, match=f"not an http:// or https:// URL.*|.*{var}") as e:
            open_store(url)
        assert var in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="options"):
        open_store(url, {"endpoint": "localhost:9000"})
