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
