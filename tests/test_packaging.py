"""The wheel: the product packages with the shipped default pair and prompts as package
data, no benchmarks or tests; unpacked away from the checkout, `load_default` finds its
files there."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("unified_kv", "pallas_kernels", "models", "drafter", "disagg")
SHIPPED = ("drafter/default_pair", "drafter/data")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Built offline from a copy of the checkout's sources (no build/ left in the tree)."""
    pytest.importorskip("setuptools", reason="pip install -e '.[test]' (setuptools)")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in (*PRODUCT, "benchmarks", "tests"):
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheel, = out.glob("unified_kv_dflash-*.whl")
    return wheel


def test_wheel_holds_the_product_and_its_data_only(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(PRODUCT)
    shipped = {str(p.relative_to(ROOT)) for d in SHIPPED for p in (ROOT / d).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped and shipped <= names, sorted(shipped - names)[:5]
    modules = {str(p.relative_to(ROOT)) for d in PRODUCT for p in (ROOT / d).rglob("*.py")}
    assert modules <= names, sorted(modules - names)[:5]


def test_installed_default_pair_loads_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import drafter.default as d, pathlib; "
            "assert pathlib.Path(d.__file__).is_relative_to(pathlib.Path(r'%s')); "
            "params, tcfg, dcfg = d.load_default(); prompts = d.load_prompts(); "
            "print(len(prompts), dcfg.block_size)" % site)
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert int(result.stdout.split()[0]) > 0
