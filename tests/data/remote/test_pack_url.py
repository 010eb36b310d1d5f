"""`pack` reads data at a URL through its reader, as every other command does: a URL never becomes the
"s3:/..." path of a folder that does not exist."""

from __future__ import annotations

import pytest
from remote_shards import SPEC, N, opts

from dali_fast import MemmapReader, open_dataset, pack

pytest.importorskip("s3fs")
pytest.importorskip("moto")


def test_pack_reads_remote_shards_through_their_reader(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    report = pack(SPEC, tmp_path / "packed", progress=False, verify=False)
    packed = MemmapReader(tmp_path / "packed")
    assert report.records == len(packed) == N
    remote = open_dataset(SPEC, **opts(s3, tmp_path))
    got = sorted((int(packed[i][1]), bytes(packed[i][0])) for i in range(N))
    assert got == sorted((int(remote[i][1]), bytes(remote[i][0])) for i in range(N))  # exact bytes and labels
    assert got == sorted((k, s3.images[k]) for k in range(N))


def test_pack_of_a_url_reads_the_targets_asked_for(s3, tmp_path, monkeypatch):
    """target="float" reaches the URL's reader: each sample's .json list is packed as its target row."""
    import io
    import json

    import numpy as np
    import webdataset as wds
    from builders import jpeg_bytes

    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for i in range(5):
            sink.write({"__key__": f"s{i}", "jpg": jpeg_bytes(20 + i, 16), "json": json.dumps({"labels": [i, -i / 4]})})
    s3.client.put_object(Bucket="data", Key="float-000000.tar", Body=buf.getvalue())
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    report = pack("s3://data/float-000000.tar", tmp_path / "packed", progress=False, target="float")
    assert (report.target, report.target_width, report.records, report.skipped) == ("float", 2, 5, [])
    packed = open_dataset(tmp_path / "packed")
    rows = packed.targets.rows(np.arange(5))
    assert sorted(rows.tolist()) == [[i, -i / 4] for i in range(5)]
