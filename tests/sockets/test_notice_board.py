"""The notice board on real TCPStores (libworker.joining): what one rank posts another fetches, and a rank
whose round's store server froze (rank 0's host hung: SIGSTOP) never waits on it (no call of the board takes as
long as one store call to the frozen server: the client's timeout at the least); the board's thread ends once the
frozen server's process dies and the round is over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from libworker.joining import STEP, Notice, NoticeBoard
from testing.harness import wait_for

SERVE_A_STORE = (
    "import sys, time; import torch.distributed as dist; "
    "store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); print(store.port, "
    "flush=True); time.sleep(300)"
)


STORE_TIMEOUT = timedelta(seconds=3)


def _client(port: int) -> dist.Store:
    return dist.PrefixStore("round-7/", dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT))


@pytest.fixture
def server() -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen([sys.executable, "-c", SERVE_A_STORE], stdout=subprocess.PIPE, text=True)
    try:
        process.port = int(process.stdout.readline())  # type: ignore[attr-defined]
        yield process
    finally:
        process.kill()
        process.wait()


def _board_threads() -> int:
    return sum(thread.name == "join-notices" for thread in threading.enumerate())


def test_a_notice_posted_by_one_rank_is_fetched_and_answered_by_another(server: subprocess.Popen[str]) -> None:
    joiner, waiter = NoticeBoard(_client(server.port)), NoticeBoard(_client(server.port))  # type: ignore[attr-defined]
    try:
        joiner.announce(Notice(rank=1, operations=41))

        def fetched() -> bool:
            waiter.refresh()
            return waiter.notices == [Notice(1, 41)]

        wait_for(fetched, 10, "the notice at the waiting rank")
        waiter.answer(42, STEP + "optimizer.0")

        def answered() -> bool:
            joiner.refresh(answer_to=42)
            return joiner.answers.get(42) == "step:optimizer.0"

        wait_for(answered, 10, "the answer at the joining rank")
    finally:
        joiner.close()
        waiter.close()


def test_a_frozen_store_server_never_holds_up_a_rank(server: subprocess.Popen[str]) -> None:
    before = _board_threads()
    board = NoticeBoard(_client(server.port))  # type: ignore[attr-defined]
    board.announce(Notice(rank=0, operations=3))
    wait_for(lambda: board.refresh() or board.notices, 10, "the board to reach its live server")
    os.kill(server.pid, signal.SIGSTOP)
    try:
        calls: list[Callable[[], None]] = []
        for operation in range(20):
            calls.append(lambda o=operation: board.answer(o, STEP + "optimizer.0"))
            calls.append(lambda o=operation: board.refresh(answer_to=o))
            calls.append(lambda o=operation: board.announce(Notice(rank=0, operations=o)))
        slowest = 0.0
        for call in calls:
            started = time.monotonic()
            call()
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < STORE_TIMEOUT.total_seconds(), (
            f"a call took {slowest:.2f}s, as long as a store call that waits for the frozen server"
        )
        board.close()
        assert _board_threads() == before + 1, "the board's thread is caught in a call to the frozen server"
    finally:
        os.kill(server.pid, signal.SIGKILL)
    wait_for(lambda: _board_threads() == before, 20, "the board's thread to end once the frozen server died")
