"""The documentation runs: every ```python block of the README and of docs/, page by page.

A page's blocks run in order in one namespace (they build on each other, as a reader runs them),
in a temporary folder, at the small sizes the pages use. A block that is deliberately not run is
preceded by a line `<!-- docs: not run (why) -->`; such blocks are rare and counted. Every fenced
block names its language, so that no python block escapes as an unnamed one.

Also: every public name of `jgraph` has an API reference entry (`::: path`, rendered from its
docstring by mkdocstrings, or a `### name` section) that documents that very object and holds an
example; the README is a front page under 8 KB opening with the two commands.
"""

import importlib
import pathlib
import re

import pytest

import jgraph as jg

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(<!-- docs: not run[^>]*-->\n)?```python\n(.*?)```", re.S)
LANGUAGES = {"python", "bash", "text"}
NOT_RUN_MAX = 2
COMMANDS = [  # the README's two commands, as main's README has them
    "python3 -m venv .venv && .venv/bin/pip install -e '.[demo]' && "
    ".venv/bin/python -m jgraph demo",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
    ".venv/bin/python -m pytest -q -n 2 tests",
]


def blocks(page):
    """[(not run, code)] of the page's python blocks, in order."""
    return [(bool(m.group(1)), m.group(2)) for m in FENCE.finditer(page.read_text())]


def _name(page) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_page"}
    for k, (skip, code) in enumerate(blocks(page)):
        if skip:
            continue
        try:
            exec(compile(code, f"{_name(page)}[block {k}]", "exec"), namespace)  # noqa: S102
        except Exception as e:
            raise AssertionError(f"{_name(page)}, block {k}:\n{code}") from e


def test_every_fence_names_a_known_language():
    for page in PAGES:
        opening = True
        for line in page.read_text().splitlines():
            if not line.lstrip().startswith("```"):
                continue
            if opening:
                language = line.lstrip()[3:].strip()
                assert language in LANGUAGES, (
                    f"{_name(page)}: a fence opening with {line.strip()!r}: name one of "
                    f"{sorted(LANGUAGES)} (python blocks run in this test)")
            opening = not opening


def test_not_run_blocks_are_rare():
    assert sum(skip for p in PAGES for skip, _ in blocks(p)) <= NOT_RUN_MAX


def _resolve(path: str):
    """The object a `::: path` entry documents, found as mkdocstrings finds it: the longest
    importable module prefix, then attributes (`jgraph.remat` is the module, not the function)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_every_public_name_has_a_reference_entry_with_an_example():
    text = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    for name in jg.__all__:
        entry = re.search(rf"(::: (jgraph(?:\.\w+)*\.{name})\n|### `{name}`\n)(.*?)"
                          rf"(?=\n::: |\n### |\Z)", text, re.S)
        assert entry, f"jg.{name} has no entry in docs/api/"
        if entry.group(2):
            assert _resolve(entry.group(2)) is getattr(jg, name), (
                f"docs/api's `::: {entry.group(2)}` is not jg.{name} (a module of that name?)")
        assert "```python" in entry.group(3), f"jg.{name}'s entry has no example"


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) < 8 * 1024, f"README.md is {len(readme)} bytes"
    assert readme.decode().splitlines()[2:5] == ["```bash", *COMMANDS]
