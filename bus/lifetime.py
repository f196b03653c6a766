"""Child processes that die with their parent (Linux PR_SET_PDEATHSIG), even when the parent is SIGKILLed.

`die_with_parent()` makes the `preexec_fn` of a `subprocess.Popen`: between
fork and exec the child asks the kernel for SIGKILL when its parent goes, and
kills itself at once if the parent is already gone (it died before the
request was made). The agent starts its workers this way, `elasticctl local`
its services and agents: none of them outlives the process that started it.
`alive(pid)` says whether a process lives (whoever it belongs to).
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> Callable[[], None]:
    """A preexec_fn for children of this process: each gets SIGKILL when this process dies."""
    parent = os.getpid()

    def arm() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def alive(pid: int) -> bool:
    """Whether process `pid` lives (one of another user's counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
