import json

import pytest

from dali_fast.data.pack.packed import pack
from dali_fast.data.synthetic import make_synthetic
from dali_fast.tools.bench import run_bench
from dali_fast.tools.bench_table import markdown_table
from dali_fast.tools.report import bench_summary


@pytest.fixture(scope="module")
def tiny_packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    make_synthetic(root / "images", images=36, classes=3, progress=False)
    pack(root / "images", root / "packed", progress=False)
    return root


def bench(data, loaders: list[str], out, **kw):
    """`run_bench` as these tests call it: one timed epoch of batches of 8 at 32 px, no progress bar."""
    settings = {"epochs": 1, "batch_size": 8, "image_size": 32, **kw}
    return run_bench(str(data), loaders=loaders, out=out, progress=False, **settings)


def test_bench_writes_results_and_png(tiny_packed, tmp_path):
    pytest.importorskip("nvidia.dali")
    out = tmp_path / "out"
    result = bench(tiny_packed / "images", ["baseline", "torch", "dali"], out)
    data = json.loads((out / "results.json").read_text())
    assert [r["loader"] for r in data["rows"]] == ["baseline", "torch", "dali"]
    for r in data["rows"]:
        assert "error" not in r, r
        assert r["images_per_epoch"] == 36 and r["img_per_s"] > 0 and r["epoch_s"] > 0
        assert r["util_kind"] in ("cpu", "gpu")
    assert data["rows"][0]["x_baseline"] == 1.0
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["torch"]
    assert data["settings"]["images"] == 36
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert result["table"].splitlines()[0].startswith("| loader | img/s | epoch s | batch p50 ms | batch p99 ms |")
    for r in data["rows"]:  # 36 images in batches of 8: 5 steps, the first of the epoch kept apart
        assert len(r["batch_times"]) == 1 and len(r["batch_times"][0]) == 5 and r["batches_timed"] == 4
        steady = sorted(r["batch_times"][0][1:])
        assert steady[0] <= r["batch_p50_s"] <= r["batch_p99_s"] <= steady[-1]
        assert r["p99_over_p50"] == pytest.approx(r["batch_p99_s"] / r["batch_p50_s"])
        assert r["first_batch_s"] == [r["batch_times"][0][0]]
        assert r["pss_peak_bytes"] > 50 * 2**20 and "peak_mem_bytes" not in r


def test_bench_with_model_and_cache(tiny_packed, tmp_path):
    pytest.importorskip("nvidia.dali")
    result = bench(tiny_packed / "packed", ["dali"], tmp_path, epochs=2, batch_size=12, model="resnet_tiny", cache_bytes=2**26)
    row = result["rows"][0]
    # Warm-up and steady state apart: the warm-up fills the cache, the two timed epochs hit every time.
    assert row["cache_warmup"]["misses"] == 36 and row["cache_warmup"]["hits"] == 0
    assert row["cache"]["misses"] == 0 and row["cache"]["hits"] == 72 and row["cache"]["hit_rate"] == 1.0
    assert 0 < row["build_s"] < row["warmup_s"]  # the pipeline's build, within the warm-up, apart from img/s
    summary = bench_summary(result, tmp_path)
    assert "2 timed epochs after a warm-up" in summary and "  dali: warm-up epoch " in summary
    assert "pipeline builds" in summary and "cache hit 0% while filling (not in img/s)" in summary


def test_table_marks_failures():
    rows = [
        {
            "loader": "baseline",
            "img_per_s": 100.0,
            "epoch_s": 1.0,
            "util_kind": "cpu",
            "util_mean": 50.0,
            "batch_p50_s": 0.0123,
            "batch_p99_s": 0.0246,
            "p99_over_p50": 2.0,
            "pss_peak_bytes": 300 * 2**20,
            "cache": None,
        },
        {"loader": "dali", "error": "ImportError: no DALI"},
    ]
    t = markdown_table(rows)
    assert "| baseline | 100 | 1.00 | 12.3 | 24.6 | 2.00 | 50 | 300 MiB | - | 1.00x |" in t and "failed: ImportError" in t


def test_bad_loader_name(tmp_path):
    with pytest.raises(ValueError, match="loader 'jax'"):
        run_bench(str(tmp_path), loaders=["jax"], out=tmp_path)


def test_bench_on_a_folder_with_a_bad_image_names_it_in_one_line_or_skips_it(tmp_path, capsys):
    pytest.importorskip("nvidia.dali")
    from dali_fast.cli import main

    make_synthetic(tmp_path / "images", images=24, classes=2, progress=False)
    bad = sorted((tmp_path / "images").rglob("*.jpg"))[5]
    bad.write_bytes(bad.read_bytes()[:300])  # truncated: no decoder can read it
    argv = ["bench", str(tmp_path / "images"), "--epochs", "1", "--batch-size", "8", "--image-size", "32"]
    argv += ["--loaders", "baseline,dali"]  # a worker process's error and DALI's
    assert main([*argv, "--out", str(tmp_path / "raise")]) == 1
    rows = json.loads((tmp_path / "raise" / "results.json").read_text())["rows"]
    assert all("error" in r for r in rows)
    for r in rows:
        assert "\n" not in r["error"] and str(bad) in r["error"], r  # the record is named, in one line
    assert main([*argv, "--out", str(tmp_path / "skip"), "--on-error", "skip"]) == 0
    rows = json.loads((tmp_path / "skip" / "results.json").read_text())["rows"]
    assert [r.get("error") for r in rows] == [None, None]
    assert "Traceback" not in capsys.readouterr().err


def test_bench_puts_each_augmentation_side_by_side(tiny_packed, tmp_path):
    """``--augment none,trivialaugment``: one row per loader and augmentation, each against its own baseline."""
    pytest.importorskip("nvidia.dali")
    from dali_fast.cli import main

    argv = ["bench", str(tiny_packed / "packed"), "--loaders", "baseline,dali", "--epochs", "1"]
    argv += ["--batch-size", "12", "--image-size", "24", "--out", str(tmp_path), "--augment", "none,trivialaugment"]
    assert main([*argv, "--mixup", "0.2", "--random-erasing", "0.5"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = [(r["loader"], r["augment"]) for r in data["rows"]]
    assert rows == [("baseline", "none"), ("dali", "none"), ("baseline", "trivialaugment"), ("dali", "trivialaugment")]
    assert all("error" not in r and r["images_per_epoch"] == 36 for r in data["rows"])
    assert data["rows"][2]["x_baseline"] == 1.0  # trivialaugment's baseline is its own yardstick
    assert [r["auto_augment"] for r in data["settings"]["recipes"]] == [None, "trivialaugment"]
    assert data["settings"]["mix"]["alpha_mixup"] == 0.2 and data["settings"]["recipes"][0]["random_erasing"] == 0.5
    names = [line.split("|")[1].strip() for line in markdown_table(data["rows"]).splitlines()[2:]]
    assert names == ["baseline + none", "dali + none", "baseline + trivialaugment", "dali + trivialaugment"]


def test_the_limit_row_measures_decode_only_with_the_same_processes(tiny_packed, tmp_path):
    """The machine's ceiling on the same data, in the same run: every record read and decoded whole by
    as many processes as the loaders get; each loader row reads as a share of it."""
    from dali_fast.machine import available_cpus

    result = bench(tiny_packed / "images", ["baseline", "torch"], tmp_path)
    limit = json.loads((tmp_path / "results.json").read_text())["limit"]
    assert limit["loader"] == "limit" and "error" not in limit
    assert limit["images_per_epoch"] == 36 and limit["img_per_s"] > 0 and limit["workers"] == available_cpus()
    for r in result["rows"]:
        assert r["of_limit"] == pytest.approx(r["img_per_s"] / limit["img_per_s"])
    lines = result["table"].splitlines()
    assert lines[0].endswith("| x baseline | of limit |")
    assert lines[-1].startswith(f"| limit: decode only, {available_cpus()} processes | ") and lines[-1].endswith(
        " 100% |"
    )
    without = bench(tiny_packed / "images", ["torch"], tmp_path, limit=False)
    assert without["limit"] is None and "of limit" not in without["table"] and "of_limit" not in without["rows"][0]


def test_table_with_a_limit_row():
    row = {"loader": "torch", "img_per_s": 300.0, "epoch_s": 1.0, "util_kind": "cpu", "util_mean": 90.0}
    row.update(batch_p50_s=0.01, batch_p99_s=0.015, p99_over_p50=1.5, pss_peak_bytes=2**30, cache=None)
    base = {**row, "loader": "baseline", "img_per_s": 100.0}
    limit = {**row, "loader": "limit", "img_per_s": 400.0, "workers": 2}
    t = markdown_table([base, row], limit).splitlines()
    assert t[0] == (
        "| loader | img/s | epoch s | batch p50 ms | batch p99 ms | p99/p50 | CPU util % | peak PSS, main + workers "
        "| cache hit | x baseline | of limit |"
    )
    assert t[2] == "| baseline | 100 | 1.00 | 10.0 | 15.0 | 1.50 | 90 | 1024 MiB | - | 1.00x | 25% |"
    assert t[3] == "| torch | 300 | 1.00 | 10.0 | 15.0 | 1.50 | 90 | 1024 MiB | - | 3.00x | 75% |"
    assert t[4] == "| limit: decode only, 2 processes | 400 | 1.00 | 10.0 | 15.0 | 1.50 | 90 | 1024 MiB | - | 4.00x | 100% |"
    failed = markdown_table([base], {"loader": "limit", "workers": 2, "error": "OSError: gone"}).splitlines()
    assert failed[2].endswith("| 1.00x | - |") and "failed: OSError: gone" in failed[3]


def test_alternate_times_the_rows_in_turn(tiny_packed, tmp_path, monkeypatch):
    """--alternate: every row warms up, then the rows take turns, one timed epoch each."""
    from dali_fast.tools import bench_rows

    order = []
    real = bench_rows.Row.epoch

    def spy(self):
        order.append((self.name, self.epochs_run))
        real(self)

    monkeypatch.setattr(bench_rows.Row, "epoch", spy)
    result = bench(tiny_packed / "packed", ["baseline", "torch"], tmp_path, epochs=2, alternate=True)
    assert order == [("limit", 0), ("baseline", 0), ("torch", 0)] + [
        (name, e) for e in (1, 2) for name in ("limit", "baseline", "torch")
    ]
    assert [len(r["epoch_times"]) for r in result["rows"]] == [2, 2] and len(result["limit"]["epoch_times"]) == 2
    assert all(r["images_per_epoch"] == 36 for r in [*result["rows"], result["limit"]])
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["alternate"] is True


def test_a_row_failing_while_alternating_is_named_and_the_others_finish(tiny_packed, tmp_path, monkeypatch):
    from dali_fast.tools import bench_rows

    real = bench_rows.Row.epoch

    def flaky(self):
        if self.kind == "torch" and self.epochs_run == 1:
            raise RuntimeError("decode worker lost")
        real(self)

    monkeypatch.setattr(bench_rows.Row, "epoch", flaky)
    result = bench(tiny_packed / "packed", ["baseline", "torch"], tmp_path, epochs=2, alternate=True, limit=False)
    assert result["rows"][1] == {"loader": "torch", "augment": "none", "error": "RuntimeError: decode worker lost"}
    assert len(result["rows"][0]["epoch_times"]) == 2


def test_bench_progressive_rows_follow_the_ramp(tiny_packed, tmp_path, capsys):
    """``bench --progressive``: every loader's timed epochs at the ramp's sizes, img/s per size in the table."""
    pytest.importorskip("nvidia.dali")
    from dali_fast.cli import main

    out = tmp_path / "out"
    args = ["bench", str(tiny_packed / "images"), "--epochs", "3", "--batch-size", "8", "--image-size", "40"]
    assert main([*args, "--progressive", "16:32:1:3:8", "--no-limit", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["loader"] for r in data["rows"]] == ["baseline", "torch", "dali"]
    for r in data["rows"]:
        assert r["epoch_sizes"] == [16, 24, 32] and sorted(r["img_per_s_by_size"]) == ["16", "24", "32"]
        assert r["images_per_epoch"] == 36
    assert data["settings"]["recipes"][0]["resolution"] == {"progressive": "16:32:1:3:8"}
    header = data["table"].splitlines()[0]
    assert header.endswith("| img/s by size (px) |")
    assert "16: " in data["table"].splitlines()[2] and "32: " in data["table"].splitlines()[2]


def test_isolate_runs_each_loader_in_a_fresh_process_and_keeps_the_row_order(tiny_packed, tmp_path):
    result = bench(tiny_packed / "images", ["baseline", "torch"], tmp_path, batch_size=12, image_size=24, isolate=True, limit=False)
    assert [r["loader"] for r in result["rows"]] == ["baseline", "torch"] and result["limit"] is None
    for r in result["rows"]:
        assert "error" not in r and r["images_per_epoch"] == 36 and r["pss_peak_bytes"] > 50 * 2**20
    assert result["rows"][0]["isolated"] and result["settings"]["isolate"] is True
    assert (tmp_path / "isolated" / "torch" / "results.json").exists() and (tmp_path / "bench.png").exists()
    with pytest.raises(ValueError, match="^--isolate runs the rows one after another"):
        run_bench(str(tiny_packed / "images"), loaders=["torch"], out=tmp_path, isolate=True, alternate=True)
