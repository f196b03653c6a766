"""RendezvousService: creates rounds, parks joins until a round is complete, serves the job's key-value store.

Messages:
- new_round {hosts: [[name, slots | [slot ids]]], min_np, max_np, hosts_timestamp, replaces, round} -> {round, size,
  hosts, hosts_timestamp}. hosts: the round's, as job.assignments.round_hosts writes them; round: the number the caller
  expects it to get: asked for a round that exists (the caller gave up waiting and asks again), that round is the
  answer, as it is; answered before the joins it releases; replaces: a round still forming that this one replaces
  (refused, `released`, once that round is released).
- enter_round {host, slots: [[local_rank, after_round, pid]]} (parked) -> {answers: [[local_rank, pid, SlotInfo +
  {round, prefix, hosts_timestamp, snapshot_writer} | {removed, round}]]}: one per host, for all of its slots whose
  processes wait for a round (agent/round_entry.py); each slot is a parked join. Answered as soon as any of its
  slots has an answer, with every answer due then; its other slots leave the parking lot and come back in the host's
  next entry. A newer entry of the host replaces a parked one (answered with no answers); an empty one withdraws it.
  A slot the host does not have (by the latest round's host list) is refused, `no_such_slot`.
- forget {host, local_rank, pid}: drop the parked join of a worker that exited.
- status {round, rejoins_from, pids} -> {round, released, size, parked, pids, rejoins: [[host, local_rank, pid,
  after_round]], rejoins_next, quota_refused: {host: keys}}. parked: how many joins are parked; rejoins: the joins of
  the latest round's workers for the next round, parked since cursor `rejoins_from` of round `round` (a cursor of
  another round than the latest: all of them), then ask from `rejoins_next`; pids: the released round's workers
  [[host, local_rank, pid]], unless pids is false.
- restore_round {round, hosts, hosts_timestamp, released, pids: [[host, local_rank, pid]]}: the registry gives a
  restarted rendezvous the job's round.
- reset: a new job: no rounds, empty store.
- kv_set {key, host} + value frame; kv_get {key} (parked until set) -> value frame. A round's key is set only with
  the name of the host that holds its rank 0 (its agent sends the round's store address), else `forbidden`.

The key-value store carries what a round needs to bootstrap torch.distributed (the address of the round's TCPStore),
under the round's prefix, and nothing else: a key outside every round's prefix (`round/N/`) is refused
(`not_a_round_key`), so every key goes with its round. The keys of rounds older than the previous one are dropped,
and lookups still waiting for them are refused (`stale_round`). A round's keys are set by its rank 0's host alone, at
most `MAX_KV_KEYS_PER_ROUND` of them: past that its host is refused (`quota`, logged with the host, and counted by
host in `status`'s `quota_refused`), and neither another round nor another host is (a host that set junk keys once
kept every later round from forming). The store is bounded besides: past `MAX_KV_KEYS` keys, `MAX_KV_KEY_BYTES` per
key, `MAX_KV_VALUE_BYTES` per value or `MAX_KV_WAITERS` waiting lookups a request is refused (`too_many_keys`,
`key_too_long`, `value_too_large`, `too_many_waiters`).

Replicated (`--store etcd://...`), the store is kept in etcd as well
(services/rendezvous/kv_log.py), written before a value is acknowledged, and a
replica that takes over starts with it. Until the registry gives it the job's
round back, it parks lookups of any round's key rather than refusing them as
stale, and refuses every key's setting for now (`unavailable`: rank 0 sends
its store's address again), since it cannot yet tell whose round it is.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from elastic_control_plane.bus.roles import AGENT, OPERATOR, SERVICE
from elastic_control_plane.bus.service import DEFERRED, LimitExceeded, Request, RequestError, Service, field, handles
from elastic_control_plane.job.assignments import MAX_SLOTS_PER_HOST, NotEnoughSlots, get_host_assignments, round_hosts
from elastic_control_plane.services.rendezvous.bodies import parse_hosts
from elastic_control_plane.services.rendezvous.kv_log import KvLog, KvLogError
from elastic_control_plane.services.rendezvous.rounds import Join, Round, Rounds

# A round needs one key (its TCPStore's address) and the keys of two rounds are kept: a round may hold a few more
# (its host's quota), and the store at most MAX_KV_KEYS whatever happens.
MAX_KV_KEYS = 1024
MAX_KV_KEYS_PER_ROUND = 16
# Keys are short paths such as `round/12/store`.
MAX_KV_KEY_BYTES = 256
# A value is an address (`host:port`); 4 KiB leaves room for a small blob and keeps the store under 5 MiB.
MAX_KV_VALUE_BYTES = 4096
# Every rank of a round waits for its round's store address at once: rounds of up to 65,536 ranks.
MAX_KV_WAITERS = 65536
LOGGED_HOSTS = 20  # a log line or error names at most this many hosts
QUOTA_HOSTS_KEPT = 64  # hosts whose keys refused past a round's quota are counted (the latest ones)


class RendezvousService(Service):
    name = "rendezvous"

    def __init__(self, endpoint: str, kv_log: KvLog | None = None, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self.rounds = Rounds()
        self.quota_refused: dict[str, int] = {}  # by host: keys refused past a round's quota, for `status`
        self.kv_log = kv_log
        self._left_in_etcd: set[str] = set()  # prefixes of rounds over whose keys etcd still holds
        self.kv: dict[str, bytes] = kv_log.load() if kv_log is not None else {}
        self.kv_waiters: dict[str, list[Request]] = defaultdict(list)
        self.kv_waiting = 0
        self.host_entries: dict[str, Request] = {}  # each host's parked join
        self.host_slot_counts: dict[str, int] = {}  # the hosts' slot counts, from the latest round's host list

    # -- rounds --------------------------------------------------------------------------------
    @handles("reset", roles=(SERVICE,))
    def on_reset(self, request: Request) -> dict[str, Any]:
        """A new job: the keys' clear is written first (refused: `unavailable`, nothing changed), then the rounds,
        the parked entries and the key lookups of the old job end."""
        if self.kv_log is not None:
            self._log_write(self.kv_log.clear)
        for request in self.host_entries.values():
            request.fail("job_reset", "a new job replaced the one this host's workers joined")
        self.host_entries.clear()
        self.rounds, self.quota_refused = Rounds(), {}
        self.kv.clear()
        self._fail_waiters(list(self.kv_waiters), "job_reset", "a new job replaced the one that waited for this key")
        return {}

    @handles("new_round", roles=(SERVICE,))
    def on_new_round(self, request: Request) -> dict[str, Any] | None:
        """A round on `hosts`; the registry hears of it before the joins it completes are answered."""
        hosts = parse_hosts(request.body.get("hosts"))
        self.host_slot_counts = {name: slots for name, slots in hosts if isinstance(slots, int)}
        number = request.body.get("round")
        if number is not None and (not isinstance(number, int) or isinstance(number, bool)):
            raise RequestError("bad_request", "round must be an integer or null")
        current = self.rounds.current
        if number is not None and current is not None and number <= current.number:
            if number == current.number:
                return self._round_reply(current)
            raise RequestError("stale_round", f"round {number} is older than this rendezvous's round {current.number}")
        min_np = field(request.body, "min_np", int)
        max_np = request.body.get("max_np")
        if max_np is not None and not isinstance(max_np, int):
            raise RequestError("bad_request", "max_np must be an integer or null")
        try:
            slots = get_host_assignments(hosts, min_np, max_np)
        except NotEnoughSlots as exc:
            raise RequestError("not_enough_slots", str(exc)) from None
        previous = self.rounds.current
        replaces = request.body.get("replaces")
        if replaces is not None and (previous is None or previous.number != replaces or previous.released):
            raise RequestError("released", f"round {replaces} is no longer forming (latest is {self.rounds.latest})")
        state_hosts = self.rounds.state_hosts
        if state_hosts and slots and slots[0].hostname not in state_hosts:
            raise RequestError(
                "no_surviving_host",
                f"no host of the last round that ran ({', '.join(state_hosts[:LOGGED_HOSTS])}) remains to hold "
                "rank 0 and its state",
            )
        new = self.rounds.add_round(slots, float(request.body.get("hosts_timestamp", 0.0)))
        self._drop_old_keys()
        self.log.info(
            "round_created",
            round=new.number,
            size=len(slots),
            hosts=len(new.hosts),
            first_hosts=new.hosts[:LOGGED_HOSTS],
            replaces=replaces,
        )
        request.reply(self._round_reply(new))
        self._settle()
        return None

    @staticmethod
    def _round_reply(created: Round) -> dict[str, Any]:
        return {
            "round": created.number,
            "size": len(created.slots),
            "hosts": round_hosts(list(created.slots.values())),
            "hosts_timestamp": created.hosts_timestamp,
        }

    @handles("restore_round", roles=(SERVICE,))
    def on_restore_round(self, request: Request) -> dict[str, Any]:
        body = request.body
        number = field(body, "round", int)
        if number < self.rounds.latest:
            raise RequestError(
                "stale_round", f"round {number} is older than this rendezvous's round {self.rounds.latest}"
            )
        hosts, raw_pids = body.get("hosts"), body.get("pids")
        if not isinstance(hosts, list) or not hosts:
            raise RequestError("bad_request", "restore_round needs the round's hosts [[name, [slot ids]]]")
        slots = get_host_assignments(parse_hosts(hosts), 0)
        if not slots:
            raise RequestError("bad_request", "restore_round needs a round of at least one slot")
        try:
            pids = {(h, lr): pid for h, lr, pid in raw_pids}  # type: ignore[union-attr]
        except (TypeError, ValueError):
            raise RequestError("bad_request", "restore_round needs pids [[host, local_rank, pid]]") from None
        self.rounds.restore(
            number, slots, float(body.get("hosts_timestamp") or 0.0), body.get("released") is True, pids
        )
        self.log.info("round_restored", round=number, size=len(slots), released=body.get("released") is True)
        self._drop_old_keys()
        self._settle()
        return {"round": number}

    @handles("enter_round", roles=(AGENT,))
    def on_enter_round(self, request: Request) -> Any:
        """A host's one entry for the slots whose processes wait for a round (a newer entry of the host replaces the
        one still parked: that one is answered with what is due, nothing)."""
        host = field(request.body, "host", str)
        slots = self._parse_slots(host, request.body.get("slots"))
        previous = self.host_entries.pop(host, None)
        if previous is not None and not previous.answered:
            self._unpark(previous)
            previous.reply({"answers": []})
        self.host_entries[host] = request
        for local_rank, after_round, pid in slots:
            self.rounds.park(Join((host, local_rank), after_round, pid, ticket=(request, local_rank, pid)))
        if not slots:
            del self.host_entries[host]
            return {"answers": []}
        self._settle()
        return DEFERRED

    def _parse_slots(self, host: str, raw: Any) -> list[tuple[int, int, int]]:
        """An entry's slots [[local_rank, after_round, pid]]: distinct slots that the host has (when the latest round's
        host list says how many), else `bad_request` or `no_such_slot`."""
        if not isinstance(raw, list) or len(raw) > MAX_SLOTS_PER_HOST:
            raise RequestError(
                "bad_request", f"slots must be a list of at most {MAX_SLOTS_PER_HOST} [local_rank, after_round, pid]"
            )
        slots: list[tuple[int, int, int]] = []
        for item in raw:
            # `type(...) is int`: a bool is no count; one test per value, on the path of every host of every round.
            if type(item) is not list or len(item) != 3 or not all(type(v) is int and v >= 0 for v in item):
                raise RequestError("bad_request", f"bad slot {item!r}: want [local_rank, after_round, pid], each >= 0")
            slots.append((item[0], item[1], item[2]))
        local_ranks = {local_rank for local_rank, _, _ in slots}
        if len(local_ranks) != len(slots):
            raise RequestError("bad_request", f"a slot is named twice in {raw!r}")
        count = self.host_slot_counts.get(host)
        beyond = (
            []
            if count is None or max(local_ranks, default=-1) < count
            else sorted(r for r in local_ranks if r >= count)
        )
        if beyond:
            raise RequestError(
                "no_such_slot", f"host {host} has {count} slot(s): no slot {', '.join(map(str, beyond))}"
            )
        return slots

    def _unpark(self, request: Request) -> None:
        """The joins still parked for a host's entry that is answered: its agent sends them again, in its next entry."""
        for slot in [(request.body["host"], local_rank) for local_rank, _, _ in request.body["slots"]]:
            join = self.rounds.parked.get(slot)
            if join is not None and join.ticket[0] is request:
                self.rounds.forget(slot, join.pid)

    @handles("forget", roles=(AGENT,))
    def on_forget(self, request: Request) -> dict[str, Any]:
        """Drop the parked join of a worker that exited (its agent no longer sends it)."""
        join = self.rounds.forget(
            (field(request.body, "host", str), field(request.body, "local_rank", int)), field(request.body, "pid", int)
        )
        return {"forgotten": join is not None}

    @handles("status", roles=(SERVICE, OPERATOR), replayable=True)
    def on_status(self, request: Request) -> dict[str, Any]:
        """Counts, and the rejoins logged since the caller's cursor (`round`, `rejoins_from`): a cursor of another
        round than the latest is answered from the log's start."""
        body = request.body
        asked_round, cursor = body.get("round", 0), body.get("rejoins_from", 0)
        for name, value in (("round", asked_round), ("rejoins_from", cursor)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise RequestError("bad_request", f"{name} must be an integer")
        current = self.rounds.current
        with_pids = body.get("pids", True) is not False
        rejoins, rejoins_next = self.rounds.rejoins_since(asked_round, cursor)
        return {
            "round": self.rounds.latest,
            "released": bool(current and current.released),
            "size": len(current.slots) if current else 0,
            "parked": len(self.rounds.parked),
            "pids": [[h, lr, pid] for (h, lr), pid in current.pids.items()] if current and with_pids else [],
            "rejoins": rejoins,
            "rejoins_next": rejoins_next,
            "quota_refused": dict(self.quota_refused),
        }

    def _settle(self) -> None:
        """Answer each host's entry that has answers due, once, with all of them: [[local_rank, pid, answer]]."""
        due: dict[int, tuple[Request, list[list[Any]]]] = {}
        for (request, local_rank, pid), answer in self.rounds.settle():
            due.setdefault(id(request), (request, []))[1].append([local_rank, pid, answer])
        for request, answers in due.values():
            if request.answered:
                continue
            self._unpark(request)
            if self.host_entries.get(request.body["host"]) is request:
                del self.host_entries[request.body["host"]]
            request.reply({"answers": answers})

    def _drop_old_keys(self) -> None:
        """The keys of rounds older than the previous one go, from etcd too (one range delete per round; the rounds
        etcd refused to drop are dropped with the next ones)."""
        live = tuple(r.prefix for r in self.rounds.rounds.values())
        old = [k for k in self.kv if k.startswith("round/") and not k.startswith(live)]
        over = self._left_in_etcd | {"/".join(key.split("/", 2)[:2]) + "/" for key in old}
        if self.kv_log is not None and over:
            try:
                self.kv_log.drop_prefixes(sorted(over))
                self._left_in_etcd = set()
            except KvLogError as exc:
                self._left_in_etcd = over
                self.log.warning("old_keys_left_in_etcd", rounds=len(over), reason=str(exc))
        for key in old:
            del self.kv[key]
        stale = [k for k in self.kv_waiters if k.startswith("round/") and not k.startswith(live)]
        self._fail_waiters(stale, "stale_round", "the round of this key is over")

    # -- key-value store -----------------------------------------------------------------------
    def _live_key(self, request: Request) -> str:
        """The request's key; a key too long, or under the prefix of a round that is gone, is refused, not applied."""
        key = field(request.body, "key", str)
        size = len(key.encode())
        if size > MAX_KV_KEY_BYTES:
            raise LimitExceeded("key_too_long", f"a key of {size} bytes exceeds the store's {MAX_KV_KEY_BYTES}")
        if not key.startswith("round/") or key.count("/") < 2:
            raise RequestError("not_a_round_key", f"{key!r} is no round's key: the store keeps round/N/... keys only")
        awaiting_restore = self.kv_log is not None and not self.rounds.rounds
        live = tuple(r.prefix for r in self.rounds.rounds.values())
        if not awaiting_restore and not key.startswith(live):
            raise RequestError(
                "stale_round", f"{key!r} belongs to a round that is over (latest is {self.rounds.latest})"
            )
        return key

    @handles("kv_set", roles=(AGENT,))
    def on_kv_set(self, request: Request) -> dict[str, Any]:
        if len(request.msg.raw) != 1:
            raise RequestError("bad_request", "kv_set needs the value as one raw frame")
        key = self._live_key(request)
        if self.kv_log is not None and not self.rounds.rounds:  # a replica that took over, its round not given back
            raise RequestError("unavailable", "this rendezvous has not been given the job's round yet: no one may set")
        self._check_round_owner(request, key)
        value = request.msg.raw[0]
        if len(value) > MAX_KV_VALUE_BYTES:
            raise LimitExceeded(
                "value_too_large", f"a value of {len(value)} bytes for {key!r} exceeds the store's {MAX_KV_VALUE_BYTES}"
            )
        if key not in self.kv:
            self._check_room_for(key, request)
        if self.kv_log is not None and self.kv.get(key) != value:
            self._log_write(lambda: self.kv_log.set(key, value))  # type: ignore[union-attr]
        self.kv[key] = value
        for waiter in self._take_waiters(key):
            waiter.reply({}, raw=(value,))
        return {}

    def _check_room_for(self, key: str, request: Request) -> None:
        """A new key fits its round's quota (its rank 0 host's) and the store's bound, else it is refused."""
        prefix = "/".join(key.split("/", 2)[:2]) + "/"
        held = sum(1 for k in self.kv if k.startswith(prefix))
        if held >= MAX_KV_KEYS_PER_ROUND:
            host = str(request.body.get("host"))
            self.log.warning("kv_quota", host=host, round_prefix=prefix, keys=held)
            self.quota_refused[host] = self.quota_refused.pop(host, 0) + 1  # the latest host last
            if len(self.quota_refused) > QUOTA_HOSTS_KEPT:
                del self.quota_refused[next(iter(self.quota_refused))]
            raise LimitExceeded(
                "quota", f"{prefix} holds {held} keys set by {host!r}, the most a round keeps; {key!r} is not one"
            )
        if len(self.kv) >= MAX_KV_KEYS:
            raise LimitExceeded(
                "too_many_keys", f"the store holds {MAX_KV_KEYS} keys, the most it keeps; {key!r} is not one of them"
            )

    def _check_round_owner(self, request: Request, key: str) -> None:
        """A round's keys (its store's address) are set only through the agent of the host that holds the round's
        rank 0 (the agent adds its host's name); anyone else is refused `forbidden`, said once per refusal."""
        owner = next((r.hosts[0] for r in self.rounds.rounds.values() if r.slots and key.startswith(r.prefix)), None)
        if owner is None or request.body.get("host") == owner:
            return
        caller = request.body.get("host")
        self.log.warning("forbidden", handler="kv_set", key=key, caller_host=caller, rank0_host=owner)
        raise RequestError(
            "forbidden", f"{key!r} is set only by the agent of {owner}, which holds the round's rank 0, not {caller!r}"
        )

    def _log_write(self, write: Callable[[], None]) -> None:
        try:
            write()
        except KvLogError as exc:
            raise RequestError("unavailable", str(exc)) from None

    @handles("kv_get", roles=(AGENT,))
    def on_kv_get(self, request: Request) -> Any:
        key = self._live_key(request)
        if key in self.kv:
            request.reply({}, raw=(self.kv[key],))
            return None
        if self.kv_waiting >= MAX_KV_WAITERS:
            raise LimitExceeded(
                "too_many_waiters", f"{MAX_KV_WAITERS} lookups wait for keys already, the most the store keeps"
            )
        self.kv_waiters[key].append(request)
        self.kv_waiting += 1
        return DEFERRED

    def _take_waiters(self, key: str) -> list[Request]:
        waiters = self.kv_waiters.pop(key, [])
        self.kv_waiting -= len(waiters)
        return waiters

    def _fail_waiters(self, keys: list[str], code: str, message: str) -> None:
        for key in keys:
            for waiter in self._take_waiters(key):
                waiter.fail(code, message)
