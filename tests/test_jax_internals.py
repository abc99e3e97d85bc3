"""jgraph's uses of JAX internals live in `jgraph/_jax_internals.py` only; `check()` proves each is
still there and names the one that moved."""

import pathlib
import re

import pytest
from jax._src import ad_util

import jgraph
from jgraph import _jax_internals


def test_every_internal_jgraph_relies_on_is_present():
    _jax_internals.check()


def test_a_moved_internal_is_named(monkeypatch):
    monkeypatch.delattr(ad_util, "Zero")
    with pytest.raises(ImportError, match=r"jax\._src\.ad_util\.Zero"):
        _jax_internals.check()


def test_no_other_module_imports_jax_internals():
    root = pathlib.Path(jgraph.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "_jax_internals.py"
                 and re.search(r"jax\._src|jax\.interpreters", p.read_text())]
    assert offenders == []
