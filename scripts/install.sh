#!/usr/bin/env bash
# Install the project and its test dependencies. torch is pinned first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
# The editable install also builds the optional native snapshot copy (snapshot/_snapcopy*.so) when a C compiler and zlib are there.
python -m pip install --quiet -e '.[test]'
