"""Multi-hot and float targets from every source (labels.csv beside an ImageFolder, WebDataset .json lists and
{"labels": [...]} objects, local and remote, packs of either) through both loaders and the baseline: each
row is what was written for its sample, a bad index is a bad record (raised or skipped, never clipped), and
resume stays exact."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from builders import jpeg_bytes, make_folder, one_line
from contract import run_save_load_state
from target_sets import (
    SOURCES,
    K,
    N,
    check_rows,
    loader_class,
    make_source,
    row,
    sample_of,
    write_folder,
    write_shards,
    written,
)

from dali_fast import open_dataset, pack
from dali_fast.data.folder import read_labels_csv
from dali_fast.data.targets import ListTargets, SubsetTargets, attach_targets, check_target, target_spec
from dali_fast.loaders.bad_records import BadRecordError


@pytest.mark.parametrize("backend", ["torch", "dali"])
@pytest.mark.parametrize("kind", ["multihot", "float"])
@pytest.mark.parametrize("source", SOURCES)
def test_each_row_is_what_was_written_for_its_sample(tmp_path, cache, source, kind, backend):
    path, opened = make_source(tmp_path, source, kind)
    reader = open_dataset(path, **opened)
    assert reader.target_kind == kind and target_spec(reader) == (kind, K if kind == "multihot" else 3)
    extra = {"num_workers": 1} if backend == "torch" else {}  # a worker process: indices cross the boundary
    loader = loader_class(backend)(reader, 4, train=True, image_size=16, device="cpu", seed=3, **extra)
    seen = []
    for images, targets in loader:
        assert images.shape[0] == targets.shape[0]
        seen += check_rows(reader, loader, targets, kind)
    assert sorted(seen) == list(range(N)) and seen != sorted(seen)  # every sample once, shuffled


def test_the_baseline_yields_the_rows_too(tmp_path):
    from dali_fast.loaders.baseline import make_baseline_loader

    reader = open_dataset(write_folder(tmp_path / "src", "multihot"), target="multihot", num_classes=K)
    got = [t for _, t in make_baseline_loader(reader, 4, train=False, image_size=16, num_workers=0)]
    expected = np.stack([row(sample_of(reader.source(i)), "multihot") for i in range(N)])
    assert all(t.dtype == torch.float32 for t in got)
    np.testing.assert_array_equal(torch.cat(got).numpy(), expected)


def test_a_reader_that_says_nothing_of_targets_yields_its_labels(index_reader):
    loader = loader_class("torch")(index_reader, 8, train=False, image_size=16, num_workers=0)
    assert target_spec(index_reader) == ("class", 37)
    labels = torch.cat([y for _, y in loader])
    assert labels.dtype == torch.int64 and labels.tolist() == list(range(37))


def test_class_targets_stay_the_default_and_labels_csv_is_read_only_when_asked(tmp_path):
    root = write_folder(tmp_path / "src", "multihot")
    reader = open_dataset(root)
    assert reader.target_kind == "class" and reader.targets is None and target_spec(reader) == ("class", 2)
    loader = loader_class("torch")(reader, 4, train=False, image_size=16, num_workers=0)
    labels = torch.cat([y for _, y in loader])
    assert labels.dtype == torch.int64 and labels.tolist() == [0] * 7 + [1] * 6


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_resume_stays_exact_with_targets(tmp_path, backend):
    path, _ = make_source(tmp_path, "packed-folder", "multihot")
    reader = open_dataset(path)

    def make():
        extra = {"num_workers": 0} if backend == "torch" else {}
        return loader_class(backend)(reader, 3, train=True, image_size=16, device="cpu", seed=5, **extra)

    run_save_load_state(make, 2, ids=lambda loader, batch: check_rows(reader, loader, batch[1], "multihot"))


@pytest.mark.parametrize("backend", ["torch", "dali"])
@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_an_index_outside_the_classes_is_raised_or_skipped_never_clipped(tmp_path, backend, cache_bytes):
    root = write_folder(tmp_path / "src", "multihot", lists={2: [1, 5], 4: [-1], 9: [2.5]})
    reader = open_dataset(root, target="multihot", num_classes=K)
    assert reader.targets.bad == {
        2: "class index 5 is outside 0..4 (num_classes=5)",
        4: "class index -1 is outside 0..4 (num_classes=5)",
        9: "class index 2.5 is not a whole number",
    }
    with pytest.raises(ValueError) as e:
        reader.targets.rows([0, 2])  # a bad record has no row: nothing is clipped into one
    assert one_line(e) == "record 2: class index 5 is outside 0..4 (num_classes=5); it has no target row"
    cls = loader_class(backend)
    extra = {"num_workers": 0} if backend == "torch" else {}
    kw = {"train": False, "image_size": 16, "device": "cpu", "cache_bytes": cache_bytes, **extra}
    with pytest.raises(BadRecordError) as e:
        list(cls(reader, 4, on_error="raise", **kw))
    assert one_line(e) == (
        f"record 2 ({root / 'a' / 'img02.jpg'}): class index 5 is outside 0..4 (num_classes=5); remove or re-pack it, "
        "or skip bad records with on_error='skip' (dali-fast: --on-error skip)"
    )
    skipping = cls(reader, 4, on_error="skip", **kw)
    seen = [i for _, t in skipping for i in check_rows(reader, skipping, t, "multihot", reader.targets.bad)]
    assert seen == [0, 1, 3, 5, 6, 7, 8, 10, 11, 12] and skipping.skipped == 3


def test_a_bad_index_in_a_json_list_and_a_pack_that_leaves_it_out(tmp_path, cache, caplog):
    shards = write_shards(tmp_path / "shards", "multihot", "list", lists={5: [0, 7]})
    with caplog.at_level("WARNING"):
        reader = open_dataset(shards, target="multihot", num_classes=K)
    assert reader.targets.bad == {5: "class index 7 is outside 0..4 (num_classes=5)"}
    assert caplog.records[-1].getMessage() == (
        f"1 record with a bad target (first: record 5 ({reader.source(5)}): class index 7 is outside 0..4 "
        "(num_classes=5)); the loaders raise naming it (on_error='raise') or skip and count it (on_error='skip')"
    )
    report = pack(shards, tmp_path / "p", target="multihot", num_classes=K, progress=False)
    assert report.records == N - 1 and report.skipped == [
        (reader.source(5), "class index 7 is outside 0..4 (num_classes=5)")
    ]
    packed = open_dataset(tmp_path / "p")
    assert [sample_of(packed.source(i)) for i in range(len(packed))] == [i for i in range(N) if i != 5]


def test_json_samples_without_a_target_list_are_left_out_and_named(tmp_path, cache):
    wds = pytest.importorskip("webdataset")
    root = tmp_path / "shards"
    root.mkdir()
    docs = {0: b"[1, 2]", 1: b'{"label": 3}', 2: b'["cat"]', 3: b"[true]", 4: None, 5: b'{"labels": [0]}', 6: b"[1"}
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i, doc in docs.items():
            sink.write(
                {"__key__": f"img{i:02d}", "jpg": jpeg_bytes(20, 20), **({"json": doc} if doc else {"cls": b"1"})}
            )
    reader = open_dataset(root, target="multihot", num_classes=K)
    assert [sample_of(reader.source(i)) for i in range(len(reader))] == [0, 5]
    assert reader.labels.tolist() == [0, 0]  # no .cls: the label is 0
    shard = root / "a.tar"
    assert reader.skipped[:4] == [
        (f"{shard}:img01", "its .json is neither a list nor an object with a 'labels' list"),
        (f"{shard}:img02", "its .json target list holds 'cat', not a number"),
        (f"{shard}:img03", "its .json target list holds True, not a number"),
        (f"{shard}:img04", "no .json member with its target list (a list, or an object with a 'labels' list)"),
    ]
    assert reader.skipped[4][0] == f"{shard}:img06" and reader.skipped[4][1].startswith("unreadable .json (")
    with pytest.raises(ValueError) as e:
        open_dataset(root, target="multihot", num_classes=K, on_error="raise")
    assert one_line(e) == (
        f"{shard}:img01: its .json is neither a list nor an object with a 'labels' list; fix the shard, or open it "
        "with on_error='skip'"
    )
    cls = open_dataset(root, target="class")  # the class index as before: a "label" or a .cls
    assert [sample_of(cls.source(i)) for i in range(len(cls))] == [1, 4] and cls.labels.tolist() == [3, 1]


def test_the_object_shape_keeps_the_cls_label_and_lists_are_indexed_apart(tmp_path, cache):
    shards = write_shards(tmp_path / "shards", "multihot", "object")
    lists = open_dataset(shards, target="multihot", num_classes=K)
    assert lists.labels.tolist() == [i % 3 for i in range(N)] and lists.classes == ["0", "1", "2"]
    saved = sorted((cache / "wds-index").iterdir())
    with pytest.raises(ValueError, match=r"^record 0 \(.*img00.jpg\) has 0 target numbers, most records have 2 "):
        open_dataset(shards, target="float")  # the same saved index: the lists do not depend on the kind
    assert sorted((cache / "wds-index").iterdir()) == saved == [lists.index_file]
    assert open_dataset(shards).index_file != lists.index_file  # class targets: indexed without the lists
    np.testing.assert_array_equal(lists.target_lists[1], np.cumsum([len(written(i, "multihot")) for i in range(N)]))


def test_float_lists_of_another_length_are_named_in_one_line(tmp_path, cache):
    root = write_folder(tmp_path / "src", "float", lists={6: [1.0, 2.0]})
    with pytest.raises(ValueError) as e:
        open_dataset(root, target="float")
    assert one_line(e) == (
        f"record 6 ({root / 'a' / 'img06.jpg'}) has 2 target numbers, most records have 3 (1 record differ): float "
        "targets need the same count for every sample; fix its list"
    )
    reader = open_dataset(write_folder(tmp_path / "nan", "float", lists={1: [1.0, float("nan"), 3.0]}), target="float")
    assert reader.targets.bad == {1: "target [1.0, nan, 3.0] holds a number that is not finite"}


def test_the_labels_csv_dialect(tmp_path):
    root = make_folder(tmp_path / "src", {"a": [jpeg_bytes(20, 20)] * 3, "b b": [jpeg_bytes(21, 20)]})
    files = sorted(root.rglob("*.jpg"))
    (root / "labels.csv").write_text('\ufeffa/001.jpg,3,4\n\n"b b/000.jpg","1 2",0\n./a/000.jpg,\n')
    keep, values, ends = read_labels_csv(root, files)
    assert keep == [0, 1, 3] and values.tolist() == [3, 4, 1, 2, 0] and ends.tolist() == [0, 2, 5]
    reader = open_dataset(root, target="multihot", num_classes=K)  # a/002.jpg has no row: left out, named
    assert len(reader) == 3 and reader.skipped == [(str(root / "a" / "002.jpg"), "no row in labels.csv")]
    assert reader.targets.rows([0, 1, 2]).tolist() == [[0] * 5, [0, 0, 0, 1, 1], [1, 1, 1, 0, 0]]
    for text, says in [
        ("a/000.jpg,1,two\n", "line 1: 'two' is not a number; a row is an image's path, then its class indices "
         "(multihot) or numbers (float); a header row starts with 'path'"),
        ("a/000.jpg,1\na/001.jpg,x\n", "line 2: 'x' is not a number; a row is an image's path, then its class "
         "indices (multihot) or numbers (float)"),
        ("a/000.jpg,1\na/000.jpg,2\n", "line 2: a/000.jpg has a row already (line 1); give each image one row"),
        ("file,1\n", "line 1: no image file under"),
        ("a/000.jpg,1\nc/9.jpg,1\nd.jpg\n", "line 2: no image c/9.jpg under"),
    ]:  # fmt: skip
        (root / "labels.csv").write_text(text)
        with pytest.raises(ValueError) as e:
            open_dataset(root, target="multihot", num_classes=K)
        assert one_line(e).startswith(f"{root / 'labels.csv'} {says}"), str(e.value)
        assert str(e.value).endswith("'path'") == ("'path'" in says or "no image" in says)
    assert "(2 rows name no image)" in str(e.value) and "a header row, if any, starts with 'path'" in str(e.value)
    (root / "labels.csv").unlink()
    with pytest.raises(FileNotFoundError) as e:
        open_dataset(root, target="float")
    assert one_line(e) == (
        f"{root / 'labels.csv'}: missing; targets other than the class folders come from labels.csv beside them "
        "(a row per image: its path relative to the root, then its class indices or numbers)"
    )


def test_target_arguments_are_checked_in_one_line(tmp_path):
    root = write_folder(tmp_path / "src", "multihot")
    for kw, message in [
        ({"target": "tags"}, "target='tags': use 'class', 'multihot' or 'float'"),
        ({"target": "multihot"}, "target='multihot' needs num_classes=K, the number of classes (the rows' width)"),
        ({"target": "multihot", "num_classes": 0}, "num_classes=0: must be a positive integer"),
        ({"target": "multihot", "num_classes": True}, "num_classes=True: must be a positive integer"),
        ({"num_classes": 5}, "num_classes=5 is for target='multihot' (the width of its rows); class targets take the "
         "data set's classes and float targets the length of their lists"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            open_dataset(root, **kw)
        assert one_line(e) == message
    check_target("multihot", np.int64(3))  # numpy integers are integers
    with pytest.raises(ValueError, match="per-record lists make 'multihot' or 'float' targets"):
        ListTargets("class", np.zeros(1), np.ones(1, np.int64))


def test_list_targets_rows_checks_and_counts():
    values = np.array([0, 2, 4, 4, 1, 9, 3], dtype=np.float64)
    ends = np.array([2, 2, 4, 6, 7])  # [0 2] [] [4 4] [1 9] [3]
    t = ListTargets("multihot", values, ends, 5, source=lambda i: f"r{i}")
    assert len(t) == 5 and t.width == 5 and t.bad == {3: "class index 9 is outside 0..4 (num_classes=5)"}
    assert t.rows([2, 0, 1, 4]).tolist() == [[0, 0, 0, 0, 1], [1, 0, 1, 0, 0], [0] * 5, [0, 0, 0, 1, 0]]
    assert t.rows([]).shape == (0, 5) and t.rows(np.array([4, 4])).tolist() == [[0, 0, 0, 1, 0]] * 2
    assert t.check([0, 3, 1, 3]) == {1: t.bad[3], 3: t.bad[3]} and t.check([0, 1]) == {}
    sub = SubsetTargets(t, np.array([4, 2]))
    assert (len(sub), sub.kind, sub.width) == (2, "multihot", 5) and sub.rows([1]).tolist() == [[0, 0, 0, 0, 1]]
    assert sub.check([0, 1]) == {} and SubsetTargets(t, np.array([3])).check([0]) == {0: t.bad[3]}
    good = ListTargets("float", np.arange(6.0), np.array([3, 6]))
    assert good.bad == {} and good.check([0, 1]) == {} and good.rows([1]).dtype == np.float32
    with pytest.raises(ValueError) as e:
        ListTargets("float", np.zeros(0), np.zeros(2, np.int64), source=lambda i: f"r{i}")
    assert one_line(e) == "r0: no numbers in the target lists; target='float' needs D >= 1 per sample"


def test_list_targets_edges():
    check_target("multihot", 1)  # one class is a class
    ends = np.array([2, 4, 5], dtype=np.uint64)  # unsigned offsets are taken as signed
    two = ListTargets("multihot", np.array([5, 6, 7, 9, 1]), ends, 5)
    assert two.bad == {  # each record named by its first bad index
        0: "class index 5 is outside 0..4 (num_classes=5)",
        1: "class index 7 is outside 0..4 (num_classes=5)",
    }
    assert two.rows([2]).tolist() == [[0, 1, 0, 0, 0]] and two.check([]) == {} and two.check([2, 0]) == {1: two.bad[0]}
    sub = SubsetTargets(two, np.array([2, 1]))
    assert sub.rows([]).shape == (0, 5) and sub.check([]) == {} and sub.check([1]) == {0: two.bad[1]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN index is a bad record, not a cast warning
        nan = ListTargets("multihot", np.array([np.nan, 1.0]), np.array([1, 2]), 3)
    assert nan.bad == {0: "class index nan is not a whole number"} and nan.rows([1]).tolist() == [[0, 1, 0]]
    with pytest.raises(ValueError) as e:
        ListTargets("float", np.zeros(0), np.zeros(0, np.int64), source=lambda i: f"r{i}")  # no record at all
    assert one_line(e) == "r0: no numbers in the target lists; target='float' needs D >= 1 per sample"


class ListReader:
    """The least a reader of per-record lists writes to offer targets (a Parquet list column's reader, say):
    its lists as (values, ends), then `attach_targets` at the end of its __init__."""

    def __init__(self, lists: list[list[float]], target=None, num_classes=None):
        self.classes = ["0"]
        self.images = [np.frombuffer(jpeg_bytes(20 + i, 16), np.uint8) for i in range(len(lists))]
        self.target_lists = (np.array([x for one in lists for x in one]), np.cumsum([len(one) for one in lists]))
        attach_targets(self, target, num_classes)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], 0

    def source(self, i):
        return f"mem://{i}.jpg"


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_any_reader_offers_targets_through_attach_targets(backend):
    from dali_fast.data.base import read_batch_checked, read_checked

    lists = [[0, 2], [], [1], [9], [2, 1, 0]]
    reader = ListReader(lists, "multihot", 3)
    assert reader.target_kind == "multihot" and reader.targets.bad == {
        3: "class index 9 is outside 0..2 (num_classes=3)"
    }
    assert read_checked(reader, 3)[2] == reader.targets.bad[3] and read_checked(reader, 2)[2] is None
    assert read_batch_checked(reader, [3, 0, 3])[2] == {0: reader.targets.bad[3], 2: reader.targets.bad[3]}
    extra = {"num_workers": 0} if backend == "torch" else {}
    loader = loader_class(backend)(reader, 2, train=False, image_size=16, device="cpu", on_error="skip", **extra)
    got = torch.cat([t for _, t in loader])
    assert got.tolist() == [[1, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 1]] and loader.skipped == 1
    assert ListReader(lists).target_kind == "class" and ListReader(lists).targets is None
    for kw, message in [
        ({"target": "multihot", "num_classes": 0}, "num_classes=0: must be a positive integer"),
        ({"target": "float"}, "record 0 (mem://0.jpg) has 2 target numbers, most records have 1 (3 records differ): "
         "float targets need the same count for every sample; fix its list"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            ListReader(lists, **kw)
        assert one_line(e) == message


def test_a_subset_and_a_cache_carry_the_targets(tmp_path):
    from dali_fast import CachedReader, LRUCache
    from dali_fast.data.base import split

    reader = open_dataset(write_folder(tmp_path / "src", "float"), target="float")
    train, held = split(reader, 0.3, seed=1)
    assert train.target_kind == "float" and train.targets.rows([0]).tolist() == [
        row(int(train.indices[0]), "float").tolist()
    ]
    cached = CachedReader(reader, LRUCache(1 << 20))
    assert cached.target_kind == "float" and cached.targets is reader.targets
    plain = open_dataset(tmp_path / "src")
    assert split(plain, 0.3)[0].targets is None and CachedReader(plain, LRUCache(1)).target_kind == "class"


def test_remote_shards_carry_target_lists(tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from object_store import S3Server

    from dali_fast.data.remote.webdataset import RemoteShardsReader

    shards = write_shards(tmp_path / "shards", "multihot", "list")
    server = S3Server()
    try:
        server.client.create_bucket(Bucket="target-lists")  # moto keeps one store per process: a bucket of its own
        for p in sorted(shards.iterdir()):
            server.client.put_object(Bucket="target-lists", Key=p.name, Body=p.read_bytes())
        kw = {"storage_options": {"endpoint_url": server.endpoint}, "cache_dir": tmp_path / "c"}
        reader = open_dataset("s3://target-lists/train-{000000..000001}.tar", target="multihot", num_classes=K, **kw)
        assert isinstance(reader, RemoteShardsReader) and reader.target_kind == "multihot"
        loader = loader_class("torch")(reader, 4, train=True, image_size=16, num_workers=0)
        seen = [i for _, t in loader for i in check_rows(reader, loader, t, "multihot")]
        assert sorted(seen) == list(range(N))
        index = sorted((tmp_path / "c" / "index").glob("*.npz"))
        with pytest.raises(
            ValueError, match=r"^record 0 \(s3://target-lists/train-000000.tar:img00.jpg\) has 0 target numbers"
        ):
            open_dataset(
                "s3://target-lists/train-{000000..000001}.tar", target="float", **kw
            )  # the saved index, as float
        assert len(index) == 2 and sorted((tmp_path / "c" / "index").glob("*.npz")) == index
        with pytest.raises(ValueError, match="no samples with an image and a label in 2 remote shards"):
            open_dataset("s3://target-lists/", **kw)  # class targets: indexed apart, by the label rules
        assert len(list((tmp_path / "c" / "index").glob("*.npz"))) == 4
    finally:
        server.stop()


def test_lightning_opens_paths_with_the_targets(tmp_path):
    pytest.importorskip("pytorch_lightning")
    from dali_fast.lightning import DaliFastDataModule

    root = write_folder(tmp_path / "src", "multihot")
    dm = DaliFastDataModule(
        train=root,
        val=root,
        target="multihot",
        num_classes=K,
        backend="torch",
        batch_size=4,
        image_size=16,
        num_workers=0,
    )
    loader = dm.val_dataloader()
    got = torch.cat([t for _, t in loader])
    np.testing.assert_array_equal(got.numpy(), np.stack([row(i, "multihot") for i in range(N)]))
    dm.teardown("fit")
    with pytest.raises(ValueError, match="num_classes=3 is for target='multihot'"):
        DaliFastDataModule(train=root, num_classes=3)


def test_the_worker_result_names_the_good_records(tmp_path):
    """TorchIterator's workers send back the indices of the images they wrote (the main process makes the
    rows from them): with a bad record among them, the indices skip it."""
    from dali_fast.loaders.torch_slots import Task
    from dali_fast.loaders.torch_worker import BatchMaker
    from dali_fast.transforms.recipe import Recipe

    root = write_folder(tmp_path / "src", "multihot", lists={1: [6]})
    reader = open_dataset(root, target="multihot", num_classes=K)
    buffer = torch.empty((1, 4, 3, 16, 16), dtype=torch.uint8)
    out = BatchMaker(reader, False, Recipe(image_size=16), 0, buffer, "CHW").make(Task(0, [(0, 0), (1, 0), (2, 0)]))
    assert out["indices"].tolist() == [0, 2] and out["n"] == 2 and out["bad"] == [(1, reader.targets.bad[1])]


def test_jpeg_bytes_in_the_shards_are_the_images(tmp_path, cache):
    """The targets travel beside the images, not instead of them: the bytes read back are the ones written."""
    shards = write_shards(tmp_path / "shards", "float", "object")
    reader = open_dataset(shards, target="float")
    from PIL import Image

    assert Image.open(io.BytesIO(bytes(reader[3][0]))).size == (23, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_gpu_rows_arrive_on_the_images_device(tmp_path, backend):
    """On a GPU, the rows come out on the device the images are on (DALI's labels are there already;
    TorchIterator copies them beside the pixels), and are still each sample's own."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    reader = open_dataset(write_folder(tmp_path / "src", "multihot"), target="multihot", num_classes=K)
    extra = {"num_workers": 1} if backend == "torch" else {}
    loader = loader_class(backend)(reader, 4, train=True, image_size=16, device="cuda", **extra)
    seen = []
    for images, targets in loader:
        assert targets.device == images.device and targets.device.type == "cuda"
        seen += check_rows(reader, loader, targets, "multihot")
    assert sorted(seen) == list(range(N))
