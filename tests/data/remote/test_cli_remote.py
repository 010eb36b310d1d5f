"""The command line's options of data at a URL: ``--cache-dir``, ``--cache-limit`` (with units) and
``--storage-option KEY=VALUE`` (repeatable, VALUE read as JSON where it parses) reach `open_dataset` in
`train`, `bench`, `stages` and `inspect`; for local data, which has no use for them, they are refused in
one line rather than accepted and ignored. Against moto's S3 server."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from builders import jpeg_bytes

from dali_fast.cli import build_parser, main

pytest.importorskip("s3fs")
pytest.importorskip("moto")
wds = pytest.importorskip("webdataset")
from object_store import S3Server  # noqa: E402

SHARDS, PER_SHARD = 3, 8
N = SHARDS * PER_SHARD
SPEC = "s3://cli/train-{000000..000002}.tar"  # moto keeps one store per process: a bucket of its own
DATA_COMMANDS = ["train", "bench", "stages", "inspect"]


@pytest.fixture(scope="module")
def server():
    srv = S3Server()
    srv.client.create_bucket(Bucket="cli")
    srv.objects, srv.samples = {}, []  # samples: (label, image bytes) of each
    for s in range(SHARDS):
        buf = io.BytesIO()
        with wds.TarWriter(buf) as sink:
            for i in range(s * PER_SHARD, (s + 1) * PER_SHARD):
                image = jpeg_bytes(24 + i % 5, 20)
                sink.write({"__key__": f"s{i:04d}", "jpg": image, "cls": str(i % 4).encode()})
                srv.samples.append((i % 4, image))
        srv.objects[f"train-{s:06d}.tar"] = buf.getvalue()
        srv.client.put_object(Bucket="cli", Key=f"train-{s:06d}.tar", Body=buf.getvalue())
    yield srv
    srv.stop()


@pytest.fixture
def env(server, tmp_path, monkeypatch):
    import s3fs

    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # the endpoint comes from --storage-option
    s3fs.S3FileSystem.clear_instance_cache()
    yield server
    s3fs.S3FileSystem.clear_instance_cache()


def endpoint(server) -> list[str]:
    return ["--storage-option", f"endpoint_url={server.endpoint}"]


def test_storage_option_values_are_json_where_they_parse_else_text():
    from dali_fast.cli_values import storage_option_arg

    assert storage_option_arg("anon=true") == ("anon", True)
    assert storage_option_arg("max_concurrency=3") == ("max_concurrency", 3)
    assert storage_option_arg('config_kwargs={"retries": {"max_attempts": 1}}') == (
        "config_kwargs",
        {"retries": {"max_attempts": 1}},
    )
    assert storage_option_arg("endpoint_url=http://minio:9000") == ("endpoint_url", "http://minio:9000")
    assert storage_option_arg("profile=a=b") == ("profile", "a=b")  # the first = splits
    assert storage_option_arg("token=") == ("token", "")
    with pytest.raises(argparse.ArgumentTypeError, match="is not KEY=VALUE; e.g. endpoint_url=http://minio:9000"):
        storage_option_arg("anon")


@pytest.mark.parametrize("command", DATA_COMMANDS)
def test_every_command_that_reads_data_takes_the_options(command):
    parser = build_parser().commands[command]
    args = parser.parse_args(
        ["s3://b/x.tar", "--cache-dir", "/c", "--cache-limit", "200G"]
        + ["--storage-option", "anon=true", "--storage-option", "endpoint_url=http://h:1"]
    )
    assert args.cache_dir == "/c" and args.cache_limit == 200 * 2**30
    assert args.storage_option == [("anon", True), ("endpoint_url", "http://h:1")]


@pytest.mark.parametrize("command", DATA_COMMANDS)
@pytest.mark.parametrize(
    ("flag", "value"), [("--cache-dir", "{tmp}/c"), ("--cache-limit", "200G"), ("--storage-option", "anon=true")]
)
def test_local_data_refuses_the_options_of_data_at_a_url(command, flag, value, tmp_path, capsys):
    (tmp_path / "data" / "a").mkdir(parents=True)
    (tmp_path / "data" / "a" / "x.jpg").write_bytes(jpeg_bytes())
    argv = [command, str(tmp_path / "data"), flag, value.format(tmp=tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"dali-fast {command}: error: {flag} applies to data at a URL (s3://, gs://, https://, ...), "
        f"not to {tmp_path / 'data'}\n"
    )
    assert not (tmp_path / "c").exists()
    if command != "inspect":  # the default data set is local too
        assert main([command, flag, value.format(tmp=tmp_path)]) == 2
        assert capsys.readouterr().err.endswith("not to the synthetic set\n")


def test_a_storage_option_given_twice_is_refused(env, capsys):
    argv = ["inspect", SPEC, *endpoint(env), "--storage-option", "anon=true", "--storage-option", "anon=false"]
    assert main(argv) == 2
    assert (
        capsys.readouterr().err
        == "dali-fast inspect: error: --storage-option anon is given twice; give each key once\n"
    )


def test_inspect_caches_where_told(env, tmp_path, capsys):
    cache = tmp_path / "node-cache"
    assert main(["inspect", SPEC, "--cache-dir", str(cache), "--cache-limit", "10M", *endpoint(env)]) == 0
    assert f"records:  {N}" in capsys.readouterr().out
    cached = sorted(p.read_bytes() for p in (cache / "shards").glob("*.tar"))
    assert cached == sorted(env.objects.values()) and len(list((cache / "index").glob("*.npz"))) == SHARDS
    assert not (tmp_path / "default-cache").exists()  # nothing went to the default folder


@pytest.mark.parametrize("command", DATA_COMMANDS)
def test_cache_limit_reaches_the_reader(env, tmp_path, command, capsys):
    """A budget too small for two shuffle windows is refused by the reader, with its own message: the
    option got there (``1K`` is 1024 bytes)."""
    shard = max(len(b) for b in env.objects.values())
    argv = [command, SPEC, "--cache-dir", str(tmp_path / "c"), "--cache-limit", "1K", *endpoint(env)]
    if command in ("bench", "stages"):
        argv += ["--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dali-fast {command}: error: cache_limit=1024: too small for 1 rank(s) on this node")
    assert f"shard(s) of up to {shard} bytes" in err and err.count("\n") == 1


def test_train_and_bench_read_a_url_through_the_cache_dir(env, tmp_path, capsys):
    cache = tmp_path / "c"
    common = [SPEC, "--cache-dir", str(cache), *endpoint(env), "--batch-size", "4", "--image-size", "16"]
    assert main(["train", *common, "--loader", "torch", "--model", "resnet_tiny", "--epochs", "1"]) == 0
    assert sorted(p.read_bytes() for p in (cache / "shards").glob("*.tar")) == sorted(env.objects.values())
    out = tmp_path / "bench"
    assert main(["bench", *common, "--loaders", "torch", "--epochs", "1", "--no-limit", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["rows"][0]["images_per_epoch"] == N and result["settings"]["dataset"] == SPEC
    assert not (tmp_path / "default-cache" / "remote").exists()


def test_pack_reads_a_url_with_its_storage_options(env, tmp_path, capsys):
    from dali_fast import MemmapReader

    assert (
        main(["pack", SPEC, str(tmp_path / "p"), "--no-verify", *endpoint(env), "--cache-dir", str(tmp_path / "c")])
        == 0
    )
    packed = MemmapReader(tmp_path / "p")
    got = sorted((int(packed[i][1]), bytes(packed[i][0])) for i in range(len(packed)))
    assert got == sorted(env.samples)  # every sample, exact bytes, labels as served
    assert capsys.readouterr().out.startswith(f"packed {N} ")


def test_pack_of_local_data_refuses_storage_options(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    assert main(["pack", str(tmp_path / "src"), str(tmp_path / "p"), "--storage-option", "anon=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dali-fast pack: error: --storage-option applies to data at a URL") and err.count("\n") == 1
    assert not (tmp_path / "p").exists()
