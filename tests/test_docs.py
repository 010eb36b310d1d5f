"""The documentation runs: every fenced block of README.md, docs/*.md and docker/README.md is executed as
written on tiny data (or carries a `<!-- not run: reason -->` comment), every test the docs name exists,
and the command-line page lists every option with the parser's default.

How blocks run (docs/tests.md says the same to readers):
- ```python: exec'd in a fresh namespace in a working folder per page, where `data/train` (48 synthetic
  images, 4 classes), `data/val` (16), `shards/train-{000000..000003}.tar` and `my-dataset/` (the same
  images as a Hugging Face snapshot: `data/train-0000{0,1}-of-00002.parquet`, `data/test-00000-of-00001.parquet`) exist, and
  `s3://bucket/train-{000000..000003}.tar` and `s3://bucket/my-dataset/` (the same snapshot) are served by
  a local S3 server that AWS_ENDPOINT_URL names (for shell blocks too).
  Only `model` and `optimizer` (the reader's own objects) are given. Sizes: `epochs = N` and
  `max_epochs=N` become 1, and `batch_size=`, `min_batch=`, `max_batch=` are divided by 32.
- ```bash: each command run in the page's folder, `dali-fast` through its entry point `dali_fast.cli:main`; `--epochs` 1, `--images` 48,
  `--batch-size` divided by 32 (2 where a bench or train command has none), resnet18/resnet50 become
  resnet_tiny (train gets it when it names no model); `make T` runs as `make -n T` in the repository.
- ```text: output, not run.
The blocks of a page run in order in one folder; running one block alone first runs the page's earlier ones.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docker" / "README.md"]
RUN_LANGS = {"python", "bash"}
OUTPUT_LANGS = {"text"}
MAX_NOT_RUN = 8  # blocks that cannot run here; keep the list short and honest
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^`\s]*)\s*$")
SCALE = 32  # batch sizes in snippets are divided by this


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository
    line: int  # the fence's line number, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason, for a block marked not run

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with their language and any not-run comment just before."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m.group("indent"), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].rstrip() != f"{indent}```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        assert i < len(lines), f"{path.name}:{start + 1}: a code block is never closed"
        i += 1
        before = next((x.strip() for x in reversed(lines[:start]) if x.strip()), "")
        reason = NOT_RUN.match(before)
        page = path.relative_to(ROOT).as_posix()
        out.append(Block(page, start + 1, m.group("lang"), "\n".join(body) + "\n", reason and reason.group(1)))
    return out


BLOCKS = [b for page in PAGES for b in blocks_of(page)]
RUNNABLE = [b for b in BLOCKS if b.lang in RUN_LANGS]


# ---------------------------------------------------------------------------------------------- rewrites


def small_python(code: str) -> str:
    """The snippet with its epochs at 1 and its batch sizes divided by 32: nothing else changes."""
    code = re.sub(r"^(\s*epochs = )\d+", r"\g<1>1", code, flags=re.M)
    code = re.sub(r"\bmax_epochs=\d+", "max_epochs=1", code)
    return re.sub(
        r"\b(batch_size|min_batch|max_batch)=(\d+)", lambda m: f"{m.group(1)}={max(1, int(m.group(2)) // SCALE)}", code
    )


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block, continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def small_command(command: str) -> list[str]:
    """One command of a shell block, as the test runs it (the rewrites in the module docstring)."""
    words = shlex.split(command, comments=True)
    if words[0] == "make":
        return ["make", "-n", "-C", str(ROOT), *words[1:]]
    if words[0] == "bash" and len(words) > 1 and words[1].startswith(("benchmarks/", "gpu_check/", "scripts/")):
        return words
    if words[0] != "dali-fast":
        raise AssertionError(
            f"`{command.strip()}`: a shell block runs dali-fast, make or bash benchmarks/, gpu_check/ or scripts/ commands; "
            "mark a block that cannot run here with <!-- not run: reason --> just before it"
        )
    out: list[str] = []
    it = iter(words)
    for w in it:
        if w in ("--epochs", "--images", "--batch-size", "--model"):
            value = next(it)
            new = {
                "--epochs": "1",
                "--images": "48",
                "--batch-size": str(max(1, int(value) // SCALE)) if value.isdigit() else value,
                "--model": "resnet_tiny" if value in ("resnet18", "resnet50") else value,
            }[w]
            out += [w, new]
        else:
            out.append(w)
    command_name = next((w for w in words[1:] if not w.startswith("-")), "")
    if command_name in ("bench", "stages", "train") and "--batch-size" not in out:
        out += ["--batch-size", "2"]
    if command_name == "train" and "--model" not in out:
        out += ["--model", "resnet_tiny"]
    return out


def test_rewrites_change_only_sizes():
    code = (
        "epochs = 90\nx = DALIIterator(r, batch_size=256)\nc = C(min_batch=64, max_batch=1024, target_fraction=0.85)\n"
    )
    assert (
        small_python(code)
        == "epochs = 1\nx = DALIIterator(r, batch_size=8)\nc = C(min_batch=2, max_batch=32, target_fraction=0.85)\n"
    )
    assert small_python("trainer = pl.Trainer(max_epochs=90)") == "trainer = pl.Trainer(max_epochs=1)"
    assert small_command("dali-fast train data/x --epochs 90 --checkpoint ckpt  # a comment") == [
        "dali-fast", "train", "data/x", "--epochs", "1", "--checkpoint", "ckpt", "--batch-size", "2", "--model", "resnet_tiny"
    ]  # fmt: skip
    assert small_command("dali-fast bench --images 1000 --batch-size 64 --model resnet50") == [
        "dali-fast", "bench", "--images", "48", "--batch-size", "2", "--model", "resnet_tiny"
    ]  # fmt: skip
    assert small_command("make demo   # the table") == ["make", "-n", "-C", str(ROOT), "demo"]
    with pytest.raises(AssertionError, match="not run"):
        small_command("pip install .")


# ---------------------------------------------------------------------------------------------- fixtures


def _write_shards(src: Path, dst: Path, shards: int = 4) -> None:
    """WebDataset shards of an ImageFolder: `key.jpg` + `key.cls` per sample, in the folder's order."""
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    files = sorted((label, f) for label, c in enumerate(classes) for f in sorted((src / c).iterdir()))
    dst.mkdir(parents=True)
    per = -(-len(files) // shards)
    for s in range(shards):
        with tarfile.open(dst / f"train-{s:06d}.tar", "w") as tar:
            for j, (label, f) in enumerate(files[s * per : (s + 1) * per]):
                tar.add(f, arcname=f"{s:02d}{j:04d}.jpg")
                cls = dst / "label.cls"
                cls.write_text(str(label))
                tar.add(cls, arcname=f"{s:02d}{j:04d}.cls")
                cls.unlink()


def _write_parquet(src: Path, dst: Path, split: str, files: int) -> None:
    """An ImageFolder as a Hugging Face snapshot writes it: `image: struct<bytes, path>`, `label: int64` with
    the ClassLabel names in the schema metadata, row groups of 100 rows (when pyarrow is installed)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    rows = [(f, label) for label, c in enumerate(classes) for f in sorted((src / c).iterdir())]
    meta = {"info": {"features": {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}}}
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    (dst / "data").mkdir(parents=True, exist_ok=True)
    per = -(-len(rows) // files)
    for k in range(files):
        part = rows[k * per : (k + 1) * per]
        table = pa.table({
            "image": pa.array([{"bytes": f.read_bytes(), "path": f.name} for f, _ in part], kind),
            "label": pa.array([label for _, label in part], pa.int64()),
        }).replace_schema_metadata({"huggingface": json.dumps(meta)})  # fmt: skip
        pq.write_table(table, dst / "data" / f"{split}-{k:05d}-of-{files:05d}.parquet", row_group_size=100)


@pytest.fixture(scope="module")
def docs_env(tmp_path_factory):
    """The tiny data every page's folder starts with, a cache folder, and a lazily started S3 server."""
    from dali_fast import make_synthetic

    base = tmp_path_factory.mktemp("docs")
    template = base / "template"
    make_synthetic(template / "data" / "train", images=48, classes=4, seed=0, progress=False)
    make_synthetic(template / "data" / "val", images=16, classes=4, seed=1, progress=False)
    _write_shards(template / "data" / "train", template / "shards")
    _write_parquet(template / "data" / "train", template / "my-dataset", "train", 2)
    _write_parquet(template / "data" / "val", template / "my-dataset", "test", 1)
    env = {"base": base, "template": template, "cache": base / "cache", "pages": {}, "s3": None}
    yield env
    if env["s3"] is not None:
        env["s3"].stop()


def _s3(env: dict) -> str:
    """The local S3 server's endpoint, with the template's shards and snapshot in `s3://bucket/`."""
    if env["s3"] is None:
        from object_store import S3Server

        server = S3Server()
        server.client.create_bucket(Bucket="bucket")
        for shard in sorted((env["template"] / "shards").iterdir()):
            server.client.put_object(Bucket="bucket", Key=shard.name, Body=shard.read_bytes())
        for part in sorted((env["template"] / "my-dataset" / "data").iterdir()):
            server.client.put_object(Bucket="bucket", Key=f"my-dataset/data/{part.name}", Body=part.read_bytes())
        env["s3"] = server
    return env["s3"].endpoint


@pytest.fixture(scope="module")
def own_objects():
    """`model` and `optimizer`: the reader's own objects that snippets use without defining them."""
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812

    class TinyModel(pl.LightningModule):
        """Images -> 1000 logits; a LightningModule, so also a plain torch module."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 1000))

        def forward(self, x):
            return self.net(x.float())

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = TinyModel()
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def _page_dir(env: dict, page: str) -> Path:
    folder = env["pages"].get(page)
    if folder is None:
        folder = env["base"] / "pages" / page.replace("/", "_")
        shutil.copytree(env["template"], folder, copy_function=os.link)
        for name in ("benchmarks", "gpu_check", "scripts"):
            (folder / name).symlink_to(ROOT / name)
        env["pages"][page] = folder
        env[("ran", page)] = set()
    return folder


def _local_s3(env: dict, monkeypatch) -> None:
    """AWS_ENDPOINT_URL names the local S3 server; no file system of an earlier endpoint is reused (fsspec
    keeps one per set of options, the endpoint it read from the environment included)."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", _s3(env))
    s3fs.S3FileSystem.clear_instance_cache()


def _run_python(block: Block, folder: Path, env: dict, objects: dict, monkeypatch) -> None:
    import dali_fast

    monkeypatch.chdir(folder)
    monkeypatch.setenv("DALI_FAST_CACHE", str(env["cache"]))
    if "s3://" in block.code:
        _local_s3(env, monkeypatch)
    namespace = {"__name__": "__snippet__", **objects}
    try:
        exec(compile(small_python(block.code), block.id, "exec"), namespace)  # noqa: S102 - the docs' own code
    finally:
        for value in namespace.values():
            if isinstance(value, (dali_fast.DALIIterator, dali_fast.TorchIterator)):
                value.close()
        if "s3://" in block.code:  # fsspec keeps file systems per process, endpoint and all: leave none behind
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
        if "accelerate" in sys.modules:  # Accelerate keeps its state per process: leave none behind
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(reset_partial_state=True)  # noqa: SLF001


def _run_shell(block: Block, folder: Path, env: dict, monkeypatch, capsys) -> None:
    """`dali-fast ...` runs through the command's entry point (`dali_fast.cli:main`, what the installed
    script calls) in this process; `make` and `bash` run as processes."""
    from dali_fast.cli import main

    monkeypatch.chdir(folder)
    monkeypatch.setenv("DALI_FAST_CACHE", str(env["cache"]))
    if "s3://" in block.code:
        _local_s3(env, monkeypatch)
    for command in shell_commands(block.code):
        argv = small_command(command)
        if argv[0] == "dali-fast":
            capsys.readouterr()
            try:
                code = main(argv[1:])
            except SystemExit as e:  # argparse refused the command line
                code = e.code
            assert code == 0, f"{block.id}: `{shlex.join(argv)}` exited {code}:\n{capsys.readouterr().err[-3000:]}"
            continue
        proc = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (
            f"{block.id}: `{shlex.join(argv)}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
        assert proc.stdout.strip(), f"{block.id}: `{shlex.join(argv)}` printed nothing"


def _run(block: Block, env: dict, objects: dict, monkeypatch, capsys) -> None:
    folder = _page_dir(env, block.page)
    ran = env[("ran", block.page)]
    for earlier in [b for b in RUNNABLE if b.page == block.page and b.line < block.line and not b.not_run]:
        if earlier.line not in ran:  # this block was selected alone: set its folder up as the page does
            with pytest.MonkeyPatch.context() as mp, contextlib.suppress(pytest.xfail.Exception):
                _run(earlier, env, objects, mp, capsys)
    ran.add(block.line)
    if block.lang == "python":
        _run_python(block, folder, env, objects, monkeypatch)
    else:
        _run_shell(block, folder, env, monkeypatch, capsys)


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_snippet(block, docs_env, own_objects, monkeypatch, capsys):
    """Each Python and shell block of the docs runs as written (sizes made small) and succeeds."""
    if block.not_run:
        pytest.skip(f"not run: {block.not_run}")
    _run(block, docs_env, own_objects, monkeypatch, capsys)


# ---------------------------------------------------------------------------------------------- the blocks


def test_every_block_is_python_shell_or_output():
    unknown = [f"{b.id} ```{b.lang}" for b in BLOCKS if b.lang not in RUN_LANGS | OUTPUT_LANGS]
    assert not unknown, f"give each block a language (python, bash or text): {unknown}"
    assert len(RUNNABLE) >= 20, "the pages' blocks were not found"


def test_not_run_blocks_are_few_and_give_a_reason():
    marked = [b for b in BLOCKS if b.not_run]
    listing = "\n".join(f"  {b.id}: {b.not_run}" for b in marked)
    assert all(b.lang in RUN_LANGS for b in marked), f"only a python or bash block can be marked not run:\n{listing}"
    assert all(re.match(r"(needs|installs) ", b.not_run) for b in marked), f"say what it needs:\n{listing}"
    assert len(marked) <= MAX_NOT_RUN, f"{len(marked)} blocks are not run (at most {MAX_NOT_RUN}):\n{listing}"


# ---------------------------------------------------------------------------------------------- references

TEST_REF = re.compile(r"tests/((?:\w+/)*test_\w+\.py)(?:::(\w+)(?:::(\w+))?)?")
BARE_REF = re.compile(r"(?<![\w/])(test_\w+\.py)")


@functools.cache
def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


def test_every_test_the_docs_name_exists():
    """Each `tests/FILE.py::NAME` in the README and docs names a test that exists; bare file names are refused."""
    missing, bare, count = [], [], 0
    for page in PAGES:
        text = page.read_text()
        bare += [f"{page.name}: {m.group(1)}" for m in BARE_REF.finditer(text)]
        for m in TEST_REF.finditer(text):
            count += 1
            path = ROOT / "tests" / m.group(1)
            name = "::".join(x for x in m.group(2, 3) if x)
            if not path.is_file() or (name and name not in _defined(path)):
                missing.append(f"{page.name}: {m.group(0)}")
    assert not bare, f"write test references as tests/FILE.py::NAME: {bare}"
    assert not missing, f"the docs name tests that do not exist: {missing}"
    assert count >= 50, f"only {count} test references found"


def test_readme_is_at_most_12_kb_and_its_links_resolve():
    readme = ROOT / "README.md"
    assert len(readme.read_bytes()) <= 12 * 1024, f"README.md is {len(readme.read_bytes())} bytes"
    for page in (readme, ROOT / "docker" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"^[a-z]+:", target):
                assert (page.parent / target).exists(), f"{page.name}: the link to {target} leads nowhere"


# ---------------------------------------------------------------------------------------------- the CLI page


def _cli_rows() -> dict[str, dict[str, str]]:
    """docs/cli.md: section name -> {option: default cell}."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in (ROOT / "docs" / "cli.md").read_text().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), {})
        elif current is not None and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            for option in re.findall(r"--[\w-]+", cells[0]):
                current[option] = cells[1]
    return sections


def _default_cell(action) -> str | None:
    """What the page must say for an option's default; None where the parser's default is None."""
    import argparse

    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
        return "off"
    return None if action.default is None else str(action.default)


def test_cli_page_lists_every_option_with_its_default():
    from dali_fast.cli import build_parser

    rows = _cli_rows()
    recipe = rows.get("Recipe options (bench and train)", {})
    url = rows.get("URL options (train, bench, stages, inspect and pack)", {})
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - the CLI's own table
    problems = []
    for name, parser in commands.items():
        documented = {**rows.get(name, {}), **(recipe if name in ("bench", "train") else {})}
        documented |= url if name in ("train", "bench", "stages", "inspect", "pack") else {}
        options = set()
        for action in parser._actions:  # noqa: SLF001
            for option in action.option_strings:
                if not option.startswith("--") or option == "--help":
                    continue
                options.add(option)
                if option not in documented:
                    problems.append(f"{name} {option}: not on the page")
                    continue
                want = _default_cell(action)
                cell = documented[option]
                if want is None and re.match(r"^[\d.]+\b", cell):
                    problems.append(f"{name} {option}: the page says {cell!r}, the parser's default is None")
                elif want is not None and not re.match(rf"^{re.escape(want)}\b", cell):
                    problems.append(f"{name} {option}: the page says {cell!r}, the parser's default is {want!r}")
        problems += [f"{name} {o}: on the page, not in the parser" for o in rows.get(name, {}) if o not in options]
    assert not problems, problems
    assert "--verbose" in (ROOT / "docs" / "cli.md").read_text()


# ---------------------------------------------------------------------------------------------- Docker


def test_docker_readme_names_every_file_of_the_dependency_layer():
    """docker/README.md says which files the dependency layer is keyed on: exactly what its COPY brings in."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    first_copy = re.search(r"^COPY (.+)$", dockerfile, re.M).group(1).split()[:-1]
    text = (ROOT / "docker" / "README.md").read_text()
    paragraph = next(p for p in text.split("\n\n") if "own layer" in p)
    keyed = re.findall(r"`([^`]+)`", paragraph.split(":")[0])
    assert set(keyed) == set(first_copy), (keyed, first_copy)
