"""The unusual JPEGs of gpu_check: a share of the data step's photos re-encoded the ways real data sets hold
them (`make_odd`), and the odd-JPEG corpus decoded on the GPU and compared with the CPU per kind
(`corpus_step`).

`make_odd` turns about ``share`` of an ImageFolder's JPEGs, in turn, into one of `ODD_KINDS`: progressive,
4:4:4 chroma, gray, 2-6 megapixels (the decoder's buffers regrow) and EXIF-rotated (stored turned, shown
upright). A batch then mixes chroma layouts, and some images leave the hardware engine.

The corpus is a folder with ``manifest.json``: a list of ``{"file", "kind", "made_by", "expect": "decode" |
"refuse", "max_levels": <int or null>}``. Each image is decoded alone, on the GPU (`mixed`, fancy chroma
upsampling, as training decodes whole images) or on DALI's CPU decoder without a GPU, and compared with
Pillow under the project's decoding rule (`transforms.decode.to_rgb`: EXIF orientation applied). An image
to decode must decode to Pillow's shape with its largest difference within ``max_levels`` (null: reported,
not bounded); an image to refuse must fail to decode. The step fails on any kind that does not.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ODD_KINDS = ("progressive", "444", "gray", "large", "exif_rotated")
LARGE_MEGAPIXELS = (2.0, 6.0)


def _odd(data: bytes, kind: str, rng: np.random.Generator, quality: int) -> bytes:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as src:
        im = src.convert("RGB")
    save: dict[str, Any] = {"quality": quality}
    if kind == "progressive":
        save.update(progressive=True, subsampling=2)
    elif kind == "444":
        save.update(subsampling=0)
    elif kind == "gray":
        im = im.convert("L")
    elif kind == "large":
        mp = float(rng.uniform(*LARGE_MEGAPIXELS)) * 1e6
        scale = (mp / (im.width * im.height)) ** 0.5
        im = im.resize((round(im.width * scale), round(im.height * scale)), Image.BICUBIC)
        save.update(subsampling=2)
    elif kind == "exif_rotated":
        exif = Image.Exif()
        exif[0x0112] = 6  # shown turned 90 degrees clockwise from how it is stored
        im = im.transpose(Image.ROTATE_90)
        save.update(subsampling=2, exif=exif.tobytes())
    else:
        raise ValueError(f"kind={kind!r}: use one of {', '.join(ODD_KINDS)}")
    buf = io.BytesIO()
    im.save(buf, "JPEG", **save)
    return buf.getvalue()


def make_odd(root: Path, share: float, quality: int = 95, seed: int = 0) -> dict[str, int]:
    """Re-encode every ``1/share``-th JPEG under ``root`` (in sorted order) as the next of `ODD_KINDS`, in
    place; returns how many of each kind."""
    counts = dict.fromkeys(ODD_KINDS, 0)
    if share <= 0:
        return counts
    step = max(1, round(1 / share))
    rng = np.random.default_rng(seed)
    for n, path in enumerate(sorted(root.rglob("*.jpg"))[::step]):
        kind = ODD_KINDS[n % len(ODD_KINDS)]
        path.write_bytes(_odd(path.read_bytes(), kind, rng, quality))
        counts[kind] += 1
    return counts


def read_manifest(corpus: Path) -> list[dict[str, Any]]:
    """The corpus's manifest, checked: each entry's file exists and ``expect`` is "decode" or "refuse"."""
    path = corpus / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"no odd-JPEG corpus at {corpus} (no manifest.json): pass --corpus FOLDER")
    entries = json.loads(path.read_text())
    for e in entries:
        if e.get("expect") not in ("decode", "refuse") or not (corpus / e["file"]).is_file():
            raise ValueError(f"{path}: entry {e!r} needs an existing 'file' and 'expect' of 'decode' or 'refuse'")
    return entries


def pillow_rgb(data: bytes) -> np.ndarray | None:
    """Pillow's pixels under the project's rule (EXIF orientation applied), or None where Pillow refuses."""
    from PIL import Image

    from dali_fast.transforms.decode import to_rgb

    try:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(to_rgb(im))
    except Exception:  # noqa: BLE001 - a refusal is an answer here
        return None


def decode_one(data: bytes, device: str, device_id: int | None) -> np.ndarray:
    """One image through DALI's decoder as training decodes whole images (`mixed` with fancy upsampling, or
    "cpu"), in a pipeline of its own: a failure leaves nothing behind for the next image."""
    from nvidia.dali import fn, pipeline_def, types

    from dali_fast.loaders.dali_pipeline import shutdown_pipeline

    arr = np.frombuffer(data, np.uint8)
    kw = {"jpeg_fancy_upsampling": True} if device == "mixed" else {}

    @pipeline_def(batch_size=1, num_threads=1, device_id=device_id, prefetch_queue_depth=1)
    def pipe():  # type: ignore[no-untyped-def]
        jpegs = fn.external_source(source=lambda: [arr], batch=True)
        return fn.decoders.image(jpegs, device=device, output_type=types.RGB, **kw)

    p = pipe()
    try:
        p.build()
        (out,) = p.run()
        if device == "mixed":
            out = out.as_cpu()
        return np.array(out.at(0))
    finally:
        shutdown_pipeline(p)


def corpus_step(
    corpus: Path, gpu: bool, device_id: int | None, figure: Callable[[str, Any], None], failed: list[str]
) -> None:
    """Decode each corpus image (`decode_one`) and report per kind: how many, the largest and mean
    difference from Pillow in levels, and whether each met its expectation; a kind that did not fails."""
    entries = read_manifest(corpus)
    device = "mixed" if gpu else "cpu"
    figure("odd.corpus", f"{corpus} ({len(entries)} images)")
    figure("odd.decoder", f"{device} (fancy upsampling)" if gpu else "cpu (no GPU)")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(entries, key=lambda e: e["expect"] == "refuse"):  # a refusal that crashes comes last
        data = (corpus / e["file"]).read_bytes()
        ref = pillow_rgb(data)
        try:
            got, error = decode_one(data, device, device_id), None
        except Exception as x:  # noqa: BLE001 - the decoder's refusal
            got, error = None, " ".join(str(x).split())[-160:]
        by_kind.setdefault(e["kind"], []).append(_verdict(e, got, ref, error))
    for kind, results in sorted(by_kind.items()):
        bad = [r for r in results if not r["ok"]]
        levels = [r["max_levels"] for r in results if r["max_levels"] is not None]
        means = [r["mean_levels"] for r in results if r["mean_levels"] is not None]
        figure(f"odd.{kind}.images", len(results))
        figure(f"odd.{kind}.max_levels", max(levels) if levels else "n/a (none decoded)")
        figure(f"odd.{kind}.mean_levels", float(np.mean(means)) if means else "n/a (none decoded)")
        bound = {r["bound"] for r in results}
        figure(f"odd.{kind}.bound", ",".join("none" if b is None else str(b) for b in sorted(bound, key=str)))
        figure(f"odd.{kind}.ok", "yes" if not bad else f"NO: {'; '.join(r['why'] for r in bad)[:400]}")
        if bad:
            failed.append(f"odd JPEGs of kind {kind}: {bad[0]['why']}")


def _verdict(e: dict[str, Any], got: np.ndarray | None, ref: np.ndarray | None, error: str | None) -> dict[str, Any]:
    name, bound = e["file"], e.get("max_levels")
    out: dict[str, Any] = {"ok": True, "why": "", "max_levels": None, "mean_levels": None, "bound": bound}
    if e["expect"] == "refuse":
        if got is not None:
            out.update(ok=False, why=f"{name} decoded ({got.shape}) where it should be refused")
        return out
    if got is None:
        return {**out, "ok": False, "why": f"{name} was refused: {error}"}
    if ref is None or got.shape != ref.shape:
        shape = None if ref is None else ref.shape
        return {**out, "ok": False, "why": f"{name} decoded to {got.shape}, Pillow's is {shape}"}
    diff = np.abs(got.astype(np.int16) - ref.astype(np.int16))
    out.update(max_levels=int(diff.max()), mean_levels=float(diff.mean()))
    if bound is not None and out["max_levels"] > bound:
        out.update(ok=False, why=f"{name} is {out['max_levels']} levels from Pillow's (bound {bound})")
    return out
