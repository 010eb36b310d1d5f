"""The tables and charts `bench` and `stages` write, and the figures formatted one way."""

from __future__ import annotations

from dali_fast.tools.report import Panel, bar_charts, gib, percent, ratio, share, table, where


def test_a_markdown_table_aligns_figures_right_and_keeps_empty_cells_narrow():
    t = table(["name", "img/s", "x"], [["dali", "120", "1.50x"], ["baseline", "failed: OSError: gone", ""]])
    assert t.splitlines() == [
        "| name | img/s | x |",
        "|---|---:|---:|",
        "| dali | 120 | 1.50x |",
        "| baseline | failed: OSError: gone | |",
    ]


def test_figures_read_one_way_everywhere():
    assert (percent(55.4), percent("n/a"), percent(None)) == ("55", "n/a", "n/a")
    assert (gib(2**30), gib("n/a")) == ("1.00 GiB", "n/a")
    assert (ratio(1.234), ratio(None)) == ("1.23x", "-")
    assert (share(0.853), share(None)) == ("85%", "-")
    assert where({"gpu": None, "cpu_count": 2}) == "2 CPU cores, no GPU (DALI CPU-only mode)"
    assert where({"gpu": "NVIDIA H200", "cpu_count": 16}) == "NVIDIA H200"


def test_bar_charts_write_one_png_of_the_panels(tmp_path):
    panels = [
        Panel([3.0, 5.0], "throughput", "images / s", line=(6.0, "limit")),
        Panel([40.0, 90.0], "util", fmt="%.0f%%"),
    ]
    bar_charts(tmp_path / "c.png", ["a", "b"], panels, "title", width=8, rotate=25)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_is_singular_in_the_summaries(tmp_path):
    from dali_fast.tools.report import bench_summary, stages_summary

    machine = {"gpu": None, "cpu_count": 2}
    settings = {"images": 1, "epochs": 1, "batch_size": 1, "image_size": 32, "model": "none"}
    out = bench_summary({"settings": settings, "machine": machine, "table": "", "rows": []}, tmp_path)
    assert "1 image, 1 timed epoch after a warm-up" in out
    settings.update(data_bytes=2**20, cache_bytes=0, controller_epochs=3)
    out = stages_summary({"settings": settings, "machine": machine, "table": ""}, tmp_path)
    assert "1 image (1 MiB)" in out and "1 timed epoch after a warm-up (3 for the controller)" in out
    settings.update(images=2, epochs=2)
    assert "2 images, 2 timed epochs after" in bench_summary(
        {"settings": settings, "machine": machine, "table": "", "rows": []}, tmp_path
    )


def test_the_limit_caption_sits_under_the_title_and_covers_no_bar_value():
    """The dashed line's caption once lay on the axes, over the value of a bar as tall as the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dali_fast.tools.report import draw, tails_panel

    rows = [{"batch_p50_s": 0.010, "batch_p99_s": 0.030}, {"batch_p50_s": 0.020, "batch_p99_s": 0.022}]
    panels = [Panel([100.0, 398.0], "throughput", line=(400.0, "limit: decode only 400")), tails_panel(rows, "#999999")]
    fig = draw(plt, ["a", "b"], panels, "title", width=10)
    fig.canvas.draw()
    throughput, tails = fig.axes
    assert throughput.get_title() == "throughput\n(dashed: limit: decode only 400)" and not throughput.texts[2:]
    assert tails.get_title() == "batch time (steady state)\n(solid: p50, hatched: p99)"
    assert [t.get_text() for t in tails.texts] == ["10", "20", "30", "22"]  # p50 bars, then p99 bars, in ms
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        title = ax.title.get_window_extent(renderer)
        for value in ax.texts:  # every bar's value stays under the axes' top, clear of the caption
            box = value.get_window_extent(renderer)
            assert not box.overlaps(title) and box.y1 <= ax.get_window_extent(renderer).y1, value.get_text()
    plt.close(fig)
