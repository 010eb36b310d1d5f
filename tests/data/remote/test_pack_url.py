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
