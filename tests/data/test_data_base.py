"""The reads with their checks, the shared reader threads, the optional reader members, subsets."""

import numpy as np
import pytest
from builders import IndexReader, jpeg_bytes, make_folder

from dali_fast.data.base import (
    ON_ERROR,
    BatchReader,
    FingerprintedReader,
    LabelledReader,
    StreamingReader,
    check_labels,
    check_on_error,
    fingerprint,
    provides,
    split,
)
from dali_fast.data.folder import ImageFolderReader


def test_labels_outside_the_classes_are_bad_records():
    from dali_fast.data.base import (
        read_checked,
    )

    class Labelled:
        classes = ["a", "b"]

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.frombuffer(jpeg_bytes(), np.uint8), [0, 2, -1][i]

        def source(self, i):
            return f"mem://{i}"

    r = Labelled()
    assert read_checked(r, 0)[2] is None
    assert read_checked(r, 1)[2] == "label 2 is not one of the data set's 2 classes (0..1)"
    assert read_checked(r, 2)[2] == "label -1 is not one of the data set's 2 classes (0..1)"


def test_batch_read_of_a_reader_without_one_checks_record_by_record():
    from builders import IndexReader

    from dali_fast.data.base import read_batch_checked, read_checked

    good = jpeg_bytes(32, 24)
    reader = IndexReader([good, good[:100], b"", good], classes=3)  # label 3 is outside the 3 classes
    datas, labels, bad = read_batch_checked(reader, np.array([3, 1, 0, 2]))
    assert labels.dtype == np.int64 and labels.tolist() == [3, 1, 0, 2]
    assert [bytes(d) for d in datas] == [good, good[:100], good, b""]
    assert bad == {0: read_checked(reader, 3)[2], 1: read_checked(reader, 1)[2], 3: "empty record"}
    assert bad[0].startswith("label 3 is not one") and bad[1].startswith("truncated JPEG")


def test_the_read_pool_serves_a_forked_child(tmp_path):
    """A forked child (a DataLoader worker) inherits the pool object but not its threads: it gets its own."""
    import multiprocessing

    images = [jpeg_bytes(20 + k, 20) for k in range(12)]
    reader = ImageFolderReader(make_folder(tmp_path / "imgs", {"a": images}))
    assert [bytes(d) for d in reader.read_batch_checked(range(12))[0]] == images  # the parent's pool now runs
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=lambda: queue.put([bytes(d) for d in reader.read_batch_checked(range(12))[0]]))
    child.start()
    try:
        assert queue.get(timeout=60) == images
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_read_threads_do_not_grow_with_readers_or_batches(tmp_path):
    import threading

    from dali_fast.data.base import READ_THREADS

    images = [jpeg_bytes(20 + k, 20) for k in range(40)]
    root = make_folder(tmp_path / "imgs", {"a": images})

    def others() -> int:  # threads other than the shared pool's
        return sum(not t.name.startswith("dali_fast-read") for t in threading.enumerate())

    ImageFolderReader(root).read_batch_checked(range(40))
    before = others()
    for _ in range(10):
        reader = ImageFolderReader(root)
        for start in range(0, 40, 8):
            reader.read_batch_checked(range(start, start + 8))
    names = [t.name for t in threading.enumerate() if t.name.startswith("dali_fast-read")]
    # The pool starts its threads as work comes, up to READ_THREADS for the process, whatever the readers.
    assert others() == before and 1 <= len(names) <= READ_THREADS


def test_split_disjoint_and_complete():
    reader = IndexReader([b"x"] * 120)
    a, b = split(reader, 0.25)
    assert len(b) == 30 and sorted(list(a.indices) + list(b.indices)) == list(range(120))
    assert a.labels.tolist() == a.indices.tolist() and b.source(0) == f"mem://{b.indices[0]}.jpg"
    assert [x.indices.tolist() for x in split(reader, 0.25)] == [a.indices.tolist(), b.indices.tolist()]  # seeded


def test_labels_are_checked_once_where_they_come_from():
    check_labels(IndexReader([b"x"] * 6), 6)  # every label in 0..5
    reader = IndexReader([jpeg_bytes() for _ in range(6)], classes=4)  # labels 0..5 (the index), 4 classes
    with pytest.raises(ValueError) as e:
        check_labels(reader, 4)
    assert str(e.value) == (
        "record 4 (mem://4.jpg) has label 4, outside 0..3 (4 classes); 2 records in all: "
        "fix the labels or the class list and pack again"
    )

    class Unlabelled:
        classes = ["a"]

        def __len__(self):
            return 1

    check_labels(Unlabelled(), 1)  # no label column: nothing to check here (each record is checked as read)
    check_labels(split(Unlabelled(), 0.5)[0], 1)  # nor through a subset of it


def test_optional_members_are_found_without_running_them():
    class Lazy:
        classes = ["a"]
        reads = 0

        @property
        def fingerprint(self):
            Lazy.reads += 1
            return "lazy:1"

        def read_batch_checked(self, indices):
            return [], np.empty(0, np.int64), {}

    assert provides(Lazy(), FingerprintedReader) and provides(Lazy(), BatchReader) and Lazy.reads == 0
    assert not provides(Lazy(), LabelledReader) and not provides(Lazy(), StreamingReader)
    assert not provides(IndexReader([b"x"]), BatchReader) and provides(IndexReader([b"x"]), LabelledReader)
    assert fingerprint(Lazy()) == "lazy:1" and Lazy.reads == 1
    assert fingerprint(IndexReader([b"x"] * 3)) == "IndexReader:3"  # no fingerprint: the kind and size


def test_on_error_is_one_of_two_words():
    assert ON_ERROR == ("raise", "skip") and check_on_error("skip") == "skip"
    with pytest.raises(ValueError, match=r"^on_error='ignore': use 'raise' or 'skip'$"):
        check_on_error("ignore")


def test_a_failed_parallel_read_returns_only_after_every_read_has_finished():
    """The first run's error is raised once the other runs are done, not while they still hold files."""
    import time

    from dali_fast.data.base import READ_THREADS, read_parallel

    finished = []

    def read(x: int) -> int:
        if x == 0:
            raise FileNotFoundError("gone")
        time.sleep(0.05)
        finished.append(x)
        return x

    items = list(range(2 * READ_THREADS))
    with pytest.raises(FileNotFoundError):
        read_parallel(read, items)
    assert sorted(finished) == [x for x in items if x >= 2]  # run 0 (items 0, 1) stopped at its error
