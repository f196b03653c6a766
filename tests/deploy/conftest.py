"""The chart's tests: a real helm (scripts/k8s-tools.sh installs it into the virtualenv; when it cannot, every test
here fails, none skips) and the chart rendered once per ci/*-values.yaml."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "elastic"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "elastic"
NAMESPACE = "default"


@functools.cache
def helm_binary() -> Path:
    venv = Path(sys.prefix)
    result = subprocess.run(
        [str(REPO / "scripts" / "k8s-tools.sh")],
        env={**os.environ, "ELASTIC_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(f"scripts/k8s-tools.sh could not install helm:\n{result.stderr}", pytrace=False)
    return venv / "bin" / "helm"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stderr}", pytrace=False)
    return result


# The chart's defaults with the one value they lack, the keys' Secret (what deploy/k8s/elastic.yaml holds).
DEFAULTS = CHART / "ci" / "defaults-values.yaml"


@functools.cache
def render_text(values: str | None = None, *sets: str) -> str:
    """`helm template` with a values file (None: DEFAULTS) and --set items."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", values or str(DEFAULTS)]
    for item in sets:
        args += ["--set", item]
    return helm(*args).stdout


def render(values: str | None = None, *sets: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_text(values, *sets)) if doc]


@pytest.fixture(params=[str(path) for path in CI_VALUES], ids=[path.name for path in CI_VALUES])
def ci_values(request: pytest.FixtureRequest) -> str:
    return request.param


def assert_ci_values_found() -> None:
    names = {path.name for path in CI_VALUES}
    expected = {
        f"{name}-values.yaml"
        for name in ("cpu", "gpu", "single-host", "replicated", "daemonset", "defaults", "gke", "eks")
    }
    assert expected <= names, f"missing ci values files: {sorted(expected - names)}"
