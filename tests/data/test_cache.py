import threading

import numpy as np
import pytest

from dali_fast.data.cache import CachedReader, LRUCache


def test_lru_order_and_evictions():
    c = LRUCache(10)
    assert c.put("a", 1, 4) and c.put("b", 2, 4)
    assert c.get("a") == 1  # a is now most recent
    c.put("c", 3, 4)  # evicts b
    assert c.keys() == ["a", "c"]
    assert c.get("b") is None
    s = c.stats()
    assert s == {"hits": 1, "misses": 1, "hit_rate": 0.5, "evictions": 1, "bytes": 8}


def test_budget_never_exceeded_and_oversize_passes_through():
    c = LRUCache(100)
    rng = np.random.default_rng(0)
    for i in range(500):
        size = int(rng.integers(1, 150))
        ok = c.put(i, i, size)
        assert ok == (size <= 100)
        assert c.bytes <= 100
        assert sum(size for _, size in c._items.values()) == c.bytes
    assert c.put("huge", 0, 101) is False and "huge" not in c


def test_replace_same_key_counts_bytes_once():
    c = LRUCache(10)
    c.put("a", 1, 6)
    c.put("a", 2, 7)
    assert c.bytes == 7 and c.get("a") == 2 and c.stats()["evictions"] == 0


def test_zero_budget_and_bad_budget():
    c = LRUCache(0)
    assert not c.put("a", 1, 1)
    assert c.stats()["hit_rate"] == 0.0
    with pytest.raises(ValueError, match="max_bytes"):
        LRUCache(-1)


def test_thread_safety():
    c = LRUCache(1000)

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(2000):
            k = int(rng.integers(0, 200))
            if c.get(k) is None:
                c.put(k, k, int(rng.integers(1, 30)))

    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    s = c.stats()
    assert s["hits"] + s["misses"] == 8000
    assert c.bytes <= 1000 and c.bytes == sum(v[1] for v in c._items.values())


class ListReader:
    classes = ["x"]

    def __init__(self, items):
        self.items = items
        self.reads = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.reads += 1
        return np.frombuffer(self.items[i], np.uint8), i

    def source(self, i):
        return f"item{i}"


def test_cached_reader_hits_and_copies():
    base = ListReader([bytes([i]) * 10 for i in range(5)])
    r = CachedReader(base, LRUCache(30))
    for _ in range(2):
        for i in range(3):
            d, lab = r[i]
            assert bytes(d) == bytes([i]) * 10 and lab == i
    assert base.reads == 3
    assert r.cache.stats()["hits"] == 3 and r.cache.stats()["misses"] == 3
    r[3]  # evicts 0
    assert 0 not in r.cache and r.cache.bytes == 30
    views, labels = r.read_batch([4, 1])
    assert [bytes(v) for v in views] == [bytes([4]) * 10, bytes([1]) * 10] and labels.tolist() == [4, 1]
    assert r.source(2) == "item2" and len(r) == 5


def test_cached_values_are_private_copies_not_views_of_the_file(tmp_path):
    """A hit must not depend on the memory map: the cache holds its own bytes."""
    from builders import jpeg_bytes, make_folder

    from dali_fast.data.format import DATA_FILE
    from dali_fast.data.pack.packed import pack
    from dali_fast.data.packed import MemmapReader

    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(40, 30), jpeg_bytes(30, 40)]})
    pack(src, tmp_path / "p", progress=False)
    reader = MemmapReader(tmp_path / "p")
    original = bytes(reader[1][0])
    cached = CachedReader(reader, LRUCache(10**6))
    first, _ = cached[1]
    assert not np.shares_memory(first, reader.data)
    with open(tmp_path / "p" / DATA_FILE, "r+b") as f:  # the file changes under the map
        f.write(b"\0" * reader.data_size)
    assert bytes(reader[1][0]) != original  # the map sees the change...
    hit, _ = cached[1]
    assert bytes(hit) == original and cached.cache.stats()["hits"] == 1  # ...the cached copy does not


def test_evictions_counted_each_and_classes_passed_through():
    c = LRUCache(10)
    for k in range(6):
        c.put(k, b"x" * 5, 5)
    assert c.stats() == {"hits": 0, "misses": 0, "hit_rate": 0.0, "evictions": 4, "bytes": 10}
    assert c.keys() == [4, 5]
    base = ListReader([b"a"])
    base.classes = ["only"]
    assert CachedReader(base, LRUCache(10)).classes == ["only"]


def test_clear_and_reset_stats():
    c = LRUCache(100)
    c.put("a", b"x", 10)
    c.get("a")
    c.get("b")
    c.reset_stats()
    assert c.stats() == {"hits": 0, "misses": 0, "hit_rate": 0.0, "evictions": 0, "bytes": 10}
    c.clear()
    assert len(c) == 0 and c.bytes == 0 and c.get("a") is None and c.stats()["misses"] == 1


def test_get_many_counts_each_key_and_refreshes_the_hits():
    c = LRUCache(12)
    for k in "abc":
        c.put(k, k.upper(), 4)
    assert c.get_many(["a", "x", "c", "a"]) == ["A", None, "C", "A"]
    assert c.stats() == {"hits": 3, "misses": 1, "hit_rate": 0.75, "evictions": 0, "bytes": 12}
    assert c.get_many(["y", "b"]) == [None, "B"] and c.get("a") == "A"
    assert c.stats() == {"hits": 5, "misses": 2, "hit_rate": 5 / 7, "evictions": 0, "bytes": 12}
    c.put("d", "D", 4)  # evicts c: b and a were used since
    assert c.keys() == ["b", "a", "d"] and c.get_many([]) == []


class BatchReader(ListReader):
    """A ListReader with batch reads that records what it was asked for (labels: the index; 3 classes)."""

    classes = ["x", "y", "z"]

    def __init__(self, items):
        super().__init__(items)
        self.batches = []

    def read_batch_checked(self, indices):
        from dali_fast.data.checks import check_encoded

        self.batches.append(list(indices))
        datas = [np.frombuffer(self.items[i], np.uint8) for i in indices]
        bad = {p: why for p, d in enumerate(datas) if (why := check_encoded(d)) is not None}
        return datas, np.asarray(indices, dtype=np.int64), bad


def test_cached_batch_reads_check_once_and_never_cache_a_bad_record():
    from builders import jpeg_bytes

    good = [jpeg_bytes(30 + k, 20) for k in range(3)]
    base = BatchReader([good[0], b"not an image", good[1], good[2]])
    r = CachedReader(base, LRUCache(10**6))
    datas, labels, bad = r.read_batch_checked(np.array([2, 1, 0, 2]))
    assert base.batches == [[2, 1, 0, 2]]  # the misses, read as one batch by the reader
    assert bad == {1: "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)"} and labels.tolist() == [2, 1, 0, 2]
    assert [bytes(d) for d in datas] == [good[1], b"not an image", good[0], good[1]]
    assert sorted(r.cache.keys()) == [0, 2] and r.cache.stats()["misses"] == 4
    datas, labels, bad = r.read_batch_checked([0, 1, 3, 2])
    assert base.batches[1:] == [[1, 3]]  # hits are not read again; the bad record is, and named again
    assert bad == {1: "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)"} and labels.tolist() == [0, 1, 3, 2]
    assert [bytes(d) for d in datas] == [good[0], b"not an image", good[2], good[1]]
    assert r.cache.stats()["hits"] == 2
    sources = [np.frombuffer(x, np.uint8) for x in base.items]
    assert not any(np.shares_memory(datas[p], sources[i]) for p, i in ((0, 0), (2, 3), (3, 2)))  # private copies
    empty = r.read_batch_checked([])
    assert empty[0] == [] and empty[1].dtype == np.int64 and len(empty[1]) == 0 and empty[2] == {}


def test_a_record_cached_by_plain_indexing_is_checked_before_a_batch_serves_it():
    """``reader[i]`` (the torch path) caches what it reads unchecked; the batch path checks it first."""
    base = BatchReader([b"not an image", b"\xff\xd8\xffrest"])
    r = CachedReader(base, LRUCache(10**6))
    r[0], r[1]
    _, _, bad = r.read_batch_checked([1, 0])
    assert base.batches == [[1, 0]]
    assert bad == {0: "truncated JPEG (ends inside its headers)", 1: "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)"}
