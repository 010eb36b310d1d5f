"""What a loader raises and counts for a record it cannot decode."""

import logging


def test_a_skipped_record_is_counted_each_time_and_logged_once(caplog):
    from dali_fast.loaders.bad_records import SkipLog

    skips = SkipLog()
    with caplog.at_level(logging.WARNING, logger="dali_fast.loaders.bad_records"):
        for _ in range(2):
            skips.add(3, "mem://3.jpg", "not an image")
    assert skips.count == 2
    assert [r.getMessage() for r in caplog.records] == ["skipping record 3 (mem://3.jpg): not an image"]


def test_a_bad_record_message_names_the_record_and_both_ways_out(index_reader):
    from dali_fast.loaders.bad_records import bad_record_message

    assert bad_record_message(index_reader, 4, "not an image") == (
        "record 4 (mem://4.jpg): not an image; remove or re-pack it, "
        "or skip bad records with on_error='skip' (dali-fast: --on-error skip)"
    )
