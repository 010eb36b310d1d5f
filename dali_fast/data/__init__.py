"""Data sets: the on-disk formats and their readers. numpy only, no torch (`open.open_dataset` opens any)."""
