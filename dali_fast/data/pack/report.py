"""What `pack` reports: the records it wrote, and each thing it left out, named with its reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...text import plural


@dataclass
class PackReport:
    """What `pack` wrote, what it left out and why.

    Attributes:
        dst: the packed set's folder.
        records: the records written.
        classes: the number of classes.
        data_bytes: the bytes of the records' data.
        reencoded: images re-encoded to fit ``max_side``.
        skipped: (path, reason) of each image left out (undecodable, damaged, over the pixel limit...).
        seconds: how long the pack took.
        damaged: (shard, what) of each damaged shard read; the samples it lost are not counted.
        target: what each record's target is: "class", "multihot" or "float" (a target block per row).
        target_width: K classes (multihot) or D numbers (float); 0 for classes.
        ignored: (path, what it is) of what is not an image: other files, links that loop or lead nowhere.
    """

    dst: Path
    records: int
    classes: int
    data_bytes: int
    reencoded: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    damaged: list[tuple[str, str]] = field(default_factory=list)
    target: str = "class"
    target_width: int = 0
    ignored: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        lost = f"; {plural(len(self.damaged), 'damaged shard')} (the samples they lost are not counted)"
        ignored = f"; ignored {plural(len(self.ignored), 'non-image')}"
        targets = "" if self.target == "class" else f" with {self.target} targets of width {self.target_width}"
        return (
            f"packed {plural(self.records, 'record')} of {plural(self.classes, 'class', 'classes')}{targets} ({self.data_bytes / 2**20:.1f} MiB) "
            f"into {self.dst} in {self.seconds:.1f}s; re-encoded {self.reencoded}, left out {len(self.skipped)}"
            + (lost if self.damaged else "")
            + (ignored if self.ignored else "")
        )
