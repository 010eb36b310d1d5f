"""The commands' tools: ``bench`` (loaders side by side), ``stages`` (the optimizations one at a time),
``doctor`` (with ``diagnosis``, its verdict, and ``known_defects``, the decode defects of the libraries it
reads), ``inspect``, and the tables and plots they write (`report`)."""
