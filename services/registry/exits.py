"""WorkerExit: an agent's `worker_exited` report, read once at the door, and what the exit means for its slot.

The report names the slot (`host`, `local_rank`), the process (`pid`) and its
`exit_code`; `restarting`: the agent restarts the slot in place; `gave_up`:
why it stopped restarting a crash-looping slot (its host is blacklisted);
`after_script_end`: the worker's script had ended when it died;
`snapshot_commit`: the newest commit in the host's snapshot; `hung`: the
reason of the `kill_worker` the agent killed it for (services/registry/waits.py),
with `stack`, what the worker dumped of its threads' stacks (the last
MAX_STACK_BYTES are kept).

An exit with code 0 is a success. So is a death by a signal after the
worker's script ended (a crash in interpreter teardown: its work is done).
Anything else is a failure; its host stays (is not blacklisted) when the
agent restarts the slot in place and has not given up on it. A hung worker's
failure says so first (`hung: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_control_plane.bus.service import field
from elastic_control_plane.services.registry.reports import Slot

MAX_STACK_BYTES = 64 * 1024
MAX_HUNG_CHARS = 500
HUNG = "hung: "


@dataclass(frozen=True)
class WorkerExit:
    slot: Slot
    pid: int
    exit_code: Any  # an int from a well-behaved agent; whatever it is, it is shown as it came
    restarting: bool = False
    gave_up: str | None = None
    after_script_end: bool = False
    snapshot_commit: int = 0  # the newest commit in the host's snapshot (0: none)
    hung: str | None = None  # why it was killed as hung, starting with HUNG (None: it was not)
    stack: str = ""

    @classmethod
    def parse(cls, body: dict[str, Any]) -> WorkerExit:
        """The report in a request's body: a `bad_request` error without its host, local rank and pid; the optional
        fields of a wrong type count as absent."""
        slot = (field(body, "host", str), field(body, "local_rank", int))
        gave_up, commit, hung, stack = (body.get(name) for name in ("gave_up", "snapshot_commit", "hung", "stack"))
        return cls(
            slot=slot,
            pid=field(body, "pid", int),
            exit_code=body.get("exit_code"),
            restarting=body.get("restarting") is True,
            gave_up=gave_up if isinstance(gave_up, str) and gave_up else None,
            after_script_end=body.get("after_script_end") is True,
            snapshot_commit=commit if isinstance(commit, int) and not isinstance(commit, bool) and commit > 0 else 0,
            hung=_hung_reason(hung),
            stack=stack.encode()[-MAX_STACK_BYTES:].decode(errors="ignore") if isinstance(stack, str) else "",
        )

    @property
    def host_stays(self) -> bool:
        return self.restarting and not self.gave_up

    def success(self) -> str | None:
        """Why the exit counts as a success, or None when it is a failure."""
        if self.exit_code == 0:
            return "exited with code 0"
        if self.after_script_end and isinstance(self.exit_code, int) and self.exit_code < 0:
            return f"its script ended, then it died of signal {-self.exit_code} in interpreter teardown"
        return None

    def failure(self) -> str:
        """Why the exit is a failure, as the slot's report says it."""
        why = f"; {self.gave_up}" if self.gave_up else "; restarting in place" if self.host_stays else ""
        return f"{self.hung or f'exited with code {self.exit_code}'}{why}"


def _hung_reason(value: Any) -> str | None:
    """The reason a hung worker was killed for, as its failure begins (None: it was not killed as hung)."""
    if not isinstance(value, str) or not value:
        return None
    return (value if value.startswith(HUNG) else HUNG + value)[:MAX_HUNG_CHARS]
