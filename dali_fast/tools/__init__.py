"""The commands' tools: ``bench`` (loaders side by side: `bench`, its rows in `bench_rows`, `ffcv_row` and
`spdl_row`, its table and chart in `bench_table`, its ranks in `bench_ranks`, the process tree's memory in
`tree_memory`), ``stages`` (the optimizations one at a time), ``doctor`` (with `diagnosis`, its verdict, and
`known_defects`, the decode defects of the libraries it reads), ``inspect``, and the tables and plots they
write (`report`)."""
