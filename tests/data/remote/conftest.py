"""The local S3 server (moto) and a fresh bucket of shards on it, for the object-storage tests."""

import pytest
from remote_shards import make_shards


@pytest.fixture(scope="module")
def server():
    from object_store import S3Server  # moto: only where a test asks for the server

    srv = S3Server()
    yield srv
    srv.stop()


@pytest.fixture
def s3(server, tmp_path, monkeypatch):
    """A fresh bucket ``data`` holding the shards; the loader's caches under tmp_path. s3fs keeps the file
    systems it made for the whole process, each with its endpoint (one from `AWS_ENDPOINT_URL` too): the test
    leaves none behind for a later test to reach a stopped server through."""
    server.start() if server._server is None else None  # noqa: SLF001 - a test may leave it stopped
    server.reset()
    server.client.create_bucket(Bucket="data")
    objects, images = make_shards()
    for key, body in objects.items():
        server.client.put_object(Bucket="data", Key=key, Body=body)
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "dali_fast_cache"))
    server.objects, server.images = objects, images
    yield server
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def empty_bucket(server, tmp_path, monkeypatch, request):
    """The test module's ``BUCKET``, empty, on the server; the loader's caches under tmp_path, no
    ``AWS_ENDPOINT_URL`` (each test names the endpoint), and no s3fs file system left behind."""
    server.start() if server._server is None else None  # noqa: SLF001 - a test may leave it stopped
    server.reset()
    server.client.create_bucket(Bucket=request.module.BUCKET)
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "dali_fast_cache"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    yield server
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
