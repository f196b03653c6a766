"""The house rules CI checks on every change: ruff's linter and formatter agree with the tree."""

import shutil
import subprocess
import sys
import tomllib
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
    """Our own modules: third_party/ holds other projects' files, unmodified."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    modules = [path for path in listed.split() if not path.startswith(("bench/", "tests/", "third_party/"))]
    assert modules, "git ls-files listed no module"
    longer = {path: n for path in modules if (n := len((ROOT / path).read_text().splitlines())) > MODULE_LINE_LIMIT}
    assert not longer, f"modules over {MODULE_LINE_LIMIT} lines (as formatted): {longer}"


def test_every_package_folder_is_installed_under_one_of_our_two_import_names() -> None:
    """pyproject.toml lists its packages (libworker, and the rest under `elastic_control_plane`, from the folders the
    design names): a folder with an __init__.py that the list leaves out would be missing from every install."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in setuptools["package-dir"].items()}
    installed = set(setuptools["packages"])
    roots = [*folders, "libworker"]
    expected = set()
    for root in roots:
        for init in sorted((ROOT / root).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT).as_posix().split("/")
            prefix = folders.get(relative[0], relative[0])
            expected.add(".".join([prefix, *relative[1:]]))
    assert expected == installed, (sorted(expected - installed), sorted(installed - expected))
    assert {name.split(".")[0] for name in installed} == {"libworker", "elastic_control_plane"}


def test_the_docs_stand_alone_and_cite_no_design_document_outside_the_repository() -> None:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    cited = "DESIGN" + ".md"  # spelled apart, so this file does not cite it
    citing = [path for path in listed if path.endswith((".md", ".py")) and cited in (ROOT / path).read_text()]
    assert citing == [], f"these cite a {cited} the repository does not hold: {citing}"


def test_the_readme_is_a_five_minute_read() -> None:
    words = len((ROOT / "README.md").read_text().split())
    assert words <= 1200, f"README.md has {words} words: move detail into docs/"
