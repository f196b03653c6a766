"""A torchrun script that records what its launcher set: it joins the process group from the environment (as DDP scripts
do), checks it with an allreduce, and writes its torchrun variables to OUT_DIR/rank-RANK-restart-N.json. With CRASH_RANK
set, that rank then exits 1 while the others wait for it (a script that fails in every round). Usage: torchrun_env.py
OUT_DIR"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
)

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
seen = {name: os.environ.get(name) for name in NAMES}
seen["allreduce"] = total.item()
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / f"rank-{seen['RANK']}-restart-{seen['TORCHELASTIC_RESTART_COUNT']}.json").write_text(json.dumps(seen))
if os.environ.get("CRASH_RANK") == seen["RANK"]:
    sys.exit(1)
dist.barrier()
dist.destroy_process_group()
