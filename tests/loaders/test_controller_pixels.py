"""`BatchSizeController` across image sizes (`set_pixels`): readings at one size predict another, the batch
is cut before a larger size, and readings and ceilings are kept in samples of the reference size."""

from __future__ import annotations

import logging

import pytest
from fakes import ScriptedProbe

from dali_fast.loaders.controller import BatchSizeController


class PixelLinearProbe:
    """Peak = fixed + per_pixel * batch * pixels per sample (the controller's current size)."""

    name = "pixels"
    capacity_bytes = 2**30

    def __init__(self, fixed, per_pixel):
        self.fixed, self.per_pixel, self.controller = fixed, per_pixel, None

    def reset_peak(self):
        pass

    def peak_fraction(self):
        return self.fixed + self.per_pixel * self.controller.batch_size * self.controller.pixels


def test_set_pixels_scales_the_prediction_and_cuts_before_a_larger_size(caplog):
    """Readings at 160 px predict 224 px by the pixel ratio: the batch is cut before the larger epoch,
    never after it went over; a smaller size cuts nothing; a ramp's every epoch stays under the target."""
    probe = PixelLinearProbe(0.10, 0.60 / (512 * 160 * 160))  # 70% at batch 512, 160 px
    changes = []
    c = BatchSizeController(64, 512, 0.85, probe=probe, release=None, on_change=lambda o, n: changes.append((o, n)))
    probe.controller = c
    c.attach(512)
    peaks = []
    for epoch, side in enumerate([160, 160, 192, 224, 224, 160]):
        with caplog.at_level(logging.INFO, logger="dali_fast.loaders.controller"):
            c.set_pixels(side * side)
        c.begin_epoch()
        peaks.append(probe.peak_fraction())
        c.end_epoch(epoch)
    assert max(peaks) <= 0.85, peaks
    assert c.ref_pixels == 160 * 160 and c.observations[0] == (512, pytest.approx(0.70))
    shrinks = [h for h in c.history if h["epoch"] is None]
    assert [h["reason"].split(":")[0] for h in shrinks] == ["image size 160 → 192 px", "image size 192 → 224 px"]
    assert changes and all(new < old for old, new in changes[:2])
    assert "image size 160 → 192 px: predicted" in caplog.text
    # the state keeps the size the readings are counted in
    state = c.state_dict()
    assert (state["pixels"], state["ref_pixels"]) == (160 * 160, 160 * 160)
    d = BatchSizeController(64, 512, 0.85, probe=probe, release=None)
    d.load_state_dict(state)
    assert d.predict(300 * 224 * 224 / (160 * 160)) == c.predict(300 * 224 * 224 / (160 * 160))
    assert (d.pixels, d.ref_pixels) == (c.pixels, c.ref_pixels)


def test_set_pixels_without_readings_or_a_change_holds():
    c = BatchSizeController(8, 512, probe=ScriptedProbe([]), release=None)
    c.attach(256)
    assert c.set_pixels(160 * 160) == 256 and c.set_pixels(160 * 160) == 256
    assert c.set_pixels(224 * 224) == 256  # nothing measured yet: no ground to cut on
    with pytest.raises(ValueError, match=r"^pixels=0: must be >= 1$"):
        c.set_pixels(0)


def test_a_ceiling_found_at_a_small_size_holds_at_a_larger_one():
    """A batch that went over at 160 px is over at 224 px with fewer samples: the ceiling is in samples
    of the first size, so it is scaled too."""
    c = BatchSizeController(8, 1024, 0.85, probe=ScriptedProbe([0.95]), release=None, multiple_of=8)
    c.attach(512)
    c.set_pixels(160 * 160)
    c.begin_epoch()
    c.end_epoch(0)  # 95% at 512: shrink to 256, ceiling 512 (in 160 px samples)
    assert (c.batch_size, c.ceiling) == (256, 512)
    c.observations.clear()  # only the ceiling to go by
    assert c.set_pixels(320 * 320) == 120  # 4x the pixels: under 512 / 4 = 128 samples of 160 px


def _sized(readings, batch, *sides, **kw):
    """A controller at ``batch``, told the sizes ``sides`` in turn (the first is the reference size)."""
    c = BatchSizeController(kw.pop("min_batch", 8), 1024, probe=ScriptedProbe(readings), release=None, **kw)
    c.attach(batch)
    for side in sides:
        c.set_pixels(side * side)
    return c


def test_a_reading_at_another_size_is_kept_in_reference_samples():
    """200 samples of 200 px weigh 312.5 samples of 160 px (the pixel ratio, 1.5625): the reading and the
    ceiling it sets are kept at that weight, a fraction where it is not a whole batch."""
    c = _sized([0.95], 200, 160, 200)
    c.begin_epoch()
    assert c.end_epoch(0) == 96
    assert c.observations == [(312.5, 0.95)] and c.ceiling == 312.5
    assert c.state_dict()["ceiling"] == 312.5


def test_an_out_of_memory_at_another_size_sets_the_ceiling_in_reference_samples():
    c = _sized([0.5], 200, 160, 200)
    c.begin_epoch()
    c.report_oom(200)
    assert c.end_epoch(0) == 96 and c.ceiling == 312.5 and c.observations == []


def test_a_ceiling_only_comes_down():
    """A batch size set by hand above the ceiling that goes over again (by the reading or out of memory)
    leaves the ceiling at the smaller batch that went over first."""
    c = _sized([0.95, 0.95, 0.5], 256)
    c.begin_epoch()
    c.end_epoch(0)
    assert (c.batch_size, c.ceiling) == (128, 256)
    for e in (1, 2):
        c.attach(512)  # as loader.batch_size = 512 does
        c.begin_epoch()
        if e == 2:
            c.report_oom(512)
        assert c.end_epoch(e) == 256
        assert c.ceiling == 256, e


def test_the_ceiling_holds_and_comes_down_at_another_size():
    """A ceiling of 512 samples of 160 px: at 200 px, growing 256 to 512 (800 reference samples) is held
    for it; 256 samples of 200 px going over bring it down to 400."""
    c = _sized([0.95, 0.30, 0.90], 512, 160)
    c.begin_epoch()
    c.end_epoch(0)
    assert (c.batch_size, c.ceiling) == (256, 512)
    assert c.set_pixels(200 * 200) == 256  # 0.95 * 400 / 512 = 74% predicted: fits under 80%
    c.begin_epoch()
    assert c.end_epoch(1) == 256
    assert c.history[-1]["reason"] == "peak 30% of 80 GiB; batch 512 went over 85% before"
    c.begin_epoch()
    assert c.end_epoch(2) == 128
    assert c.ceiling == 400 and c.observations[1:] == [(400, 0.30), (400, 0.90)]


def test_a_size_change_that_cuts_is_recorded_and_logged_exactly(caplog):
    """Readings at 100 px put 64 samples at 50%; at 200 px (4x the pixels) 64 samples are predicted at
    200%, over 75% - 25% = 50%: cut to the largest that fits, 16, predicted at exactly the limit."""
    c = _sized([0.5], 64, 100, target_fraction=0.75, hysteresis=0.25)
    c.begin_epoch()
    assert c.end_epoch(0) == 64  # 128 predicted at 100%: held
    with caplog.at_level(logging.INFO, logger="dali_fast.loaders.controller"):
        assert c.set_pixels(200 * 200) == 16
    reason = "image size 100 → 200 px: predicted 200% at 64 > 50%"
    assert c.history[-1] == {
        "epoch": None,
        "batch_size": 64,
        "peak_fraction": None,
        "decision": "shrink",
        "reason": reason,
        "next_batch_size": 16,
    }
    assert [r.getMessage() for r in caplog.records] == [f"{reason} → batch 64 → 16 (shrink)"]
    assert c.batch_size == 16


def test_a_size_change_cuts_to_the_largest_batch_that_fits_in_steps_of_one():
    c = _sized([0.52], 64, 100, min_batch=1, multiple_of=1, target_fraction=0.75, hysteresis=0.25)
    c.begin_epoch()
    c.end_epoch(0)
    assert c.set_pixels(200 * 200) == 15  # 0.52 * 4 * 15 / 64 = 48.75% fits; 16 would be 52%


def test_a_size_change_cuts_no_lower_than_the_smallest_multiple_in_range():
    """min_batch 10, multiple_of 8: 16 is the smallest size in steps of 8; a batch that does not fit even
    there is cut to 16 and stays there (recorded as the shrink it is)."""
    c = _sized([0.8], 32, 160, min_batch=10)
    c.begin_epoch()
    c.end_epoch(0)
    assert c.batch_size == 32
    assert c.set_pixels(320 * 320) == 16  # 4x the pixels: 160% predicted at 16
    assert c.batch_size == 16 and c.history[-1]["next_batch_size"] == 16
    assert c.set_pixels(640 * 640) == 16  # still over, and no smaller size to go to


def test_the_first_size_told_or_the_same_size_again_never_cuts():
    """Readings taken before any size was told (84% at 256, over 80%) are at the reference size: telling
    that size, or the same size again, cuts nothing."""
    c = BatchSizeController(8, 512, probe=ScriptedProbe([0.84]), release=None)
    c.attach(256)
    c.begin_epoch()
    c.end_epoch(0)
    assert c.batch_size == 256
    assert c.set_pixels(160 * 160) == 256 and c.set_pixels(160 * 160) == 256
    assert c.batch_size == 256 and len(c.history) == 1


def test_one_pixel_is_a_size_and_a_size_that_is_not_a_square_is_named_in_pixels():
    c = _sized([0.5], 64, 100, target_fraction=0.75, hysteresis=0.25)
    assert c.set_pixels(1) == 64  # nothing measured yet at any size
    c = _sized([0.5], 64, 100, target_fraction=0.75, hysteresis=0.25)
    c.begin_epoch()
    c.end_epoch(0)
    assert c.set_pixels(20000) == 32  # 2x the pixels: 100% predicted at 64, 50% at 32
    assert c.history[-1]["reason"] == "image size 10000 → 20000 pixels: predicted 100% at 64 > 50%"
    c.set_pixels(22500)  # 150 x 150 after a size that is not a square: in pixels too
    assert c.history[-1]["reason"].startswith("image size 20000 → 22500 pixels: ")
