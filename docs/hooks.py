"""MkDocs hooks for this site (`hooks:` in mkdocs.yml).

- `<!-- include PATH -->` on a line of its own puts a file of the repository there, so that the home page
  is README.md, the Docker page docker/README.md and the contributing page CONTRIBUTING.md, each kept in
  one place; their links into docs/ and to one another are rewritten to the pages of the site.
- `::: dali_fast.NAME` on the API page documents a public name where it is defined: the package's
  `__init__.py` is read (not imported, so neither torch nor DALI is needed) to find the module behind
  each name, lazy ones included, and the heading keeps the public name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dali_fast"
INCLUDE = re.compile(r"^<!-- include (\S+) -->$", re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
SITE_PAGES = {"docker/README.md": "docker.md", "CONTRIBUTING.md": "contributing.md"}  # files included as pages
IDENTIFIER = re.compile(r"^::: (dali_fast(?:\.\w+)+)[ \t]*$", re.M)


def _module_exists(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def public_names() -> dict[str, str]:
    """Each name `dali_fast` exports -> the module that defines it, read from `dali_fast/__init__.py`."""
    tree = ast.parse((ROOT / PACKAGE / "__init__.py").read_text())
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{PACKAGE}.{node.module}"
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "_HOME" for t in targets) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                module = ast.literal_eval(value)
                module = module[0] if isinstance(module, tuple) else module
                names[ast.literal_eval(key)] = f"{PACKAGE}.{module.lstrip('.')}"
    return names


def _resolve(match: re.Match) -> str:
    identifier = match.group(1)
    parts = identifier.split(".")
    if len(parts) == 2:  # a public name: document it in its defining module, under its public name
        module = public_names().get(parts[1])
        if module is None:
            raise PluginError(f"API page: {identifier} is not a name dali_fast exports (see dali_fast/__init__.py)")
        target = f"{module}.{parts[1]}"
    else:
        module, name = ".".join(parts[:-1]), parts[-1]
        if not _module_exists(module):
            raise PluginError(f"API page: {identifier}: no module {module} in the source tree")
        target = f"{module}.{name}"
    return f'::: {target}\n    options:\n      heading: "{identifier}"\n      toc_label: "{parts[-1]}"'


def _include(match: re.Match) -> str:
    source = ROOT / match.group(1)
    if not source.is_file():
        raise PluginError(f"include: {match.group(1)} is not a file of the repository")
    docs = ROOT / "docs"

    def relink(link: re.Match) -> str:
        target, anchor = link.group(1), link.group(2) or ""
        if re.match(r"^[a-z]+:", target):  # a URL
            return link.group(0)
        path = (source.parent / target).resolve()
        page = SITE_PAGES.get(path.relative_to(ROOT).as_posix()) if ROOT in path.parents else None
        if page is not None:
            return f"]({page}{anchor})"
        if docs in path.parents:
            return f"]({path.relative_to(docs).as_posix()}{anchor})"
        raise PluginError(f"include {match.group(1)}: the link to {target} has no page in the site")

    return LINK.sub(relink, source.read_text())


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    markdown = INCLUDE.sub(_include, markdown)
    return IDENTIFIER.sub(_resolve, markdown)
