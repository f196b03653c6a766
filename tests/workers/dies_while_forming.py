"""examples/train_elastic.py, except that the first process of local rank 1 on $DIE_ON_HOST to build a process group
SIGKILLs itself while it forms (the file $DIED_MARK records that it did, so its replacement trains). $DIE_AT says
when: `arrival` (the default), just before gloo connects the ranks: it reached the round's store and never publishes
its address; `connect`, when it first reads a peer's address: it published its own, and the peers wait for it to
connect."""

import os
import runpy
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from libworker.forming_store import AbortableStore

build_group = dist.init_process_group
read_address = AbortableStore.get


def die_once() -> None:
    mark = Path(os.environ["DIED_MARK"])
    if os.environ.get("ELASTIC_HOST") == os.environ["DIE_ON_HOST"] and os.environ.get("LOCAL_RANK") == "1":
        if not mark.exists():
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def init_process_group(*args, **kwargs):
    die_once()
    return build_group(*args, **kwargs)


def get(self, key):
    die_once()
    return read_address(self, key)


if os.environ.get("DIE_AT", "arrival") == "arrival":
    dist.init_process_group = init_process_group
else:
    AbortableStore.get = get
sys.argv[0] = str(Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py")
runpy.run_path(sys.argv[0], run_name="__main__")
