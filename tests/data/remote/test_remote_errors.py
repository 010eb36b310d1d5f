"""Every way data at a URL cannot be had is named for its real cause, against real servers on localhost:
one line, a `RemoteDataError` of its own type from the API (also a ValueError, FileNotFoundError,
PermissionError or ConnectionError as fits), exit code 2 and no traceback from the command. Each message
is one that docs/troubleshooting.md lists. The object-store clients' INFO lines show only under -v."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from builders import jpeg_bytes

from dali_fast import open_dataset
from dali_fast.cli import main
from dali_fast.data.remote import errors
from dali_fast.data.remote.errors import RemoteDataError

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")
wds = pytest.importorskip("webdataset")
from object_store import RangeHTTPServer, S3Server, free_port, self_signed_certificate  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SHARD = "s3://errors/train-000000.tar"  # moto keeps one store per process: a bucket of this file's own
FAST = {"config_kwargs": {"retries": {"max_attempts": 1}}}  # botocore's own retries: a test waits on none


def shard_bytes(count: int = 4) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for i in range(count):
            sink.write({"__key__": f"s{i}", "jpg": jpeg_bytes(20 + i, 20), "cls": str(i).encode()})
    return buf.getvalue()


@pytest.fixture(scope="module")
def server():
    srv = S3Server()
    srv.client.create_bucket(Bucket="errors")
    srv.client.put_object(Bucket="errors", Key="train-000000.tar", Body=shard_bytes())
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """Each test its own cache, and new filesystems (fsspec reuses one per set of options, with the
    credentials it found then)."""
    import fsspec.implementations.http

    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    fsspec.implementations.http.HTTPFileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()
    fsspec.implementations.http.HTTPFileSystem.clear_instance_cache()


def _documented() -> list[re.Pattern]:
    """The object-storage messages docs/troubleshooting.md lists, as patterns (``<url>`` and the other
    placeholders stand for any text)."""
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = text.split("## Object storage", 1)[1].split("\n## ", 1)[0]
    found = []
    for code in re.findall(r"\*\*`([^`]+)`\*\*", section.replace("\n  ", " ")):
        parts = re.split(r"<[a-z ]+>", code)
        found.append(re.compile(".+?".join(map(re.escape, parts))))
    return found


def refused(call, kind: type, cli: list[str] | None, capsys) -> str:
    """The one-line message ``call`` raises (of type ``kind``, a RemoteDataError), which the docs list;
    and the same line, exit code 2 and nothing else, from ``dali-fast`` given ``cli``."""
    with pytest.raises(kind) as e:
        call()
    message = str(e.value)
    assert isinstance(e.value, RemoteDataError) and "\n" not in message
    assert any(p.fullmatch(message) for p in _documented()), f"not in docs/troubleshooting.md: {message}"
    if cli is not None:
        capsys.readouterr()
        assert main(cli) == 2
        out = capsys.readouterr()
        assert out.err == f"dali-fast {cli[0]}: error: {message}\n" and out.out == ""
    return message


def opts(endpoint: str, **more) -> dict:
    return {"storage_options": {"endpoint_url": endpoint, **FAST, **more}}


def cli_opts(endpoint: str) -> list[str]:
    return [
        "--storage-option",
        f"endpoint_url={endpoint}",
        "--storage-option",
        f"config_kwargs={json.dumps(FAST['config_kwargs'])}",
    ]


# --------------------------------------------------------------------------------------------- credentials


def test_no_credentials(server, tmp_path, monkeypatch, capsys):
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
    ):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))  # no other source exists
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    message = refused(
        lambda: open_dataset(SHARD, **opts(server.endpoint)),
        errors.MissingCredentialsError,
        ["inspect", SHARD, *cli_opts(server.endpoint)],
        capsys,
    )
    assert message == f"{SHARD}: {errors.NO_CREDENTIALS}"
    assert isinstance(errors.MissingCredentialsError("x"), PermissionError)
    server.client.create_bucket(Bucket="errors-public")  # what the message offers for a public bucket: anon=true
    server.client.put_object(Bucket="errors-public", Key="train-000000.tar", Body=shard_bytes(), ACL="public-read")
    assert len(open_dataset("s3://errors-public/train-000000.tar", **opts(server.endpoint, anon=True))) == 4


def _with_iam_user(server, policy: dict | None):
    """An IAM user of moto's (with ``policy`` inline, if any) and its keys; the server then checks every
    request's credentials and permissions until ``check_credentials(False)``."""
    from botocore.session import Session

    iam = Session().create_client("iam", endpoint_url=server.endpoint, region_name="us-east-1")
    name = f"reader{free_port()}"
    iam.create_user(UserName=name)
    if policy is not None:
        iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    server.check_credentials(True)
    return key["AccessKeyId"], key["SecretAccessKey"]


@pytest.fixture
def auth(server):
    yield lambda policy=None: _with_iam_user(server, policy)
    server.check_credentials(False)


def test_access_denied_and_rejected_credentials(server, auth, monkeypatch, capsys):
    key, secret = auth()  # a user with no permission at all
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    message = refused(
        lambda: open_dataset(SHARD, **opts(server.endpoint)),
        errors.AccessDeniedError,
        ["inspect", SHARD, *cli_opts(server.endpoint)],
        capsys,
    )
    assert message == f"{SHARD}: {errors.ACCESS_DENIED.format(code='AccessDenied')}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODYKNOWS00000")
    s3fs.S3FileSystem.clear_instance_cache()  # one made with the other key would be reused
    message = refused(
        lambda: open_dataset(SHARD, **opts(server.endpoint)), errors.CredentialsRejectedError, None, capsys
    )
    assert message == f"{SHARD}: {errors.CREDENTIALS_REJECTED.format(code='InvalidAccessKeyId')}"


def test_listing_allowed_but_reading_denied_is_access_denied_not_a_damaged_shard(server, auth, monkeypatch, capsys):
    list_only = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::errors"}],
    }
    key, secret = auth(list_only)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    message = refused(
        lambda: open_dataset(SHARD, **opts(server.endpoint)),
        errors.AccessDeniedError,
        ["inspect", SHARD, *cli_opts(server.endpoint)],
        capsys,
    )
    assert message == f"{SHARD}: {errors.ACCESS_DENIED.format(code='AccessDenied')}"


def test_http_403_is_access_denied(tmp_path, capsys):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "train-000000.tar").write_bytes(shard_bytes())
    srv = RangeHTTPServer(tmp_path / "www")
    srv.deny.add("train-000000.tar")
    try:
        url = f"{srv.url}/train-000000.tar"
        message = refused(lambda: open_dataset(url), errors.AccessDeniedError, ["inspect", url], capsys)
        assert message == f"{url}: {errors.ACCESS_DENIED.format(code='HTTP 403')}"
    finally:
        srv.stop()


def test_a_server_that_ignores_ranges_is_named_at_open(tmp_path, capsys):
    """A web server that answers a range request with the whole file (200, as ``python -m http.server``
    does): Parquet (its footer, label columns and row groups read by ranges) and a shard of several
    download chunks are refused in one line, never retried; a shard fetched in one request, whose whole
    body is the range asked, reads as from any server."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    www = tmp_path / "www"
    www.mkdir()
    images = [jpeg_bytes(20 + i, 16) for i in range(7)]
    table = pa.table({"image": images, "label": [i % 3 for i in range(7)]})
    pq.write_table(table, www / "train-0.parquet", row_group_size=3)
    shard = shard_bytes()
    (www / "train-000000.tar").write_bytes(shard)
    size = (www / "train-0.parquet").stat().st_size
    first = pq.ParquetFile(www / "train-0.parquet").metadata.row_group(0).column(1)  # the label column's
    asked = first.total_compressed_size  # first read by range: row group 0's label chunk
    assert first.path_in_schema == "label" and size > asked
    srv = RangeHTTPServer(www, ranges=False)
    try:
        url = f"{srv.url}/train-0.parquet"
        message = refused(
            lambda: open_dataset(url, cache_dir=tmp_path / "c"), errors.RangeIgnoredError, ["inspect", url], capsys
        )
        assert message == (
            f"{url}: the server sent {size} bytes for a range of {asked}: it does not answer range requests; serve "
            "the files from a server that does (nginx, S3, ...) or download them and open the local copy"
        )
        tar = f"{srv.url}/train-000000.tar"
        r = open_dataset(tar, cache_dir=tmp_path / "c")  # one download chunk (8 MiB): the whole file, asked for
        assert [(bytes(r[i][0]), r[i][1]) for i in range(len(r))] == [(jpeg_bytes(20 + i, 20), i) for i in range(4)]
        r.close()
        srv.counts.reset()
        message = refused(
            lambda: open_dataset(tar, cache_dir=tmp_path / "c2", chunk_bytes=1024, retry_seconds=60),
            errors.RangeIgnoredError,
            None,
            capsys,
        )
        assert message == f"{tar}: {errors.RANGE_IGNORED.format(got=len(shard), asked=1024)}"
        assert srv.gets == {"train-000000.tar": 1}  # not retried
        srv.ranges = True  # indexed through a server that answers ranges, read through one that no longer does
        r = open_dataset(url, cache_dir=tmp_path / "c3", retry_seconds=60)
        assert len(r) == 7
        srv.ranges = False
        srv.counts.reset()
        _, _, bad = r.read_batch_checked([3])  # row 3: row group 1, its image column by range
        images = pq.ParquetFile(www / "train-0.parquet").metadata.row_group(1).column(0).total_compressed_size
        assert bad == {
            0: f"unreadable: row group 1 of {url}: {url}: {errors.RANGE_IGNORED.format(got=size, asked=images)}"
        }
        assert srv.gets == {"train-0.parquet": 1}  # not retried
        r.close()
    finally:
        srv.stop()


# --------------------------------------------------------------------------------------------- the endpoint


def test_an_endpoint_that_refuses_connections(tmp_path, capsys):
    port = free_port()  # nobody listens on it
    endpoint = f"http://127.0.0.1:{port}"
    message = refused(
        lambda: open_dataset(SHARD, **opts(endpoint)),
        errors.EndpointUnreachableError,
        ["inspect", SHARD, *cli_opts(endpoint)],
        capsys,
    )
    assert message == f"{SHARD}: {errors.UNREACHABLE.format(host=f'127.0.0.1:{port}', reason='connection refused')}"
    assert isinstance(errors.EndpointUnreachableError("x"), ConnectionError)
    url = f"{endpoint}/train-000000.tar"  # plain HTTP: fsspec calls it "not found"; it is not
    message = refused(lambda: open_dataset(url), errors.EndpointUnreachableError, ["inspect", url], capsys)
    assert message == f"{url}: {errors.UNREACHABLE.format(host=f'127.0.0.1:{port}', reason='connection refused')}"


def test_an_endpoint_whose_name_does_not_resolve(capsys):
    endpoint = "http://objects.invalid:9000"  # .invalid never resolves (RFC 2606)
    message = refused(
        lambda: open_dataset(SHARD, **opts(endpoint)),
        errors.EndpointUnreachableError,
        ["inspect", SHARD, *cli_opts(endpoint)],
        capsys,
    )
    assert message == f"{SHARD}: {errors.UNRESOLVABLE.format(host='objects.invalid')}"
    url = "https://shards.invalid/train-000000.tar"
    message = refused(lambda: open_dataset(url), errors.EndpointUnreachableError, ["inspect", url], capsys)
    assert message == f"{url}: {errors.UNRESOLVABLE.format(host='shards.invalid')}"


def test_a_tls_failure_and_the_fix_the_message_gives(tmp_path, capsys, monkeypatch):
    pytest.importorskip("cryptography")
    cert, key = self_signed_certificate(tmp_path / "tls")
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "train-000000.tar").write_bytes(shard_bytes())
    srv = RangeHTTPServer(tmp_path / "www", tls=(cert, key))
    try:
        url = f"{srv.url}/train-000000.tar"
        host = f"127.0.0.1:{srv.port}"
        message = refused(lambda: open_dataset(url), errors.TLSError, ["inspect", url], capsys)
        assert message.startswith(f"{url}: TLS with {host} failed (") and "certificate" in message
        assert isinstance(errors.TLSError("x"), ConnectionError)
        message = refused(
            lambda: open_dataset(SHARD, **opts(srv.url)),
            errors.TLSError,
            ["inspect", SHARD, *cli_opts(srv.url)],
            capsys,
        )
        assert message.startswith(f"{SHARD}: TLS with {host} failed (")
        # The fix it names: trust that authority (SSL_CERT_FILE for https://, read when the process starts).
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SSL_CERT_FILE": str(cert)}
        proc = subprocess.run(
            [sys.executable, "-m", "dali_fast", "inspect", url], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and "records:  4" in proc.stdout, proc.stderr[-2000:]
    finally:
        srv.stop()


# --------------------------------------------------------------------------------------------- names


def test_a_bucket_that_does_not_exist(server, capsys):
    for url in ("s3://nobucket/train-000000.tar", "s3://nobucket/", "s3://nobucket/train-{000000..000002}.tar"):
        message = refused(
            lambda url=url: open_dataset(url, **opts(server.endpoint)),
            errors.NoSuchBucketError,
            ["inspect", url, *cli_opts(server.endpoint)],
            capsys,
        )
        assert message == f"{url}: {errors.NO_BUCKET.format(bucket='nobucket')}"


def test_a_key_that_does_not_exist(server, tmp_path, capsys):
    spec = "s3://errors/train-{000000..000003}.tar"
    message = refused(
        lambda: open_dataset(spec, **opts(server.endpoint)),
        errors.NoSuchShardError,
        ["inspect", spec, *cli_opts(server.endpoint)],
        capsys,
    )
    assert message == f"s3://errors/train-000001.tar and 2 more: {errors.NO_SHARD}"
    (tmp_path / "www").mkdir()
    srv = RangeHTTPServer(tmp_path / "www")
    try:
        url = f"{srv.url}/train-000000.tar"
        message = refused(lambda: open_dataset(url), errors.NoSuchShardError, ["inspect", url], capsys)
        assert message == f"{url}: {errors.NO_SHARD}"
    finally:
        srv.stop()


def test_a_glob_in_a_url_says_urls_take_brace_patterns_or_a_folder(server, capsys):
    url = "s3://errors/train-*.tar"
    message = refused(
        lambda: open_dataset(url, **opts(server.endpoint)),
        errors.URLPatternError,
        ["inspect", url, *cli_opts(server.endpoint)],
        capsys,
    )
    assert message == (
        "s3://errors/train-*.tar: a URL takes no wildcards (* ? [ ]); name the shards with a brace pattern such as "
        "s3://errors/train-{000000..000099}.tar, or give their folder, s3://errors/"
    )
    assert isinstance(errors.URLPatternError("x"), ValueError)
    assert errors.wildcard("https://h/a/train-000000.tar?X-Amz-Signature=1") is None  # ? starts a query there


def test_storage_options_the_backend_refuses_and_any_other_failure_are_one_line(server, capsys):
    message = refused(
        lambda: open_dataset(SHARD, **opts(server.endpoint, endpoint_urll="http://x")),
        errors.StorageOptionsError,
        ["inspect", SHARD, *cli_opts(server.endpoint), "--storage-option", "endpoint_urll=http://x"],
        capsys,
    )
    assert message.startswith(f"{SHARD}: the storage options (config_kwargs, endpoint_url, endpoint_urll) do not")
    assert "unexpected keyword argument 'endpoint_urll'" in message
    assert isinstance(errors.StorageOptionsError("x"), ValueError)
    url = "s3://Not_A_Bucket!/train-000000.tar"  # botocore refuses the name before any request
    message = refused(
        lambda: open_dataset(url, **opts(server.endpoint)),
        errors.StoreFailedError,
        ["inspect", url, *cli_opts(server.endpoint)],
        capsys,
    )
    assert message.startswith(f"{url}: the object store failed (ParamValidationError: Parameter validation failed: ")
    assert 'Invalid bucket name "Not_A_Bucket!"' in message


def test_a_missing_extra_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    message = refused(lambda: open_dataset(SHARD), errors.MissingExtraError, ["inspect", SHARD], capsys)
    assert (
        message == f"{SHARD}: remote data needs fsspec and a backend: pip install 'dali_fast[cloud]' (gs:// also gcsfs)"
    )


# --------------------------------------------------------------------------------------------- noise


def _inspect(server, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",  # from the environment: what botocore announces at INFO
        "AWS_SECRET_ACCESS_KEY": "testing",
        "DALI_FAST_CACHE": str(tmp_path / "cli-cache"),
    }
    argv = [sys.executable, "-m", "dali_fast", *flags, "inspect", SHARD]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_the_object_store_clients_info_lines_show_only_under_verbose(server, tmp_path):
    quiet = _inspect(server, tmp_path)
    assert quiet.returncode == 0 and "records:  4" in quiet.stdout, quiet.stderr[-2000:]
    assert "Found credentials" not in quiet.stderr and "botocore" not in quiet.stderr
    verbose = _inspect(server, tmp_path, "-v")
    assert verbose.returncode == 0
    found = r"^INFO (aio)?botocore\.credentials: Found credentials in environment variables\.$"
    assert re.search(found, verbose.stderr, re.M), verbose.stderr[-2000:]
    assert "DEBUG botocore" not in verbose.stderr  # under -v their INFO lines, not every request's headers
