"""docker/: the image installs what pyproject.toml and the README say, and starts a command that exists.

No Docker engine runs here: these checks keep the Dockerfile buildable by construction. hadolint
lints it in `make test` (see the Makefile's lint target).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from dali_fast.cli import build_parser

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += " " + line.removesuffix("\\").strip()
        if line.endswith("\\"):
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def pip_installs() -> list[list[str]]:
    """Each `pip install ...` command in the RUN instructions, as argument lists (ARGs substituted)."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), re.M))
    cmds = []
    for word, rest in instructions():
        if word != "RUN":
            continue
        for part in re.split(r"&&|;", rest):
            words = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), part))
            if words[:2] == ["pip", "install"]:
                cmds.append(words[2:])
    return cmds


def dockerignore() -> set[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return {x.strip() for x in lines if x.strip() and not x.startswith("#")}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def req_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_base_image_is_a_pinned_cuda12_cudnn_runtime_on_ubuntu_lts():
    (base,) = [rest for word, rest in instructions() if word == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-cudnn-runtime-ubuntu(22|24)\.04", base), base


def test_requirements_come_from_pyproject_without_drift():
    deps = {req_name(r): r for r in pyproject()["project"]["dependencies"]}
    cmds = pip_installs()
    # The project itself is installed from the copied pyproject.toml: its dependencies are exactly pyproject's.
    assert any(c == [".[opencv]"] for c in cmds), cmds  # the image has the opencv extra
    assert any(c == ["--no-deps", "."] for c in cmds), cmds
    copies = [rest.split() for word, rest in instructions() if word == "COPY"]
    assert ["pyproject.toml", "README.md", "./"] in copies
    # Anything named explicitly must be a pyproject dependency with the same specifier.
    named = [w for c in cmds for w in c if not w.startswith("-") and not w.startswith(".") and not w.startswith("http")]
    assert named, "the Dockerfile installs torch's CUDA build explicitly"
    for req in named:
        assert req_name(req) in deps, f"{req} is not a dependency in pyproject.toml"
        assert req.replace(" ", "") == deps[req_name(req)].split(";")[0].replace(" ", ""), (req, deps[req_name(req)])
    assert "requirements" not in DOCKERFILE.read_text()


def test_install_commands_are_the_readmes():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"On a GPU machine.*?```bash\n(.*?)```", readme, re.S)
    assert block, "README has the GPU install block"
    readme_pips = [shlex.split(x)[2:] for x in block.group(1).splitlines() if x.startswith("pip install")]
    assert len(readme_pips) == 2
    docker_pips = pip_installs()
    for cmd in readme_pips:
        assert cmd in docker_pips, f"README's `pip install {' '.join(cmd)}` is not what the Dockerfile runs"


def test_dependency_layer_comes_before_the_code():
    steps = instructions()
    index = {i: (w, r) for i, (w, r) in enumerate(steps)}
    deps_at = next(i for i, (w, r) in index.items() if w == "RUN" and "pip install \".[opencv]\"" in r)
    code_at = next(i for i, (w, r) in index.items() if w == "COPY" and r.startswith("dali_fast"))
    assert deps_at < code_at
    assert not any(w == "COPY" and r.split()[0] in (".", "./") for w, r in steps), "no COPY of the whole context"


def test_entrypoint_command_and_healthcheck_exist():
    steps = dict((w, r) for w, r in instructions())
    entry, cmd = json.loads(steps["ENTRYPOINT"]), json.loads(steps["CMD"])
    assert entry == ["dali-fast"] and cmd == ["bench"]
    assert pyproject()["project"]["scripts"]["dali-fast"] == "dali_fast.cli:main"
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - the CLI's own table
    assert "bench" in commands and "doctor" in commands
    health = json.loads(steps["HEALTHCHECK"].split("CMD", 1)[1])
    assert health[:2] == ["dali-fast", "doctor"]
    assert build_parser().parse_args(health[1:]).command == "doctor"


def test_runs_as_a_non_root_user_in_a_workdir():
    steps = instructions()
    users = [r for w, r in steps if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    workdirs = [r for w, r in steps if w == "WORKDIR"]
    assert workdirs and all(w.startswith("/") for w in workdirs)


def test_dockerignore_keeps_the_context_small():
    ignored = dockerignore()
    for path in (".git", ".venv", "tests"):
        assert path in ignored


def test_docker_readme_says_it_is_not_built_in_ci():
    text = (ROOT / "docker" / "README.md").read_text()
    assert "Not built in CI" in text and "--gpus all" in text


def _build_wheel(ctx: Path, out: Path) -> Path:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ctx)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("dali_fast-*.whl")
    return wheel


@pytest.mark.slow
def test_what_the_image_copies_builds_the_package(tmp_path):
    """Both pip steps of the image, on exactly the files its COPY lines bring in (and .dockerignore lets through)."""
    import shutil
    import zipfile

    ignored = dockerignore()
    copies = [rest.split() for word, rest in instructions() if word == "COPY"]
    # Step 1: the dependency layer sees pyproject.toml and README.md, plus a stand-in package.
    deps_ctx = tmp_path / "deps"
    deps_ctx.mkdir()
    for src in copies[0][:-1]:
        assert src not in ignored and (ROOT / src).is_file(), src
        shutil.copy(ROOT / src, deps_ctx / src)
    (deps_ctx / "dali_fast").mkdir()
    (deps_ctx / "dali_fast" / "__init__.py").touch()
    _build_wheel(deps_ctx, tmp_path / "w1")
    # Step 2: the code layer adds dali_fast/ to the same folder.
    code_ctx = deps_ctx
    shutil.rmtree(code_ctx / "dali_fast")
    for src in copies[1][:-1]:
        assert src not in ignored
        shutil.copytree(ROOT / src, code_ctx / src, ignore=shutil.ignore_patterns("__pycache__"))
    wheel = _build_wheel(code_ctx, tmp_path / "w2")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        assert "dali-fast = dali_fast.cli:main" in z.read(entry).decode()
    modules = {f"dali_fast/{p.name}" for p in (ROOT / "dali_fast").glob("*.py")}
    assert modules <= names, modules - names
