"""The two exceptions elastic training code sees (Horovod's names in comments)."""

from __future__ import annotations


class WorkerInternalError(RuntimeError):
    """A collective failed (a peer died or hung, or the control plane aborted the round). HorovodInternalError.

    `@run` restores the last commit, re-joins and syncs.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """The host set changed; every rank raises it at the same commit. No rollback.

    `skip_sync` is True when hosts were only removed: every survivor already
    holds the live state (a new worker, if any, still receives it).
    """

    def __init__(self, skip_sync: bool) -> None:
        super().__init__(f"hosts updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


HorovodInternalError = WorkerInternalError


class CollectiveMismatchError(RuntimeError):
    """The ranks did not submit the same collective (shape, dtype, op, root, ... differ, or some never submitted it).

    Raised on every rank that submitted it, before any data moved: the next
    collective works. Not a WorkerInternalError: `@run` does not reset for it.
    """
