"""The stores a torchrun-mode job's rounds bootstrap from, served outside their commands (torchrun's agent store).

`python -m elastic_control_plane.slot_processes.round_store ADDRESS` imports torch.distributed and waits. For each line
`next` on its stdin it serves a new TCPStore on ADDRESS at a free port, prints the port on one line, and drops the store
it served before (that round's commands were stopped before the next round formed); it exits when its stdin closes or
its supervisor dies. A slot's supervisor (slot_processes/torchrun_slot.py) keeps one for the job and asks it for the
store of each round in which the slot holds rank 0; the round's commands connect to it as clients
(`TORCHELASTIC_USE_AGENT_STORE=True`), as torchrun's workers connect to their agent's store, which torch 2.13 also makes
anew for each attempt. So no command serves a store its peers still use when it exits.
"""

from __future__ import annotations

import sys
from datetime import timedelta

from elastic_control_plane.slot_processes.bound_store import serve_store


def main() -> None:
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    current = None
    for line in sys.stdin:
        if line.strip() != "next":
            continue
        current = serve_store(address, timedelta(seconds=60))
        sys.stdout.write(f"{current.port}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
