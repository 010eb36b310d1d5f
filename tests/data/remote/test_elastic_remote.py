"""Elastic resume over remote WebDataset shards (the streaming order) on moto's S3 server, in both loaders:
4→2, 2→3, 1→4 and 4→1 ranks, each sample of the epoch once, equal batch counts, the next epoch plain."""

from __future__ import annotations

import numpy as np
import pytest
from elastic_cases import TRANSITIONS, loader_maker, run_elastic

pytest.importorskip("s3fs")
pytest.importorskip("moto")
from remote_shards import SPEC, N, opts  # noqa: E402

from dali_fast import open_dataset  # noqa: E402
from dali_fast.loaders.order.streaming import StreamingOrder  # noqa: E402


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_elastic_resume_of_remote_shards_in_both_loaders(s3, tmp_path, backend):
    reader = open_dataset(SPEC, **opts(s3, tmp_path, shuffle_window=2))
    make = loader_maker(backend, reader)
    assert isinstance(make(3, rank=0, world_size=1).order, StreamingOrder)
    for old, new in TRANSITIONS:
        run_elastic(make, old, new, np.arange(N))  # each sample's label is its number
    reader.close()
