"""The commands' tools: ``bench`` (loaders side by side), ``stages`` (the optimizations one at a time),
``doctor``, ``inspect``, and the tables and plots they write (`report`)."""
