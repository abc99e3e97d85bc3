"""Every fenced python block of the README and of docs/ runs, page by page, in one namespace per
page (a page's blocks build on each other, as a reader runs them). A block that is deliberately not
run is preceded by a line `<!-- docs: not run (why) -->`; such blocks are rare and counted.
Also: every public name of `jgraph` has an API reference entry with an example."""

import pathlib
import re

import pytest

import jgraph as jg

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(<!-- docs: not run[^>]*-->\n)?```python\n(.*?)```", re.S)
# Pages whose blocks are fragments of a user's own code: names they read are defined here, small.
PRELUDE = {}
NOT_RUN_MAX = 12


def blocks(page):
    return [(bool(m.group(1)), m.group(2)) for m in FENCE.finditer(page.read_text())]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_page"}
    exec(PRELUDE.get(page.name, ""), namespace)
    for k, (skip, code) in enumerate(blocks(page)):
        if skip:
            continue
        try:
            exec(compile(code, f"{page.name}[block {k}]", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(ROOT)}, block {k}:\n{code}") from e


def test_not_run_blocks_are_rare():
    assert sum(skip for p in PAGES for skip, _ in blocks(p)) <= NOT_RUN_MAX


def test_every_public_name_has_a_reference_entry_with_an_example():
    text = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    for name in jg.__all__:
        entry = re.search(rf"(::: jgraph\.{name}\n|### `{name}`\n)(.*?)(?=\n::: |\n### |\Z)",
                          text, re.S)
        assert entry, f"jg.{name} has no entry in docs/api/"
        assert "```python" in entry.group(2), f"jg.{name}'s entry has no example"


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) < 8 * 1024
    assert readme.decode().splitlines()[2:5] == [
        "```bash",
        "python3 -m venv .venv && .venv/bin/pip install -e '.[demo]' && .venv/bin/python -m jgraph demo",
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -q -n 2 tests",
    ]
