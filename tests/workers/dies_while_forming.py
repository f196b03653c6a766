"""examples/train_elastic.py, except that the first process of local rank 1 on $DIE_ON_HOST to build a process group
SIGKILLs itself just before gloo connects the ranks: it reached the round's store, and never publishes its address
(the file $DIED_MARK records that it did, so its replacement trains)."""

import os
import runpy
import signal
import sys
from pathlib import Path

import torch.distributed as dist

build_group = dist.init_process_group


def init_process_group(*args, **kwargs):
    mark = Path(os.environ["DIED_MARK"])
    if os.environ.get("ELASTIC_HOST") == os.environ["DIE_ON_HOST"] and os.environ.get("LOCAL_RANK") == "1":
        if not mark.exists():
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
    return build_group(*args, **kwargs)


dist.init_process_group = init_process_group
sys.argv[0] = str(Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py")
runpy.run_path(sys.argv[0], run_name="__main__")
