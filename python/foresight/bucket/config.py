"""Where a bucket's endpoint and credentials come from, and the client built from them (obstore's S3Store).

The standard places, most specific first: keyword ``options`` (obstore's S3 config keys), the ``AWS_*``
environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ...:
read by obstore itself), then the profile ``AWS_PROFILE`` (or ``default``) of ``~/.aws/config`` and
``~/.aws/credentials`` (``AWS_CONFIG_FILE`` / ``AWS_SHARED_CREDENTIALS_FILE`` move them). obstore reads no profile
files, so the profile's keys (``endpoint_url``, ``region``, ``aws_access_key_id``, ``aws_secret_access_key``,
``aws_session_token``) are passed to it here; the environment still wins over them, as with the AWS CLI.

Example::

    store = open_store(BucketURL.parse("s3://data/wiki"))      # AWS_ENDPOINT_URL=http://127.0.0.1:8333 ...
    obstore.get_range(store, "wiki/manifest.json", start=0, length=100)

:func:`redact` removes every credential value known here from a text (error messages of the client may quote
request details); foresight's own messages never include them in the first place, and quote an endpoint only
through :func:`shown_url` (no user info, query or fragment: where keys written into a URL would be).
"""
from __future__ import annotations

import configparser
import datetime
import hashlib
import os
import re
import urllib.parse
from typing import Any

from .url import BucketURL

__all__ = ["open_store", "resolve_options", "redact", "shown_url", "endpoint_place", "ENDPOINT_PLACE_PREFIX"]

# A profile's key -> obstore's S3 config key.
_PROFILE_KEYS = {
    "endpoint_url": "endpoint",
    "region": "region",
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "aws_session_token": "session_token",
}
# The environment variable that overrides each of them (obstore reads these itself).
_ENV_OF = {
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),  # the service's own first, as the SDKs
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN", "AWS_TOKEN"),
}
_SECRET_KEYS = ("secret_access_key", "session_token")
_ENDPOINT = re.compile(r"^https?://[^\s/?#@]+(/[^\s?#]*)?$", re.IGNORECASE)  # scheme://host[:port][/path]


def _nested(value: str) -> dict[str, str]:
    """The sub-keys of a nested setting (``s3 =`` followed by indented ``key = value`` lines)."""
    out = {}
    for line in value.splitlines():
        key, sep, val = line.partition("=")
        if sep and key.strip():
            out[key.strip().lower()] = val.strip()
    return out


def _profile_options() -> dict[str, str]:
    """The profile's keys from ``~/.aws/config`` (``[profile NAME]`` or ``[default]``) and ``~/.aws/credentials``.

    An S3-specific ``endpoint_url`` wins over the profile's: one nested under ``s3 =`` in the profile, or in the
    ``[services NAME]`` section its ``services = NAME`` names (the SDKs' service-specific endpoints). A profile
    named by ``AWS_PROFILE`` that neither file holds is a :class:`ValueError` naming it (as the AWS CLI's "profile
    not found"): never requests signed with no keys, or sent to AWS instead of the profile's endpoint."""
    chosen = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")
    name = chosen or "default"
    home = os.path.expanduser("~")
    files = (
        (os.environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
         ("default", "profile default") if name == "default" else (f"profile {name}",)),
        (os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"), (name,)),
    )
    out: dict[str, str] = {}
    found = False
    service_endpoint = None
    for path, sections in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except configparser.Error as e:  # a malformed file is named, its content is not quoted (it holds keys)
            raise ValueError(f"cannot parse AWS config file {path}: {type(e).__name__}") from None
        for section in sections:
            if not parser.has_section(section):
                continue
            found = True
            for key, value in parser.items(section):
                if key in _PROFILE_KEYS and value.strip():
                    out[_PROFILE_KEYS[key]] = value.strip()
            nested = _nested(parser.get(section, "s3", fallback=""))
            services = parser.get(section, "services", fallback="").strip()
            if services and parser.has_section(f"services {services}"):
                nested = _nested(parser.get(f"services {services}", "s3", fallback="")) or nested
            service_endpoint = nested.get("endpoint_url") or service_endpoint
    if chosen and not found:
        raise ValueError(f"AWS profile {chosen!r} (AWS_PROFILE) not found in {files[0][0]} or {files[1][0]}")
    if service_endpoint:
        out["endpoint"] = service_endpoint
    return out


def resolve_options(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The S3 config passed to obstore: ``options``, then the profile's keys the environment does not set.

    The environment's keys are left to obstore (it reads ``AWS_*`` on its own); the endpoint is passed explicitly
    (the SDKs' order: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, then the profile's), checked to be an
    ``http(s)://`` URL (obstore panics on one without a scheme), and ``allow_http`` derived for an ``http://`` one
    (loopback test servers, on-premises gateways).
    """
    merged: dict[str, Any] = {}
    source = "the AWS profile"
    for key, value in _profile_options().items():
        if not any(os.environ.get(var) for var in _ENV_OF[key]):
            merged[key] = value
    if options and options.get("endpoint"):
        source = "options['endpoint']"
    merged.update(options or {})
    if "endpoint" not in merged:  # the environment's, in the SDKs' order (S3's own variable first), passed on
        source = next((v for v in _ENV_OF["endpoint"] if os.environ.get(v)), "")
        if source:  # explicitly: allow_http below must follow the endpoint the requests go to
            merged["endpoint"] = os.environ[source]
    endpoint = str(merged.get("endpoint") or "").strip()
    if endpoint:
        if not _ENDPOINT.match(endpoint):
            raise ValueError(f"S3 endpoint {shown_url(endpoint)!r} (from {source}) is not an http:// or https:// URL "
                             "(e.g. http://127.0.0.1:8333 or https://s3.example.com)")
        why = _unparsable(endpoint)  # its host and port key the cache place (endpoint_place): checked here, named
        if why:
            raise ValueError(f"S3 endpoint {shown_url(endpoint)!r} (from {source}) is not a usable URL: {why} "
                             "(e.g. http://127.0.0.1:8333 or https://s3.example.com)")
        merged["endpoint"] = endpoint
    if endpoint.lower().startswith("http://"):
        merged.setdefault("client_options", {}).setdefault("allow_http", True)
    merged.setdefault("region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    return merged


def _unparsable(endpoint: str) -> str:
    """Why ``endpoint`` (scheme checked) has no host or port to connect to, or "" when it has both."""
    try:
        parts = urllib.parse.urlsplit(endpoint)
        parts.port  # noqa: B018 - raises for a port that is not a number, or past 65535
    except ValueError as e:
        return str(e)  # urllib's words: the port's text or "Invalid IPv6 URL", never the rest of the URL
    return "" if parts.hostname else "no host"


#: What an endpoint's directory name in a cache starts with: ``_`` is never in an S3 bucket name, so no bucket's
#: place under a cache root can be taken for an endpoint's.
ENDPOINT_PLACE_PREFIX = "_endpoint-"


def endpoint_place(options: dict[str, Any] | None = None) -> str | None:
    """The directory a cache keeps the objects of the endpoint ``options`` resolve to (:func:`resolve_options`) in,
    or None for the provider's default (AWS: a bucket's name is unique there). Two endpoints may hold different
    objects under one bucket and key, so their caches must not share a place; the name is a function of the
    endpoint alone (host, port, path; case and a trailing slash ignored), so it is the same after a restart."""
    endpoint = str(resolve_options(options).get("endpoint") or "")
    if not endpoint:
        return None
    parts = urllib.parse.urlsplit(endpoint)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    canonical = f"{host}:{port}{parts.path.rstrip('/')}"
    readable = re.sub(r"[^a-z0-9.-]+", "-", f"{host}-{port}")[:64]
    return f"{ENDPOINT_PLACE_PREFIX}{readable}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"


def open_store(url: BucketURL, options: dict[str, Any] | None = None, *, timeout_s: float = 30.0,
               connect_timeout_s: float = 5.0):
    """An obstore ``S3Store`` for ``url.bucket`` (path-style requests; ``timeout_s`` per request; the client's own
    retries off: the fetcher retries with its own budget, :class:`~foresight.bucket.fetch.RetryPolicy`, so that one
    layer counts attempts and names the object when it gives up)."""
    from obstore.store import S3Store

    opts = resolve_options(options)
    client_options = dict(opts.pop("client_options", {}))
    client_options.setdefault("timeout", f"{round(timeout_s * 1000)}ms")
    client_options.setdefault("connect_timeout", f"{round(connect_timeout_s * 1000)}ms")
    opts.setdefault("virtual_hosted_style_request", False)
    return S3Store(url.bucket, config=opts, client_options=client_options,
                   retry_config={"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=1)})


_USERINFO = re.compile(r"^([a-z][a-z0-9+.\-]*://)?[^/?#@\s]*@", re.IGNORECASE)


def shown_url(url: str) -> str:
    """``url`` fit for a message: keys written into it (``https://KEY:SECRET@host``) and its query and fragment
    (``?X-Amz-Security-Token=...``: presigned-style credentials) replaced by ``***``; the scheme, host and path
    kept, so the message still says which endpoint."""
    text = _USERINFO.sub(lambda m: f"{m.group(1) or ''}***@", url.strip(), count=1)
    cut = min((i for i in (text.find("?"), text.find("#")) if i >= 0), default=-1)
    return redact(text if cut < 0 else text[:cut] + text[cut] + "***")


def redact(text: str, options: dict[str, Any] | None = None) -> str:
    """``text`` with every secret value from ``options``, the environment and the profile replaced by ``***``."""
    secrets = []
    for key in _SECRET_KEYS:
        secrets += [os.environ.get(v, "") for v in _ENV_OF[key]]
    try:
        profile = _profile_options()
    except ValueError:
        profile = {}
    secrets += [profile.get(k, "") for k in _SECRET_KEYS] + [str((options or {}).get(k, "")) for k in _SECRET_KEYS]
    for value in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        text = text.replace(value, "***")
    return text
