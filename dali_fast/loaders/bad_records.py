"""What every loader raises and counts for a record it cannot decode: `BadRecordError` naming the record
(``on_error='raise'``), or a `SkipLog` entry, logged once per record (``on_error='skip'``)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..data.base import Reader

__all__ = ["BadRecordError", "SkipLog", "bad_record_message"]

log = logging.getLogger(__name__)


class BadRecordError(ValueError):
    """A record that cannot be decoded; names its index and source path."""


@dataclass
class SkipLog:
    """Skipped records: counted, each logged once, and held until the batch they were skipped from is
    yielded (`yielded`), which a backend that works ahead may reach several batches later."""

    count: int = 0
    logged: set[int] = field(default_factory=set)
    pending: Counter[int] = field(default_factory=Counter)

    def add(self, index: int, source: str, reason: str) -> None:
        self.count += 1
        self.pending[index] += 1
        if index not in self.logged:
            self.logged.add(index)
            log.warning("skipping record %d (%s): %s", index, source, reason)

    def yielded(self, planned: np.ndarray, rows: int) -> np.ndarray:
        """The indices of a yielded batch's ``rows``: its ``planned`` indices less the ones skipped from it
        (``len(planned) - rows`` of them, among those `add` holds)."""
        missing = len(planned) - rows
        if missing <= 0:
            return planned
        keep = np.ones(len(planned), dtype=bool)
        for k, index in enumerate(planned.tolist()):
            if missing and self.pending[index] > 0:
                self.pending[index] -= 1
                keep[k], missing = False, missing - 1
        self.pending += Counter()  # drop the zero counts
        return planned[keep]


def bad_record_message(reader: Reader, index: int, reason: str) -> str:
    return (
        f"record {index} ({reader.source(index)}): {reason}; remove or re-pack it, "
        "or skip bad records with on_error='skip' (dali-fast: --on-error skip)"
    )
