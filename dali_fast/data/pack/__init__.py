"""The write side: a data set written in a format, each file named by the format it writes.

- `packed` (`pack`): the packed format (`data.format`), atomically.
- `webdataset` (`pack_shards`): WebDataset shards, verified as `pack` verifies.
- `tar_writer` (`write_shards`, `ShardReport`): the tar shards themselves, to a folder or a URL.
- `sources`: what a pack reads (an ImageFolder, shards, any reader) and the prepare step of one image.
- `pool`: the ordered worker pool both formats write through, its size, and the checks both make first.
- `report` (`PackReport`): what a pack wrote and what it left out.
"""
