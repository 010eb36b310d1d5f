"""Progressive resizing on every backend: each epoch at the schedule's size, exactly once, one build per
size; resume inside the ramp; the controller never passes its target as the size grows."""

from __future__ import annotations

import pytest
from builders import one_line
from contract import each_once
from loader_cases import epoch_labels, take_then_save


def _builds(loader):
    """Pipelines (DALI) or batch rings with their worker pools (torch) made so far."""
    return loader.pipelines_built if hasattr(loader, "pipelines_built") else loader.pools_started


def test_progressive_size_follows_the_schedule_exactly_once_one_build_per_size(make, index_reader):
    from dali_fast import Progressive, Recipe

    ramp = Progressive(16, 32, start_epoch=1, end_epoch=3, step=8)
    loader = make(index_reader, 8, recipe=Recipe(image_size=40, resolution=ramp), image_size=None)
    sizes, builds = [], []
    for epoch in range(6):
        loader.set_epoch(epoch)
        assert loader.image_size == ramp(epoch)
        shapes, labels = set(), []
        for images, y in loader:
            shapes.add(tuple(images.shape[1:]))
            labels += y.tolist()
        each_once(labels, range(37), what=f"epoch {epoch} at {ramp(epoch)} px")
        assert len(shapes) == 1
        sizes.append(shapes.pop()[-1])
        builds.append(_builds(loader))
    assert sizes == [16, 16, 24, 32, 32, 32]
    # one build per distinct size, none in an epoch whose size did not change
    assert builds == [1, 1, 2, 3, 3, 3]
    # evaluation keeps its own size (image_size), whatever the epoch
    val = make(index_reader, 8, recipe=Recipe(image_size=40, resolution=ramp), image_size=None, train=False)
    val.set_epoch(4)
    assert {tuple(x.shape[1:]) for x, _ in val} == {(3, 40, 40)}


def test_progressive_any_function_of_the_epoch(make, index_reader):
    from dali_fast import Recipe

    def steps(epoch):
        return 16 if epoch < 2 else 24

    loader = make(index_reader, 16, recipe=Recipe(image_size=24, resolution=steps), image_size=None)
    seen = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        seen.append({x.shape[-1] for x, _ in loader})
    assert seen == [{16}, {16}, {24}, {24}] and _builds(loader) == 2
    with pytest.raises(ValueError, match=r"gave 0.5 for epoch 0: it must give a positive integer"):
        make(index_reader, 16, recipe=Recipe(resolution=lambda e: 0.5), image_size=None)


def test_progressive_resume_inside_the_ramp(make, index_reader):
    """A state taken mid-epoch inside the ramp resumes at the same size, each sample once; a loader with
    another schedule (or none) refuses it in one line."""
    from dali_fast import Progressive, Recipe

    recipe = Recipe(image_size=32, resolution=Progressive(16, 32, 1, 3, step=8))
    loader = make(index_reader, 5, seed=3, recipe=recipe, image_size=None)
    loader.set_epoch(2)
    seen, state = take_then_save(loader, 3)
    assert state["image_size"] == 24
    resumed = make(index_reader, 5, seed=3, recipe=recipe, image_size=None)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    assert resumed.image_size == 24
    rest, shapes = [], set()
    for images, labels in resumed:
        rest += labels.tolist()
        shapes.add(images.shape[-1])
    each_once(seen + rest, range(37), what="the resumed epoch")
    assert shapes == {24}
    reference = make(index_reader, 5, seed=3, recipe=recipe, image_size=None)
    assert seen + rest == epoch_labels(reference, 2)[0]
    # the next epoch is at the next size
    resumed.set_epoch(3)
    assert {x.shape[-1] for x, _ in resumed} == {32}
    other = make(
        index_reader, 5, seed=3, recipe=recipe.with_(resolution=Progressive(16, 32, 1, 4, step=8)), image_size=None
    )
    with pytest.raises(ValueError) as e:
        other.load_state_dict(state)
    assert one_line(e) == (
        "cannot resume: the state was saved with resolution schedule 16:32:1:3:8, this loader has "
        "16:32:1:4:8; resume with the recipe it was saved with"
    )
    fixed = make(index_reader, 5, seed=3, image_size=32)
    with pytest.raises(ValueError, match=r"saved with resolution schedule 16:32:1:3:8, this loader has none"):
        fixed.load_state_dict(state)


class PixelProbe:
    """A fake device whose need grows with the pixels of a batch, as a caching allocator's does: the
    epoch's peak is ``fixed`` plus ``per_pixel`` times the batch size the loader was built for times the
    pixels per image of the largest batch delivered."""

    def __init__(self, loader_ref, fixed, per_pixel):
        self.loader_ref, self.fixed, self.per_pixel = loader_ref, fixed, per_pixel
        self.pixels = 0
        self.readings = []

    def saw(self, images):
        self.pixels = max(self.pixels, images.shape[-1] * images.shape[-2])

    def reset_peak(self):
        self.pixels = 0

    def peak_fraction(self):
        need = self.fixed + self.per_pixel * self.loader_ref[0].batch_size * self.pixels
        self.readings.append((self.loader_ref[0].batch_size, self.pixels, need))
        return need


def test_progressive_controller_never_passes_the_target(make, index_reader):
    """The ramp 160 → 224 at batch 512: a batch size fine at 160 px would need 128% at 224 px; the
    controller scales its prediction by the pixel ratio and cuts the batch before each larger size."""
    from dali_fast import BatchSizeController, Progressive, Recipe

    ref = [None]
    probe = PixelProbe(ref, fixed=0.10, per_pixel=0.60 / (512 * 160 * 160))  # 70% at batch 512, 160 px
    ctrl = BatchSizeController(64, 512, target_fraction=0.85, probe=probe, release=None)
    recipe = Recipe(image_size=224, resolution=Progressive(160, 224, start_epoch=1, end_epoch=3))
    loader = ref[0] = make(index_reader, 512, recipe=recipe, image_size=None, controller=ctrl)
    for epoch in range(5):
        loader.set_epoch(epoch)
        labels = []
        for images, y in loader:
            probe.saw(images)
            labels += y.tolist()
        each_once(labels, range(37), what=f"epoch {epoch}")
    sides = [round(p**0.5) for _, p, _ in probe.readings]
    assert sides == [160, 160, 192, 224, 224]
    needs = [need for _, _, need in probe.readings]
    assert max(needs) <= 0.85, probe.readings
    assert probe.readings[0][0] == 512 and probe.readings[-1][0] < 512  # it did cut, and only as needed
    assert needs[-1] > 0.6  # not starved: the last size still uses most of the target
