#!/usr/bin/env bash
# Render the Helm chart into plain manifests for users without helm (kubectl apply -f deploy/k8s/FILE):
#   deploy/k8s/elastic.yaml     the default values (single-host control plane, 2 CPU agents), keys from Secret
#                               elastic-keys
#   deploy/k8s/replicated.yaml  the replicated control plane (3 etcd members, 2 replicas of each service), keys from
#                               Secret elastic-keys and etcd's certificates from Secret elastic-etcd-tls
# Make the Secrets first (docs/security.md).
# Both for release "elastic" in namespace "default" (the replicated layout's host names carry the namespace).
# helm comes from scripts/k8s-tools.sh; the tests check these files equal a fresh render (deploy/render.sh DIR renders
# into DIR instead).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ELASTIC_VENV:-.venv}"
scripts/k8s-tools.sh
helm="$venv/bin/helm"
chart=deploy/helm/elastic
out="${1:-deploy/k8s}"
header="# Rendered from $chart by deploy/render.sh: edit the chart, then run deploy/render.sh."
render() {
    local out="$1"
    shift
    { echo "$header"; "$helm" template elastic "$chart" --namespace default "$@"; } >"$out.partial"
    mv "$out.partial" "$out"
}
render "$out/elastic.yaml" -f "$chart/ci/defaults-values.yaml"
render "$out/replicated.yaml" -f "$chart/ci/defaults-values.yaml" --set controlPlane.layout=replicated \
    --set security.etcdTlsSecret=elastic-etcd-tls
