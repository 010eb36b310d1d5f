"""Bad records on every backend: `on_error='raise'` names the record, `'skip'` counts and names each
once and delivers every good image once."""

from __future__ import annotations

import logging

import numpy as np
import odd_images
import pytest
from builders import IndexReader, jpeg_bytes
from loader_cases import bad_reader, epoch_labels


def test_bad_record_raise_names_it(make):
    loader = make(bad_reader(), 4, train=False)
    with pytest.raises(ValueError) as e:
        epoch_labels(loader, 0)
    msg = str(e.value)
    assert "record 2 (mem://2.jpg)" in msg and "truncated JPEG" in msg and "on_error='skip'" in msg


def test_bad_records_skip_counts_and_logs_once(make, caplog):
    loader = make(bad_reader(), 4, train=True, on_error="skip")
    with caplog.at_level(logging.WARNING):
        for epoch in range(2):
            labels, _ = epoch_labels(loader, epoch)
            assert sorted(labels) == [0, 1, 3, 4, 6, 8, 9]
    assert loader.skipped == 6  # 3 per epoch
    for i in (2, 5, 7):
        assert sum(f"record {i} " in r.getMessage() for r in caplog.records) == 1


def test_all_bad_batch_is_skipped_whole(make):
    reader = bad_reader()
    loader = make(reader, 1, train=False, on_error="skip")
    labels, sizes = epoch_labels(loader, 0)
    assert labels == [0, 1, 3, 4, 6, 8, 9] and set(sizes) == {1}


def test_record_that_passes_the_check_but_fails_to_decode_is_named(make):
    good = odd_images.good_jpeg()
    sneaky = odd_images.corrupt()["bogus_huffman_table_jpeg"]
    reader = IndexReader([good, sneaky, good, good, good])
    loader = make(reader, 2, train=False)
    with pytest.raises((RuntimeError, ValueError)) as e:
        epoch_labels(loader, 0)
    msg = str(e.value)
    assert "record 1 (mem://1.jpg)" in msg and "\n" not in msg
    assert "mem://0.jpg" not in msg  # the good record decoded with it is not a suspect
    assert "on_error='skip'" in msg
    skipping = make(reader, 2, train=False, on_error="skip")  # the same records in skip mode go through
    assert epoch_labels(skipping, 0)[0] == [0, 2, 3, 4] and skipping.skipped == 1


@pytest.mark.parametrize("train", [True, False])
def test_skip_mode_over_every_corrupt_kind(make, train, caplog):
    """Every good image exactly once, every bad one counted and named once, in both loaders."""
    bad = odd_images.corrupt()
    items, good_ids, names = [], [], {}
    for k, (name, data) in enumerate(bad.items()):
        items += [odd_images.good_jpeg(), data]
        good_ids.append(2 * k)
        names[2 * k + 1] = name
    items.append(odd_images.good_jpeg())
    good_ids.append(len(items) - 1)
    reader = IndexReader(items)
    loader = make(reader, 4, train=train, on_error="skip")
    with caplog.at_level(logging.WARNING):
        for epoch in range(2):
            labels, _ = epoch_labels(loader, epoch)
            assert sorted(labels) == good_ids, f"epoch {epoch}"
    assert loader.skipped == 2 * len(bad)
    assert not any("BytesIO" in r.getMessage() for r in caplog.records)  # the record is named, not a buffer
    for index in names:
        assert sum(f"record {index} " in r.getMessage() for r in caplog.records) == 1, names[index]


def test_unreadable_files_in_a_folder_are_bad_records(make, tmp_path):
    from dali_fast.data.folder import ImageFolderReader

    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    for k in range(6):
        (root / "a" / f"{k}.jpg").write_bytes(jpeg_bytes(32, 24))
    (root / "a" / "1.jpg").unlink()
    (root / "a" / "1.jpg").symlink_to(root / "gone.jpg")  # a broken symlink
    reader = ImageFolderReader(root)
    assert len(reader) == 6
    (root / "a" / "3.jpg").unlink()  # a file that vanished after the listing
    with pytest.raises(ValueError) as e:
        epoch_labels(make(reader, 3, train=False), 0)
    assert f"record 1 ({root / 'a' / '1.jpg'}): unreadable: No such file or directory" in str(e.value)
    loader = make(reader, 3, train=False, on_error="skip")
    labels, sizes = epoch_labels(loader, 0)
    assert sizes == [2, 2] and loader.skipped == 2


def test_a_skipped_record_is_counted_each_time_and_logged_once(caplog):
    from dali_fast.loaders.bad_records import SkipLog

    skips = SkipLog()
    with caplog.at_level(logging.WARNING, logger="dali_fast.loaders.bad_records"):
        for _ in range(2):
            skips.add(3, "mem://3.jpg", "not an image")
    assert skips.count == 2
    assert [r.getMessage() for r in caplog.records] == ["skipping record 3 (mem://3.jpg): not an image"]
    # each skip is held until the batch it came from is yielded, a backend working ahead or not
    assert skips.yielded(np.array([1, 3, 5]), 2).tolist() == [1, 5] and skips.yielded(np.array([3, 7]), 1).tolist() == [7]
    assert skips.yielded(np.array([3, 9]), 2).tolist() == [3, 9] and not skips.pending  # none held: none left out


def test_a_bad_record_message_names_the_record_and_both_ways_out(index_reader):
    from dali_fast.loaders.bad_records import bad_record_message

    assert bad_record_message(index_reader, 4, "not an image") == (
        "record 4 (mem://4.jpg): not an image; remove or re-pack it, "
        "or skip bad records with on_error='skip' (dali-fast: --on-error skip)"
    )


def test_a_yielded_batch_gives_back_only_as_many_skips_as_rows_it_lacks():
    """Two skips are held, the batch lacks one row: only the first held index in it is taken out; a batch
    that lacks none keeps a held index it happens to hold (a padding repeat of a skipped record)."""
    from dali_fast.loaders.bad_records import SkipLog

    skips = SkipLog()
    skips.add(2, "mem://2.jpg", "not an image")
    skips.add(4, "mem://4.jpg", "not an image")
    assert skips.yielded(np.array([1, 2, 4]), 3).tolist() == [1, 2, 4]  # nothing missing: nothing taken
    assert skips.yielded(np.array([1, 2, 4]), 2).tolist() == [1, 4]
    assert dict(skips.pending) == {4: 1}
    assert skips.yielded(np.array([4, 6]), 1).tolist() == [6] and not skips.pending
