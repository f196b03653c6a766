"""What a rendered pod's container sees of its Secrets, on this machine: each secret or projected volume it mounts is
made a directory of the test's own holding exactly the items the chart maps (so a pod that needs a file its role is
not given fails here as it would in a cluster), and the container's arguments and environment name those directories
instead of the mount paths."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from elastic_control_plane.bus.sockets import generate_keys
from elastic_control_plane.replication.etcd_tls import ETCD_DIR, make_etcd_certs

KEYS_SECRET, ETCD_TLS_SECRET = "elastic-keys", "elastic-etcd-tls"

# The pods' identities (services/discovery/pod_identity.py): left out where no API server reviews them.
POD_IDENTITY_ENV = ("ELASTIC_KUBERNETES_TOKEN_AUDIENCE", "ELASTIC_KUBERNETES_AGENT_ACCOUNT", "ELASTIC_POD_TOKEN_FILE")


def make_secrets(directory: Path, etcd_hosts: list[str]) -> dict[str, Path]:
    """The two Secrets the chart's docs have an operator make (`elasticctl keys generate DIR --etcd-host ...`, then one
    Secret from DIR and one from DIR/etcd): Secret name -> the directory whose files are its keys."""
    generate_keys(directory)
    make_etcd_certs(directory, etcd_hosts)
    return {KEYS_SECRET: directory, ETCD_TLS_SECRET: directory / ETCD_DIR}


def _sources(volume: dict[str, Any]) -> list[dict[str, Any]]:
    if "secret" in volume:
        return [{"name": volume["secret"]["secretName"], "items": volume["secret"]["items"]}]
    if "projected" in volume:
        return [source["secret"] for source in volume["projected"]["sources"] if "secret" in source]  # not a token
    return []


def mount_secrets(
    pod: dict[str, Any], container: dict[str, Any], secrets: dict[str, Path], root: Path
) -> dict[str, str]:
    """Copy the items of each Secret volume `container` mounts under `root`; mountPath -> local directory."""
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        sources = _sources(volumes.get(mount["name"], {}))
        if not sources:
            continue
        local = root / mount["name"]
        shutil.rmtree(local, ignore_errors=True)
        for source in sources:
            for item in source["items"]:
                target = local / item["path"]
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                shutil.copyfile(secrets[source["name"]] / item["key"], target)
                os.chmod(target, 0o400)
        mounts[mount["mountPath"]] = str(local)
    return mounts


def on_this_machine(text: str, mounts: dict[str, str]) -> str:
    """A rendered argument or environment value with each mount path replaced by its local directory."""
    for path, local in mounts.items():
        if text == path or text.startswith(path + "/"):
            return local + text[len(path) :]
        text = text.replace(f"={path}/", f"={local}/")
    return text
