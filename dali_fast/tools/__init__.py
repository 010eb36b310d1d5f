"""The commands' tools: ``bench`` (loaders side by side), ``bench --stages``, ``doctor``, ``inspect``, and the
tables and plots they write (`report`)."""
