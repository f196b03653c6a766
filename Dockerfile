# The project's one image: the control-plane services (docker-compose.yml sets each container's command), the agents
# and elasticctl (the Helm chart in deploy/helm/elastic/ runs all three from it).

# The build stage compiles the native snapshot copy (native/, setup.py) into the project's wheel: the slim image has
# no compiler, and without it every agent would copy snapshots in pure Python.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev zlib1g-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY native/ native/
COPY bus/ bus/
COPY job/ job/
COPY services/ services/
COPY agent/ agent/
COPY libworker/ libworker/
COPY elasticctl/ elasticctl/
COPY snapshot/ snapshot/
COPY slot_processes/ slot_processes/
COPY replication/ replication/
COPY slurm/ slurm/
RUN pip wheel --no-deps --wheel-dir /wheels . \
    && python -c "import sys, zipfile, glob; names = zipfile.ZipFile(glob.glob('/wheels/*.whl')[0]).namelist(); \
sys.exit(not any('snapshot/_snapcopy' in name for name in names))"

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CPU-only index (the default wheel pulls in CUDA), in its own layer so
# changes to the project do not reinstall it. The project's wheel below then finds torch satisfied.
# GPU agents need a CUDA build: docker build --build-arg TORCH_INDEX=<PyTorch's index of the CUDA build you run>.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url "$TORCH_INDEX"

WORKDIR /app
COPY --from=build /wheels/ /wheels/
RUN pip install /wheels/*.whl && rm -rf /wheels
# The examples, so that a job can be tried on a cluster as is (elasticctl run -- python examples/train.py).
COPY examples/ examples/

RUN useradd --create-home --uid 10001 --user-group elastic
# The registry's state directory and the keys compose makes: a named volume mounted on either starts with this owner.
RUN mkdir /state /keys && chown elastic:elastic /state /keys
USER elastic

# discovery, rendezvous, registry, notifier (ingest), notifier events (XPUB)
EXPOSE 5550-5554
# their Prometheus metrics (HTTP), in the same order, with --metrics-port
EXPOSE 9550-9553

# No CMD of our own: docker-compose.yml and the chart set `python -m elastic_control_plane.services.<name>`,
# elastic-agent or elasticctl.
