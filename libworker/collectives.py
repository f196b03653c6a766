"""The abortable core under every collective: issue on torch.distributed, wait without ever hanging a survivor.

Every operation is issued asynchronously (`launch`) and waited for (`finish`)
in short slices, so a wait ends as soon as the operation completes (no extra
thread, no callback: the cost of a raw `work.wait()`), when the control plane
aborts the round (a peer failed or hung), or at the collective timeout,
whichever comes first; between slices the caller's `while_stuck` runs (a
rank waiting where a peer that called join() may need its answer gives
libworker.joining's `answer_joiners`). Every wait is written to the worker's
wait record (slot_processes.wait_record), which its agent reads.
NCCL work on CUDA tensors is waited for on the stream, as torch does, and is
ended by aborting the communicator (see world.abort).
Any transport error, abort or timeout raises WorkerInternalError and marks the
round's process group as abandoned. `Started` holds what one operation
launched: its works, and how to make its result once they have ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from libworker import torch_compat
from libworker.errors import WorkerInternalError
from libworker.world import require_joined, world

WAIT_SLICE = timedelta(milliseconds=20)


def fail(reason: str) -> WorkerInternalError:
    """Mark the round's process group as abandoned and build the error the caller raises."""
    world.poisoned = True
    return WorkerInternalError(f"round {world.round}: {reason}")


def launch(issue: Callable[[], Any]) -> Any:
    """Issue one asynchronous torch.distributed operation (a callable returning its Work) in the current round."""
    require_joined()
    if world.aborted_round == world.round:
        raise fail("aborted by the control plane")
    try:
        work = issue()
    except (RuntimeError, dist.DistError) as exc:
        raise fail(f"collective failed: {exc}") from None
    world.track(work)
    return work


def _nothing_to_do() -> None:
    """A wait that no peer needs an answer from."""


def finish(work: Any, on_stream: bool = False, while_stuck: Callable[[], None] = _nothing_to_do) -> None:
    """Wait for a launched Work, an abort of its round, or the collective timeout; `while_stuck` runs between
    slices.

    `on_stream`: the work is NCCL on CUDA tensors; waiting makes the current
    stream wait for it, which returns at once (an abort ends the communicator).
    """
    if not on_stream:
        _wait_in_slices(work, while_stuck)
        return
    try:
        work.wait()
    except (RuntimeError, dist.DistError) as exc:
        raise fail(f"collective failed: {exc}") from None


def _wait_in_slices(work: Any, while_stuck: Callable[[], None]) -> None:
    """Wait slice by slice; between slices, `while_stuck` runs."""
    round_number = world.round
    deadline = time.monotonic() + world.timing.collective_timeout + 5.0
    with world.waits.waiting():
        while not _ended_within_a_slice(work):
            if world.aborted_round == round_number:
                raise fail("aborted by the control plane (a peer failed)")
            if timed_out(deadline):
                raise fail(f"collective did not finish within {world.timing.collective_timeout:g}s")
            while_stuck()


def timed_out(deadline: float) -> bool:
    """Is a wait for the others past its deadline, with nobody judging the rank it waits for? While the registry
    judges that rank (busy, or inside a wait it declared), its agent excuses the wait: the judgement bounds it."""
    return time.monotonic() > deadline and not world.waits.excused()


def _ended_within_a_slice(work: Any) -> bool:
    """True when `work` ended within one slice, False when the slice ran out; WorkerInternalError when it ended in
    error."""
    try:
        return torch_compat.ended_within(work, WAIT_SLICE)
    except (RuntimeError, dist.DistError) as exc:
        raise fail(f"collective failed: {exc}") from None


def waits_on_stream(tensor: torch.Tensor) -> bool:
    """NCCL work on a CUDA tensor is waited for on the stream, not on the host."""
    return tensor.is_cuda and world.uses_nccl()


def run_collective(
    issue: Callable[[], Any], on_stream: bool = False, while_stuck: Callable[[], None] = _nothing_to_do
) -> None:
    """Issue and wait: the synchronous form of every collective."""
    finish(launch(issue), on_stream, while_stuck)


@dataclass(frozen=True)
class Started:
    """What a launcher started: works to wait for, and how to make the result once they are done."""

    works: list[Any]
    result: Callable[[], Any]
    on_stream: bool = False

    def wait(self) -> None:
        """Wait for every work, as `finish` does."""
        for work in self.works:
            finish(work, self.on_stream)
