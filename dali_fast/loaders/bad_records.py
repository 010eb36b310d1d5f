"""What every loader raises and counts for a record it cannot decode: `BadRecordError` naming the record
(``on_error='raise'``), or a `SkipLog` entry, logged once per record (``on_error='skip'``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..data.base import Reader

__all__ = ["BadRecordError", "SkipLog", "bad_record_message"]

log = logging.getLogger(__name__)


class BadRecordError(ValueError):
    """A record that cannot be decoded; names its index and source path."""


@dataclass
class SkipLog:
    """Skipped records: counted, and each logged once."""

    count: int = 0
    logged: set[int] = field(default_factory=set)

    def add(self, index: int, source: str, reason: str) -> None:
        self.count += 1
        if index not in self.logged:
            self.logged.add(index)
            log.warning("skipping record %d (%s): %s", index, source, reason)


def bad_record_message(reader: Reader, index: int, reason: str) -> str:
    return (
        f"record {index} ({reader.source(index)}): {reason}; remove or re-pack it, "
        "or skip bad records with on_error='skip' (dali-fast: --on-error skip)"
    )
