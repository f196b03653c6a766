"""What a service keeps of its requests between messages, each bounded: the answers it gave and the ones it owes.

`ReplyCache` holds the latest replies by (sender, id), so that a retried request gets the same answer again. It
keeps at most `REPLY_CACHE_SIZE` replies and `REPLY_CACHE_BYTES` bytes, counted as the memory they hold (the frames
and what Python spends to keep them: `reply_cost`); a reply larger than `REPLY_CACHE_ENTRY_BYTES` is not kept (large
replies answer reads, which a retry runs again). Handlers a retry may simply run again (reads, heartbeats, the
agents' periodic wait reports: `handles(..., replayable=True)`, bus/service.py) keep no reply here at all.

`ParkingLot` holds the requests parked until their answer is known: at most `MAX_PARKED_PER_SENDER` of one owner
(a sender, or a host's own key whatever sender names it uses), `MAX_PARKED` in all and `MAX_PARKED_BYTES` of
messages. It says why one more may not park (`refusal`); refusing it is the service's business.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Generic, Protocol, TypeVar

# A retry is answered from the reply cache for as long as the reply stays in it: the busiest legitimate burst is a
# round of 32,768 ranks answered at once (4,096 hosts x 8), whose replies must outlive the clients' retries.
REPLY_CACHE_SIZE = 32768
# A join's answer is ~250 bytes and costs ~630 kept (reply_cost), so 32,768 of them take about 20 MiB; junk with large
# replies stops there.
REPLY_CACHE_BYTES = 24 * 1024 * 1024
# Replies above this answer reads (`since`, `hosts`, `status`, `job`): a retry runs them again instead.
REPLY_CACHE_ENTRY_BYTES = 64 * 1024
# An agent parks, at the rendezvous, one join and one key lookup per worker of its host: 512 slots per host.
MAX_PARKED_PER_SENDER = 1024
# A round change of 32,768 ranks parks 32,768 joins and 32,768 key lookups at once.
MAX_PARKED = 65536 + 8192
# A parked request keeps its message: legitimate ones are ~130 bytes (65,536 of them take ~8.5 MiB), junk may be MiBs.
MAX_PARKED_BYTES = 12 * 1024 * 1024
# One parked request's message at most: a join or a key lookup is ~130 bytes; one of MiBs would take the room of
# thousands, and a single sender could fill the lot for everyone (issue 58).
MAX_PARKED_REQUEST_BYTES = 64 * 1024
# What Python spends to keep a reply beside its frames' bytes, measured with tracemalloc (tests/unit/test_bounds.py):
# per reply, the key (a tuple of two strings), the value tuple, the frames' list and the cache's own entry; per frame,
# the bytes object's header.
REPLY_ENTRY_OVERHEAD_BYTES = 300
REPLY_FRAME_OVERHEAD_BYTES = 40


def reply_cost(frames: list[bytes]) -> int:
    """The memory a kept reply holds, in bytes: its frames and their keeping."""
    return REPLY_ENTRY_OVERHEAD_BYTES + sum(len(f) + REPLY_FRAME_OVERHEAD_BYTES for f in frames)


class ReplyCache:
    """The latest replies by (sender, id); past `entries` replies or `max_bytes` bytes the oldest are dropped."""

    def __init__(
        self,
        entries: int = REPLY_CACHE_SIZE,
        max_bytes: int = REPLY_CACHE_BYTES,
        entry_bytes: int = REPLY_CACHE_ENTRY_BYTES,
    ) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self.entry_bytes = entry_bytes
        self.nbytes = 0
        self._replies: OrderedDict[tuple[str, str], tuple[list[bytes], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replies)

    def get(self, key: tuple[str, str]) -> list[bytes] | None:
        kept = self._replies.get(key)
        return kept[0] if kept is not None else None

    def put(self, key: tuple[str, str], frames: list[bytes]) -> None:
        """Keep `frames` as the reply to `key`, unless keeping them costs more than `entry_bytes`."""
        size = reply_cost(frames)
        if size > self.entry_bytes:
            return
        previous = self._replies.pop(key, None)
        if previous is not None:
            self.nbytes -= previous[1]
        self._replies[key] = (frames, size)
        self.nbytes += size
        while len(self._replies) > self.entries or self.nbytes > self.max_bytes:
            _, (_, dropped) = self._replies.popitem(last=False)
            self.nbytes -= dropped


class Parkable(Protocol):
    """What the parking lot needs of a request: the size of its message in bytes, and whose share it takes."""

    size: int
    owner: str


ParkedRequest = TypeVar("ParkedRequest", bound=Parkable)


class ParkingLot(Generic[ParkedRequest]):
    """Parked requests by parking key (sender, id): at most `per_sender` of one owner, `total` in all, `max_bytes`
    of their messages, and none whose message is over `max_request_bytes`."""

    def __init__(
        self,
        per_sender: int = MAX_PARKED_PER_SENDER,
        total: int = MAX_PARKED,
        max_bytes: int = MAX_PARKED_BYTES,
        max_request_bytes: int = MAX_PARKED_REQUEST_BYTES,
    ) -> None:
        self.per_sender = per_sender
        self.total = total
        self.max_bytes = max_bytes
        self.max_request_bytes = max_request_bytes
        self.nbytes = 0
        self._requests: dict[tuple[str, str], ParkedRequest] = {}
        self._by_sender: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, key: tuple[str, str]) -> ParkedRequest | None:
        return self._requests.get(key)

    def refusal(self, owner: str, size: int) -> str | None:
        """Why one more request of `owner`, of `size` bytes, may not park now, or None when it may."""
        if size > self.max_request_bytes:
            return f"a request of {size} bytes may not wait here: a parked request is at most {self.max_request_bytes}"
        if len(self._requests) >= self.total:
            return f"{self.total} requests are parked already, the most this service keeps"
        if self.nbytes + size > self.max_bytes:
            return (
                f"parked requests hold {self.nbytes} bytes, and {size} more would exceed the {self.max_bytes} this "
                "service keeps"
            )
        if self._by_sender[owner] >= self.per_sender:
            return f"sender {owner!r} has {self.per_sender} requests parked already, the most one sender may"
        return None

    def park(self, key: tuple[str, str], request: ParkedRequest) -> None:
        self.unpark(key)
        self._by_sender[request.owner] += 1
        self.nbytes += request.size
        self._requests[key] = request

    def unpark(self, key: tuple[str, str]) -> None:
        request = self._requests.pop(key, None)
        if request is None:
            return
        self.nbytes -= request.size
        self._by_sender[request.owner] -= 1
        if not self._by_sender[request.owner]:
            del self._by_sender[request.owner]
