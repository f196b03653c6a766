"""The documented alerts (deploy/prometheus/alerts.yml) are valid Prometheus rules, and each fires on the series that
should raise it and not on the innocent ones beside it (promtool's own rule tests: tests/deploy/alerts_test.yml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RULES = HERE.parents[1] / "deploy" / "prometheus" / "alerts.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed (apt-get install prometheus; .ci/run installs it)")
    return found


@pytest.mark.parametrize(
    "args", [["check", "rules", str(RULES)], ["test", "rules", "alerts_test.yml"]], ids=["check", "test"]
)
def test_the_alert_rules(args: list[str]) -> None:
    done = subprocess.run([promtool(), *args], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
