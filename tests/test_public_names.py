"""The public names: listed once (the stub ``hpx/__init__.pyi``), each loadable, none importing
torch before it is used, and the subpackages reachable as attributes as after an import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hpx

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "hpx" / "__init__.pyi"


def _stub_names() -> dict[str, str]:
    tree = ast.parse(STUB.read_text())
    return {a.asname: n.module for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}


def test_all_is_the_stubs_names_and_each_is_what_its_module_defines() -> None:
    names = _stub_names()
    assert sorted(hpx.__all__) == sorted(["__version__", *names])
    assert len(names) > 40
    for name, module in names.items():
        obj = getattr(hpx, name)
        if module == "hpx":
            assert obj.__name__ == f"hpx.{name}"
        else:
            assert obj is getattr(__import__(module, fromlist=[name]), name), name


def test_the_package_names_no_public_name_outside_the_stub() -> None:
    # the three lists (a lazy table, __all__, type-checking imports) that drifted are gone:
    # the package's own source holds no public name as a string or an import
    init = ast.parse((ROOT / "hpx" / "__init__.py").read_text())
    strings = {n.value for n in ast.walk(init) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    imported = {a.asname or a.name for n in ast.walk(init) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not (strings | imported) & set(_stub_names())
    # and the stub ships with the package
    data = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].split("[")[0:2]
    assert '"__init__.pyi"' in "[".join(data)


@pytest.mark.procs
def test_a_fresh_import_reaches_subpackages_without_loading_torch_first() -> None:
    code = ("import sys, hpx; assert 'torch' not in sys.modules; "
            "print(hpx.backends.InProcess.__name__, hpx.search.Stretch.__name__, hpx.knobs.Dropout.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["InProcess", "Stretch", "Dropout"]


@pytest.mark.parametrize("name", ["nothing", "_nothing", "Stretch"])
def test_a_name_that_is_not_public_is_an_attribute_error(name: str) -> None:
    with pytest.raises(AttributeError, match=repr(name)):
        getattr(hpx, name)
