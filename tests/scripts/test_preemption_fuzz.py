"""scripts/preemption_fuzz.py (``make fuzz``): its checks catch what they are for, on runs written by hand, and
its quick slice (both loaders, every data kind, Lightning, drop_last, uneven shares, a controller, a
resolution schedule; SIGKILLs and resumes on other world sizes) finds nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from preemption_check import END, Gen, check_epoch, check_replay  # noqa: E402

ORDER = {  # 10 samples; rank r of w takes every w-th of this permutation, wrapping around to even the shares
    w: [[[3, 1, 4, 0, 5, 9, 2, 6, 8, 7][(k * w + r) % 10] for k in range(-(-10 // w))] for r in range(w)]
    for w in (1, 2, 3)
}


def order(world, rank, epoch):
    return ORDER[world][rank]


def test_an_uninterrupted_epoch_and_a_resume_on_the_same_world_are_exact():
    whole = Gen(2, {r: [((0, 1), ORDER[2][r])] for r in range(2)}, None, (0, END))
    assert check_epoch([whole], 0, range(10), order, drop_last=False, even=True).ok
    first = Gen(2, {r: [((0, 1), ORDER[2][r][:2]), ((0, 2), ORDER[2][r][2:4])] for r in range(2)}, None, (0, 1))
    then = Gen(2, {r: [((0, 2), ORDER[2][r][2:])] for r in range(2)}, (0, 1), (0, END))
    assert check_epoch([first, then], 0, range(10), order, drop_last=False, even=True).ok
    assert check_replay([first, then]).ok  # what `first` lost after its commit came again, the same


def test_padding_is_allowed_only_where_the_docs_allow_it():
    padded = Gen(3, {r: [((0, 1), ORDER[3][r])] for r in range(3)}, None, (0, END))  # 12 places: 2 repeats
    assert check_epoch([padded], 0, range(10), order, drop_last=False, even=True).ok
    v = check_epoch([padded], 0, range(10), order, drop_last=False, even=False)
    assert v.repeated == 2  # uneven shares repeat nothing
    early = Gen(3, {0: [((0, 1), [3, 3])], 1: [((0, 1), [1])], 2: [((0, 1), [4])]}, None, (0, 1))  # a repeat early
    rest = Gen(1, {0: [((0, 2), [0, 5, 9, 2, 6, 8, 7])]}, (0, 1), (0, END))  # one rank pads nothing
    v = check_epoch([early, rest], 0, range(10), order, drop_last=False, even=True)
    assert (v.lost, v.repeated) == (0, 1)  # the old ranks' padding is not the new ranks' to repeat
    assert v.order == 0  # the world size changed: no order to compare


def test_lost_samples_and_another_order_are_counted():
    short = Gen(2, {0: [((0, 1), ORDER[2][0])], 1: [((0, 1), ORDER[2][1][:3])]}, None, (0, END))
    v = check_epoch([short], 0, range(10), order, drop_last=False, even=True)
    assert (v.lost, v.order) == (2, 1) and v.notes[0].startswith("epoch 0: 2 missing")
    swapped = Gen(1, {0: [((0, 1), list(reversed(ORDER[1][0])))]}, None, (0, END))
    assert check_epoch([swapped], 0, range(10), order, drop_last=False, even=True).order == 1
    cut = Gen(3, {r: [((0, 1), ORDER[3][r][:2])] for r in range(3)}, None, (0, END), batch=3)
    assert check_epoch([cut], 0, range(10), order, drop_last=True, even=True).ok  # drop_last: under a batch a rank
    cut.batch = 2
    v = check_epoch([cut], 0, range(10), order, drop_last=True, even=True)
    assert (v.lost, v.order) == (0, 3)  # two of a rank's places left out at batch size 2: not a last batch
    twice = Gen(1, {0: [((0, 1), [3, 1, 3])]}, None, (0, END), batch=3)
    assert check_epoch([twice], 0, [3, 1, 4], lambda w, r, e: [3, 1, 4], drop_last=True, even=True).repeated == 1


def test_a_world_size_that_delivered_nothing_still_cut_the_epoch():
    """One rank took 8 of 10, then 3 ranks finished the epoch at batch size 4: each had no whole batch of the
    2 left (drop_last), so the rest came nowhere; the bound counts their world size, and no order is asked
    of an epoch whose world size changed. At batch size 1 the same silence loses samples."""
    one = Gen(1, {0: [((0, 1), ORDER[1][0][:4]), ((0, 2), ORDER[1][0][4:8])]}, None, (0, 2), batches={0: 4})
    three = Gen(3, {r: [] for r in range(3)}, (0, 2), (0, END), batch=4)
    assert check_epoch([one, three], 0, range(10), order, drop_last=True, even=True).ok
    short = Gen(1, {0: [((0, 1), ORDER[1][0][:3]), ((0, 2), ORDER[1][0][3:6])]}, None, (0, 2), batches={0: 3})
    silent = Gen(3, {r: [] for r in range(3)}, (0, 2), (0, END), batch=1)  # 4 left: a sample per rank was due
    v = check_epoch([short, silent], 0, range(10), order, drop_last=True, even=True)
    assert (v.lost, v.order) == (4 - (3 - 1), 0)  # 4 missing, of which the tails of 1 and 3 ranks explain 2


def test_lost_work_not_replayed_the_same_is_counted():
    first = Gen(1, {0: [((0, 1), [3, 1]), ((0, 2), [4, 0])]}, None, (0, 1))
    then = Gen(1, {0: [((0, 2), [0, 4, 5, 9, 2, 6, 8, 7])]}, (0, 1), (0, END))
    assert check_replay([first, then]).replay == 1
    assert check_epoch([first, then], 0, range(10), order, drop_last=False, even=True).order == 1


@pytest.mark.slow
def test_the_quick_slice_finds_nothing(tmp_path):
    """About a minute: 9 trials, each killed and resumed 1 to 3 times, on every data kind (S3 on moto's
    server) and both loaders, plus a Lightning restore mid-epoch."""
    pytest.importorskip("moto")
    pytest.importorskip("pytorch_lightning")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "preemption_fuzz.py"), "--quick", "--out", str(tmp_path / "fuzz")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith("preemption fuzz, seed 0: 9 trials, ")
    assert re.search(
        r" 0 lost, 0 repeated, 0 order mismatches \(of [1-9]\d* rank epochs\), 0 replay mismatches \(of [1-9]\d*\), 0 pixel mismatches, 0 failed trials; ",
        last,
    ), last
    assert "kinds folder,packed,parquet,parquet-stream,s3,wds; loaders dali,torch" in last
    assert "modes lightning,loader" in last
