#!/usr/bin/env bash
# Install the project and its test dependencies into a virtualenv, as users install: .venv/ beside this script's
# project (ELASTIC_VENV=DIR for another; made with `python3 -m venv` when it is not there). Then
# `. .venv/bin/activate` puts its python, elasticctl and elastic-agent on PATH.
# torch is pinned first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ELASTIC_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet torch==2.13.0
# The editable install also builds the optional native snapshot copy (snapshot/_snapcopy*.so) when a C compiler and zlib are there.
"$venv/bin/python" -m pip install --quiet -e '.[test]'
