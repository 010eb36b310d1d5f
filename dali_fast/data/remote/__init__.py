"""Object storage: WebDataset shards and Parquet files at a URL (``s3://``, ``gs://``, ``https://``, any fsspec URL), read
through a node-local cache. A URL's open runs top to bottom through these files:

- ``webdataset.py``: `RemoteShardsReader`, what `open_dataset` returns for shards at a URL: it lists the
  shards, builds or loads each shard's member index, and serves records.
- ``streamed.py``: what both remote readers share: their arguments and cache, the budget each rank needs,
  and the downloads ahead of the loader's order.
- ``index_file.py``: a shard's member index as saved on the node's disk, and read back.
- ``parquet.py``, ``parquet_index.py``: `RemoteParquetReader`, Parquet at a URL: its index from the
  footers, row groups fetched by range into the same cache.
- ``store.py``: the object store through fsspec: what a URL names, and each shard's bytes fetched by
  range requests, retried and checked.
- ``cache.py``: the shard cache one node's processes share, within a byte budget.
- ``stream.py``: one process's downloads ahead of the loader's order, and the shards it pins.
- ``errors.py``: what a store's failure is called, each cause its own exception (`RemoteDataError`).

Nothing here is imported by ``import dali_fast``: fsspec and its backends load with the reader.
"""
