"""Loaders: the epoch driver every backend shares, the backends, and `factory.make_loader`.

Each file's name says which loader it serves and, for `TorchIterator`, which side of its process
boundary it runs on:

- every backend: ``base.py`` (`LoaderBase`: the epoch, its cursor, ranks, the batch's labels or target
  rows, the controller's hooks), ``resume.py`` (what a loader's state holds, and what loading one
  checks), ``passes.py`` (a pass's lifetime), ``bad_records.py`` (what a bad record raises or counts),
  ``order/`` (the epoch orders: random access, streamed shards, and what they share; `make_order` picks
  one), ``sampler.py`` (a loader's rank and world size, and the sampler frameworks read),
  ``controller.py`` + ``memory_probes.py`` (`BatchSizeController` and the memory it reads), ``factory.py``
  (`make_loader`: a backend by name), ``fork_guard.py`` (what a forked child never tears down);
- `DALIIterator`: ``dali_iterator.py`` (the iterator, and what DALI's failures say) and
  ``dali_pipeline.py`` (the external-source feed and the pipeline's build);
- `TorchIterator`: ``torch_iterator.py`` (the main process: plans, finishes batches), ``torch_slots.py``
  (the main process's shared-memory slots, tasks and outputs), ``torch_watch.py`` (the watch over the
  workers: a pass never waits forever on one) and ``torch_worker.py`` (what runs in each decode process);
- the plain DataLoader: ``dataloader.py`` (`make_dataloader`, `create_optimized_dataloader`) and
  ``baseline.py`` (the baseline every comparison is against).
"""
