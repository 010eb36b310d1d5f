"""What goes wrong with object storage, named for its real cause: one exception type per cause (each a
`RemoteDataError`, and a ``ValueError``, ``FileNotFoundError``, ``PermissionError``, ``ConnectionError``
or ``ImportError`` as fits), and `classify`, which reads the cause from what fsspec and its backends
(s3fs, aiobotocore, botocore, aiohttp) raised: by exception type and the server's error code, never by
the wording of a message. Every message is one line: the URL, what is wrong, what to do.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from urllib.parse import urlsplit

# What each message says after ``URL: ``; docs/troubleshooting.md lists them (a test compares the two).
NO_CREDENTIALS = (
    "no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with a profile in "
    "~/.aws, or run where an instance role applies; a public bucket needs none: pass the storage option anon=true"
)
CREDENTIALS_REJECTED = (
    "the server rejected the credentials ({code}); check the access key and secret (environment, AWS_PROFILE), "
    "and that they belong to this endpoint"
)
ACCESS_DENIED = (
    "access denied ({code}); the credentials in use may not read it: check the bucket's or the user's policy, or "
    "use other credentials"
)
UNREACHABLE = (
    "cannot connect to {host} ({reason}); check the endpoint (the storage option endpoint_url, or "
    "AWS_ENDPOINT_URL) and that the server runs"
)
UNRESOLVABLE = (
    "cannot resolve the host name {host}; check the endpoint's name (the storage option endpoint_url, or "
    "AWS_ENDPOINT_URL) and the network"
)
TLS_FAILED = (
    "TLS with {host} failed ({reason}); if the server's certificate comes from a private authority, point "
    "AWS_CA_BUNDLE (s3://) or SSL_CERT_FILE (https://) at that authority's certificate"
)
NO_BUCKET = "no bucket named {bucket} on the server; check the bucket's name (and the endpoint)"
NO_SHARD = "no such shard on the server; check the URL and pattern"
BAD_OPTIONS = "the storage options ({keys}) do not suit {scheme}:// ({reason}); check their names and values"
FAILED = "the object store failed ({reason}); check the URL and the storage options"
RANGE_IGNORED = (
    "the server sent {got} bytes for a range of {asked}: it does not answer range requests; serve the files "
    "from a server that does (nginx, S3, ...) or download them and open the local copy"
)
GLOB = (
    "a URL takes no wildcards (* ? [ ]); name the shards with a brace pattern such as {example}, or give "
    "their folder, {folder}"
)


class RemoteDataError(Exception):
    """Data at a URL that cannot be had, for a reason named in one line; ``dali-fast`` exits with 2.

    Each subclass (in ``dali_fast.data.remote.errors``) is one reason, and also the built-in error that
    fits: ``MissingCredentialsError``, ``CredentialsRejectedError`` and ``AccessDeniedError`` are
    ``PermissionError``; ``EndpointUnreachableError`` (refused, or a host name that does not resolve) and
    ``TLSError`` are ``ConnectionError``; ``NoSuchBucketError`` and ``NoSuchShardError`` are
    ``FileNotFoundError``; ``URLPatternError`` (a wildcard in a URL) and ``StorageOptionsError`` are
    ``ValueError``; ``MissingExtraError`` is ``ImportError``. ``RangeIgnoredError`` (a server that
    answers a range request with the whole file), ``StoreFailedError`` (any other failure of the store
    at open, with the backend's own words) and ``CacheDiskFullError`` (the shard cache's disk filled
    up) are none of them: the latter stops a run instead of making every later sample a bad record.

    A DataLoader worker re-raises it with the worker's traceback as its message; its one line is then the
    last line of that traceback (`str` gives it)."""

    def __str__(self) -> str:
        text = super().__str__()
        if "\nOriginal Traceback" in text:  # torch's ExceptionWrapper: "Caught X in DataLoader worker ..."
            last = text.rstrip().splitlines()[-1]
            return last.split(": ", 1)[1] if ": " in last else last
        return text


class URLPatternError(RemoteDataError, ValueError):
    """A URL with a wildcard (``train-*.tar``): URLs take brace patterns or a folder."""


class MissingCredentialsError(RemoteDataError, PermissionError):
    """No credentials were found for the object store."""


class CredentialsRejectedError(RemoteDataError, PermissionError):
    """The server does not accept the credentials (unknown key, wrong secret, expired token)."""


class AccessDeniedError(RemoteDataError, PermissionError):
    """The server refuses access (403): the credentials may not read the bucket or object."""


class EndpointUnreachableError(RemoteDataError, ConnectionError):
    """The endpoint refuses connections, or its host name does not resolve."""


class TLSError(RemoteDataError, ConnectionError):
    """The TLS handshake with the endpoint failed (an unknown certificate authority, a wrong host name)."""


class NoSuchBucketError(RemoteDataError, FileNotFoundError):
    """The bucket the URL names does not exist on the server."""


class NoSuchShardError(RemoteDataError, FileNotFoundError):
    """A shard the URL names does not exist on the server."""


class StorageOptionsError(RemoteDataError, ValueError):
    """Storage options the backend does not take (a misspelt name, a value of the wrong type)."""


class RangeIgnoredError(RemoteDataError):
    """The server ignores ``Range`` (it sends the whole file with 200, as ``python -m http.server`` does):
    Parquet, and shards of more than one download chunk, cannot be read from it. No retry mends it."""


class StoreFailedError(RemoteDataError):
    """Any other failure of the object store while a URL is opened: said in one line, with the backend's
    own error."""


class MissingExtraError(RemoteDataError, ImportError):
    """fsspec or the backend a URL needs is not installed."""


class CacheDiskFullError(RemoteDataError):
    """The disk of the shard cache filled up while a shard was written (not an ``OSError``: it stops the
    run instead of making every later sample a bad record)."""


_REJECTED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
_DENIED = {"AccessDenied", "403", "AllAccessDisabled", "AccountProblem"}


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and its causes (``raise ... from``, then the exception being handled), each once."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _code(e: BaseException) -> str | None:
    """The server's error code of a botocore ``ClientError`` (``NoSuchBucket``, ``AccessDenied``, ``403``)."""
    response = getattr(e, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
        code = response["Error"].get("Code")
        return str(code) if code is not None else None
    return None


def _status(e: BaseException) -> int | None:
    """The HTTP status of an aiohttp ``ClientResponseError`` (fsspec's HTTP filesystem)."""
    try:
        from aiohttp import ClientResponseError
    except ImportError:
        return None
    return e.status if isinstance(e, ClientResponseError) else None


def _types(module: str, *names: str) -> tuple[type, ...]:
    """The exception classes ``names`` of ``module``, where it is installed (none otherwise)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return ()
    return tuple(t for t in (getattr(mod, n, None) for n in names) if isinstance(t, type))


def _host(chain: list[BaseException], url: str, storage_options: dict | None) -> str:
    """host:port the client tried to reach: from the connection error, else the endpoint, else the URL."""
    for e in chain:
        host, port = getattr(e, "host", None), getattr(e, "port", None)
        if isinstance(host, str) and host:
            return f"{host}:{port}" if port else host
        endpoint = (getattr(e, "kwargs", None) or {}).get("endpoint_url")  # botocore's EndpointConnectionError
        if isinstance(endpoint, str):
            return urlsplit(endpoint).netloc or endpoint
    endpoint = (storage_options or {}).get("endpoint_url")
    return urlsplit(endpoint if isinstance(endpoint, str) else url).netloc or url


def classify(error: BaseException, url: str, storage_options: dict | None = None) -> RemoteDataError | None:
    """The cause of ``error`` (raised while reaching ``url``) as a `RemoteDataError`, or None when it is none
    of the causes named here (an object that is simply not there is None: the caller words that)."""
    if isinstance(error, RemoteDataError):
        return error
    chain = list(_chain(error))
    no_creds = _types("botocore.exceptions", "NoCredentialsError", "PartialCredentialsError")
    if no_creds and any(isinstance(e, no_creds) for e in chain):
        return MissingCredentialsError(f"{url}: {NO_CREDENTIALS}")
    codes = [c for c in map(_code, chain) if c is not None]
    statuses = [s for s in map(_status, chain) if s is not None]
    rejected = [c for c in codes if c in _REJECTED]
    if rejected:
        return CredentialsRejectedError(f"{url}: {CREDENTIALS_REJECTED.format(code=rejected[0])}")
    denied = [c for c in codes if c in _DENIED] + [f"HTTP {s}" for s in statuses if s in (401, 403)]
    if denied:
        return AccessDeniedError(f"{url}: {ACCESS_DENIED.format(code=denied[0])}")
    if "NoSuchBucket" in codes:
        bucket = urlsplit(url).netloc
        return NoSuchBucketError(f"{url}: {NO_BUCKET.format(bucket=bucket)}")
    tls = (ssl.SSLError, *_types("aiohttp", "ClientSSLError"), *_types("botocore.exceptions", "SSLError"))
    for e in chain:
        if isinstance(e, tls):
            reason = next((x for x in chain if isinstance(x, ssl.SSLError)), e)
            text = getattr(reason, "verify_message", None) or getattr(reason, "reason", None) or type(reason).__name__
            return TLSError(f"{url}: {TLS_FAILED.format(host=_host(chain, url, storage_options), reason=text)}")
    dns = (socket.gaierror, *_types("aiohttp", "ClientConnectorDNSError"))
    if any(isinstance(e, dns) for e in chain):
        host = _host(chain, url, storage_options).rsplit(":", 1)[0]
        return EndpointUnreachableError(f"{url}: {UNRESOLVABLE.format(host=host)}")
    refused = (
        ConnectionRefusedError,
        *_types("aiohttp", "ClientConnectorError"),
        *_types("botocore.exceptions", "EndpointConnectionError"),
    )
    timeout = (*_types("botocore.exceptions", "ConnectTimeoutError"), *_types("aiohttp", "ConnectionTimeoutError"))
    if any(isinstance(e, refused + timeout) for e in chain):
        if any(isinstance(e, ConnectionRefusedError) for e in chain):
            reason = "connection refused"
        elif any(isinstance(e, timeout) for e in chain):
            reason = "timed out"
        else:
            reason = next((e.strerror for e in chain if isinstance(e, OSError) and e.strerror), "no connection")
        host = _host(chain, url, storage_options)
        return EndpointUnreachableError(f"{url}: {UNREACHABLE.format(host=host, reason=reason)}")
    if any(isinstance(e, PermissionError) for e in chain):  # a backend that names no code
        return AccessDeniedError(f"{url}: {ACCESS_DENIED.format(code='permission denied')}")
    return None


def wildcard(url: str) -> URLPatternError | None:
    """The refusal of a URL whose path holds a glob wildcard, or None. (Over HTTP ``?`` starts the query and
    is no wildcard; ``[`` may open an IPv6 host, which is not part of the path.)"""
    scheme, _, rest = url.partition("://")
    http = scheme.lower() in ("http", "https")
    parts = urlsplit(url)
    head, path = (f"{scheme}://{parts.netloc}", parts.path) if http else (f"{scheme}://", rest)
    at = next((i for i, c in enumerate(path) if c in ("*[]" if http else "*?[]")), None)
    if at is None:
        return None
    cut = path.rfind("/", 0, at) + 1
    folder, stem = head + path[:cut], path[cut:at]
    example = f"{folder}{stem}{{000000..000099}}.tar"
    return URLPatternError(f"{url}: {GLOB.format(example=example, folder=folder)}")
