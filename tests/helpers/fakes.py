"""Test doubles with a script: a memory probe that returns given readings, a batch-size controller that plays
given sizes (and one that counts the epochs it measured)."""

from __future__ import annotations


class ScriptedProbe:
    """A test double: returns the given readings, one per epoch (None = cannot read)."""

    name = "scripted"
    capacity_bytes = 80 * 2**30

    def __init__(self, readings):
        self.readings = list(readings)
        self.resets = 0

    def reset_peak(self):
        self.resets += 1

    def peak_fraction(self):
        return self.readings.pop(0)


class ScriptedController:
    """A test double for BatchSizeController: plays a fixed list of batch sizes, one per epoch."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.max_batch = max(sizes)
        self.epochs_ended = 0
        self.batch_size = self.sizes[0]

    def attach(self, batch_size):
        pass

    def begin_epoch(self):
        pass

    def end_epoch(self, epoch):
        self.epochs_ended += 1
        self.batch_size = self.sizes[min(self.epochs_ended, len(self.sizes) - 1)]

    def state_dict(self):
        return {"epochs_ended": self.epochs_ended}

    def load_state_dict(self, sd):
        self.epochs_ended = sd["epochs_ended"]


class CountingController(ScriptedController):
    def __init__(self, sizes):
        super().__init__(sizes)
        self.begins = 0

    def begin_epoch(self):
        self.begins += 1
