"""The house rules CI checks on every change: ruff's linter and formatter agree with the tree."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    command = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if command is None:
        pytest.fail("ruff is not installed: pip install -e .[test] installs the pinned version")
    return subprocess.run([command, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_linter_finds_nothing():
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_is_formatted():
    result = ruff("format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


MODULE_LINE_LIMIT = 400


def test_no_module_outside_bench_and_tests_is_longer_than_the_limit():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    modules = [path for path in listed.split() if not path.startswith(("bench/", "tests/"))]
    assert modules, "git ls-files listed no module"
    longer = {path: n for path in modules if (n := len((ROOT / path).read_text().splitlines())) > MODULE_LINE_LIMIT}
    assert not longer, f"modules over {MODULE_LINE_LIMIT} lines (as formatted): {longer}"
