"""Data sets: the on-disk formats, read and written. numpy only, no torch.

The read side: one reader per format, and ``open`` (`open_dataset`), the one place that knows every format:

- the formats: ``format`` (the packed layout, one place), ``packed`` (`MemmapReader`), ``folder``
  (`ImageFolderReader`, torchvision's rule), ``webdataset`` (`WebDatasetReader`) over ``shards`` (WebDataset's
  rules: names, keys, labels) and ``tar`` (the tar walk, as `tarfile` reads it), ``member_index`` (what
  shard readers share), ``parquet`` (`ParquetReader`) with ``parquet_index`` (files and index),
  ``parquet_columns`` (which columns), ``parquet_group`` (`RowGroup`) and ``path_refs`` (images stored as
  paths), ``synthetic`` (made-up data sets), ``remote/`` (the same formats at a URL);
- what every reader shares: ``base`` (the `Reader` protocol, reads, subsets, the after-fork resets),
  ``checks`` (per-record checks), ``verify`` (the decode verdict), ``targets`` (multi-hot and float
  targets), ``classes`` (the class map every split shares), ``cache`` (`LRUCache`, `CachedReader`).

The write side is ``pack/``: each file named by the format it writes.
"""
