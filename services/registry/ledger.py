"""Ledger: where every second of the job's wall clock went, kept live by the registry and saved with the job.

Pure logic, driven by the registry's events with explicit instants of its own monotonic clock. At every instant the
job is in exactly one bucket (BUCKETS), so the buckets always add up to the job's wall clock:

- TRAINING / BELOW_SIZE: from a round's first step (its state synced, as reported; else its release: every worker
  has its rank) at the size asked for (`--max-np`; without one, the largest size the job has had) or below it;
  below it, the missing slot-seconds are counted too;
- DETECTING: from a fault to the decision on it: a crash's exit report, the start of a hung rank's stall (the
  others waited since) to its kill, a lost host's last heartbeat (or a later commit) to its loss; for a planned
  change (drain, scale-up, preemption), from the commit the workers left at to the decision;
- REFORMING: from the decision to the first step of the next round (rendezvous, process start, state sync: the
  hosts' snapshot writers report when their round's state is synced; until then, from its release);
- WAITING_FOR_HOSTS: after the decision, while fewer than `--min-np` slots are available;
- PAUSED: in one of the three above while the control plane cannot act (the registry down: the gap between its
  last save and its restart; its peers out of reach or being restored); training goes on through an outage;
- LOST_WORK: training since the last commit the workers reported before a fault, moved out of the training
  buckets when the job trains again (that work is rolled back and done again); a commit reported late moves its
  part back;
- CHECKPOINTING: the seconds the hosts' snapshot writers spent saving commits (the mean over the round's hosts),
  moved out of the training bucket they stopped.

Each interruption (a fault or planned change, up to the next round's first step) has a cause (CAUSES) and a host, and
its seconds (and its lost work) are charged to both. The job's start is an interruption of cause `start`; every worker
failed at once, resumed from the hosts' snapshots, is one of cause `restart` and no host (the decision says so: the
interruption opened by the first failure told is charged there instead). Bounded
for a job that runs for weeks: the last TIMELINE_KEPT interruptions are kept (older ones stay in the totals);
HOSTS_KEPT hosts are charged by name, the rest of the charge goes to OTHER_HOSTS; the save times of HOSTS_KEPT
hosts are followed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TRAINING, BELOW_SIZE, LOST_WORK = "training", "training_below_size", "lost_work"
DETECTING, REFORMING, WAITING_FOR_HOSTS = "detecting", "reforming", "waiting_for_hosts"
PAUSED, CHECKPOINTING = "paused", "checkpointing"
BUCKETS = (TRAINING, BELOW_SIZE, LOST_WORK, DETECTING, REFORMING, WAITING_FOR_HOSTS, PAUSED, CHECKPOINTING)
TRAINED = (TRAINING, BELOW_SIZE)
INTERRUPTED = (DETECTING, REFORMING, WAITING_FOR_HOSTS, PAUSED)  # charged to the open interruption
START, CRASH, HANG, LOST_HOST = "start", "crash", "hang", "lost_host"
DRAIN, SCALE_UP, PREEMPTION, RESTART = "drain", "scale_up", "preemption", "restart"
CAUSES = (START, CRASH, HANG, LOST_HOST, DRAIN, SCALE_UP, PREEMPTION, RESTART)
TIMELINE_KEPT = 100
HOSTS_KEPT = 256
OTHER_HOSTS = "(other hosts)"
SAVE_EVERY_S = 5.0  # progress and interruptions are saved this often: a restarted registry knows when it stopped
REASON_CHARS = 300
PLANNED_LATENCY_S = 5.0  # at most this much of a planned change's uncommitted stretch is its detection


class Ledger:
    def __init__(self, start: float | None = None, asked: int | None = None) -> None:
        """A job submitted at `start` that asks for `asked` slots (None: as many as it can get); no `start`: no job."""
        self.seconds = dict.fromkeys(BUCKETS, 0.0)  # closed time; the open segment is added when asked
        self.bucket: str | None = None if start is None else WAITING_FOR_HOSTS  # None: no job, or it ended
        self.since = start or 0.0
        self.asked, self.size, self.largest = asked, 0, 0
        self.round = 0  # the last round released
        self.resumed_round = 0  # the last round whose state sync was reported
        self.short_slot_s, self.most_short = 0.0, 0
        self.by_cause = dict.fromkeys(CAUSES, 0.0)
        self.by_host: dict[str, float] = {}
        self.interruption: dict[str, Any] | None = None if start is None else _interruption(START, "", start, "")
        self.timeline: list[dict[str, Any]] = []
        self.trained_since = self.since  # the training stretch under way began (its rollback starts there)
        self.commit, self.commit_at = 0, -float("inf")  # the newest commit reported, and when it was made
        self.commits_seen = False  # the workers' commits are reported (a job without hang detection has no reports)
        self.rollback: dict[str, Any] | None = None  # the last interruption's lost work, adjustable by late commits
        self.saving_s: dict[str, float] = {}  # host: seconds its snapshot writer spent saving (as last reported)
        self.resume_bucket: str | None = None  # the bucket a PAUSED segment goes back to
        # A worker re-joined before any fault was told (its collective failed first): training stopped then. Not
        # saved: a registry started again loses only this precision.
        self.stopped_at: float | None = None
        self.changed, self.saved_at = True, -float("inf")  # changed: a transition, saved at the end of its pass
        self.progressed = False  # commits or checkpointing changed it: saved within SAVE_EVERY_S
        self.timeline_changed = True

    # -- what happens to the job --------------------------------------------------------------------
    def fault(self, now: float, at: float, cause: str, host: str, reason: str, planned: bool = False) -> None:
        """A fault that began at `at` (<= now; no earlier than the newest commit) stops training: detecting until the
        decision. One during an
        interruption is counted in it; the interruption keeps its first cause. `planned`: a change of hosts the
        workers leave for at a commit, which rolls nothing back (its training since the commit they left at, seen
        late, is detecting)."""
        if self.bucket is None:
            return
        if self.interruption is not None:
            same = (cause, host) == (self.interruption["cause"], self.interruption["host"])
            self.interruption["faults"] += not same  # a hang's kill, then its exit: one fault
            return
        # A commit made after `at` was every rank's: the job trained until then (a lost host whose workers went on).
        at = min(max(at, self.since, self.commit_at), now, self.stopped_at or now)
        trained = self.bucket
        self._switch(DETECTING, at)
        self.rollback = {
            "start": self.trained_since,
            "end": at,
            "bucket": trained,
            "to": DETECTING if planned else LOST_WORK,
            "commit": self.commit,
            "commit_at": self.commit_at,
            "charged": 0.0,
        }
        self.interruption = _interruption(cause, host, at, reason[:REASON_CHARS], self.commit)

    def stopped(self, now: float) -> None:
        """A worker re-joined while training and no fault is known yet: the fault told next began at `now` at the
        latest."""
        if self.bucket in TRAINED and self.stopped_at is None:
            self.stopped_at = now

    def decided(self, now: float, restart: bool = False) -> None:
        """The registry decided on the fault (a new round): re-forming begins. `restart`: every worker had failed and
        the job resumes from the hosts' snapshots: the interruption is the whole job's (RESTART, no host), whichever
        failure was told first, and what it was charged so far moves there."""
        if restart and self.interruption is not None and self.interruption["cause"] != RESTART:
            self._recharge(self.interruption, RESTART, "")
        if self.bucket == DETECTING:
            self._switch(REFORMING, now)
        elif self.bucket == PAUSED and self.resume_bucket == DETECTING:
            self.resume_bucket = REFORMING

    def slots(self, now: float, enough: bool) -> None:
        """Between the decision and the next round: enough slots for `--min-np` (re-forming) or not (waiting)."""
        wanted = REFORMING if enough else WAITING_FOR_HOSTS
        if self.bucket in (REFORMING, WAITING_FOR_HOSTS) and self.bucket != wanted:
            self._switch(wanted, now)

    def released(self, now: float, round_number: int, size: int) -> None:
        """Round `round_number` of `size` slots is released (said again on every pass: the first time counts): the
        interruption under way ends and training begins."""
        if self.bucket is None or round_number <= self.round:
            return
        self.round, self.stopped_at = round_number, None
        self.largest = max(self.largest, size)
        self.size = size
        self._switch(BELOW_SIZE if size < self.asked_size() else TRAINING, now)
        self.trained_since = self.since
        if self.interruption is not None:
            self._close_interruption()

    def resumed(self, now: float, round_number: int, age_s: float) -> None:
        """A host's workers synced round `round_number`'s state `age_s` ago: its re-forming ran until then, not its
        release (the first report of the round counts)."""
        at = min(now, now - age_s)
        if round_number != self.round or round_number <= self.resumed_round or self.bucket not in TRAINED:
            return
        self.resumed_round = round_number
        if self.interruption is not None or self.since != self.trained_since or at <= self.since or not self.timeline:
            return
        seconds, last = at - self.since, self.timeline[-1]
        self.seconds[REFORMING] += seconds
        last[REFORMING] += seconds
        self._charge(last, seconds)
        self.since = self.trained_since = at
        self.changed = self.timeline_changed = True

    def control_plane(self, now: float, available: bool) -> None:
        """Whether the control plane can act: an interruption cannot end while it cannot (PAUSED)."""
        if not available and self.bucket in (DETECTING, REFORMING, WAITING_FOR_HOSTS):
            self.resume_bucket = self.bucket
            self._switch(PAUSED, now)
        elif available and self.bucket == PAUSED:
            self._switch(self.resume_bucket or REFORMING, now)
            self.resume_bucket = None

    def committed(self, now: float, commit: int, age_s: float | None) -> None:
        """A host reported its newest commit, made `age_s` ago (None: it has none yet): a fault after it rolls back
        to it. Until a first report, lost work is not known and not counted."""
        if not self.commits_seen:
            self.commits_seen = self.changed = True
        if age_s is None:
            return
        at = now - max(0.0, age_s)
        if at <= self.commit_at:
            return
        self.commit, self.commit_at, self.progressed = commit, at, True
        rollback = self.rollback
        if rollback is None:
            return
        if self.interruption is not None or at < self.trained_since:
            # No commit is made while the job does not train (a crash blocks the next commit's collective; a
            # planned change interrupts at one): a newer one than the fault knew was made before it and reported
            # late (its instant runs late by the report's queueing): less was lost. The same commit reported again
            # is only dated again.
            if commit > rollback["commit"]:
                rollback["commit"], rollback["commit_at"] = commit, min(at, rollback["end"])
                self._charge_rollback()
        elif rollback["to"] == DETECTING and commit > rollback["commit"]:
            # A planned change keeps its state (nothing is restored) and interrupts at the next commit: the one after
            # the one the fault knew is the one the workers left at, however late its report, or never reported (its
            # host's snapshot writer cut short by the change: the new stretch's next commit comes first); if the
            # fault knew that one already, the next was made after it and what is charged stays ~0 either way.
            # Nothing is charged now: the rollback is final.
            rollback["commit"], rollback["commit_at"] = rollback["commit"] + 1, rollback["end"]
            self._charge_rollback()
            self.rollback = None
        else:
            self.rollback = None  # a commit of the new stretch: no earlier one can come late any more

    def saved_commits(self, now: float, host: str, total_s: float, hosts: int) -> None:
        """`host`'s snapshot writer has spent `total_s` saving commits in this job; the round has `hosts` hosts: the
        mean of the new saving time over them stopped training."""
        before = self.saving_s.pop(host, None)
        self.saving_s[host] = total_s
        while len(self.saving_s) > HOSTS_KEPT:
            del self.saving_s[next(iter(self.saving_s))]
        if before is None or total_s <= before or self.bucket not in TRAINED:
            return
        share = (total_s - before) / max(1, hosts)
        share = min(share, self.seconds[self.bucket] + max(0.0, now - self.since))
        self.seconds[self.bucket] -= share
        self.seconds[CHECKPOINTING] += share
        self.progressed = True

    def ended(self, now: float) -> None:
        """The job ended: nothing more is counted."""
        if self.bucket is None:
            return
        self._switch(self.bucket, now)
        if self.interruption is not None:
            self._close_interruption()
        self.rollback, self.bucket = None, None

    # -- segments and charges -----------------------------------------------------------------------
    def asked_size(self) -> int:
        return self.asked if self.asked is not None else self.largest

    def _switch(self, bucket: str, now: float) -> None:
        """Close the open segment at `now` (never before it began) and open `bucket` there."""
        end = max(now, self.since)
        seconds = end - self.since
        if self.bucket is not None:
            self.seconds[self.bucket] += seconds
            if self.bucket == BELOW_SIZE:
                short = self.asked_size() - self.size
                self.short_slot_s += seconds * short
                self.most_short = max(self.most_short, short)
            if self.interruption is not None and self.bucket in INTERRUPTED:
                self.interruption[self.bucket] += seconds
                self._charge(self.interruption, seconds)
        self.bucket, self.since, self.changed = bucket, end, True

    def _charge(self, interruption: dict[str, Any], seconds: float) -> None:
        self.by_cause[interruption["cause"]] += seconds
        host = interruption["host"]
        if not host:
            return
        if host not in self.by_host and len(self.by_host) + (OTHER_HOSTS not in self.by_host) >= HOSTS_KEPT:
            least = min((h for h in self.by_host if h != OTHER_HOSTS), key=self.by_host.__getitem__)
            self.by_host[OTHER_HOSTS] = self.by_host.get(OTHER_HOSTS, 0.0) + self.by_host.pop(least)
        self.by_host[host] = self.by_host.get(host, 0.0) + seconds

    def _recharge(self, interruption: dict[str, Any], cause: str, host: str) -> None:
        """`interruption` is of `cause` and `host` after all: what it was charged moves from its old ones."""
        charged = sum(interruption[bucket] for bucket in (*INTERRUPTED, LOST_WORK))
        self.by_cause[interruption["cause"]] -= charged
        old = interruption["host"]
        old = old if old in self.by_host else OTHER_HOSTS if old and OTHER_HOSTS in self.by_host else ""
        if old:
            self.by_host[old] -= charged
            if abs(self.by_host[old]) < 1e-9:
                del self.by_host[old]
        interruption["cause"], interruption["host"] = cause, host
        self._charge(interruption, charged)
        self.changed = True

    def _close_interruption(self) -> None:
        interruption, self.interruption = self.interruption, None
        assert interruption is not None
        self.timeline = [*self.timeline[-(TIMELINE_KEPT - 1) :], interruption]
        self.timeline_changed = True
        if self.rollback is not None:
            self._charge_rollback()

    def _charge_rollback(self) -> None:
        """The last interruption's lost work: its training since the newest commit made before the fault, moved to
        LOST_WORK (or back, when a commit reported late shortens it)."""
        rollback = self.rollback
        assert rollback is not None
        if self.interruption is not None:  # still under way: charged when it ends
            self.interruption["rolled_back_to"] = rollback["commit"]
            return
        lost = max(0.0, rollback["end"] - max(rollback["start"], rollback["commit_at"])) if self.commits_seen else 0.0
        lost = lost if rollback["to"] == LOST_WORK else min(lost, PLANNED_LATENCY_S)
        moved = lost - rollback["charged"]
        last = self.timeline[-1]
        self.timeline_changed = self.timeline_changed or last["rolled_back_to"] != rollback["commit"] or bool(moved)
        last["rolled_back_to"] = rollback["commit"]
        if not moved:
            return
        rollback["charged"] = lost
        self.seconds[rollback["bucket"]] -= moved
        self.seconds[rollback["to"]] += moved
        last[rollback["to"]] += moved
        self._charge(last, moved)
        self.changed = True

    # -- what is shown -----------------------------------------------------------------------------
    def view(self, now: float, as_wall: Callable[[float], float | None]) -> dict[str, Any]:
        """`totals`, and the interruptions kept, the one under way last (instants as wall-clock seconds)."""
        totals = self.totals(now)
        interruption = totals.pop("interruption")
        timeline = [shown(entry, as_wall) for entry in self.timeline]
        return {**totals, "interruptions": timeline + ([shown(interruption, as_wall)] if interruption else [])}

    def totals(self, now: float) -> dict[str, Any]:
        """The ledger at `now`, the open segment included: buckets, causes and hosts in seconds, the training share,
        how far below the size asked it trained."""
        seconds, causes, hosts = dict(self.seconds), dict(self.by_cause), dict(self.by_host)
        interruption = None
        if self.interruption is not None:
            interruption = dict(self.interruption)
        if self.bucket is not None:
            open_s = max(0.0, now - self.since)
            seconds[self.bucket] += open_s
            if interruption is not None and self.bucket in INTERRUPTED:
                interruption[self.bucket] += open_s
                causes[interruption["cause"]] += open_s
                if interruption["host"]:
                    hosts[interruption["host"]] = hosts.get(interruption["host"], 0.0) + open_s
        short_slot_s, most_short = self.short_slot_s, self.most_short
        if self.bucket == BELOW_SIZE:
            short = self.asked_size() - self.size
            short_slot_s, most_short = short_slot_s + short * max(0.0, now - self.since), max(most_short, short)
        wall = sum(seconds.values())
        below = seconds[BELOW_SIZE]
        return {
            "wall_s": round(wall, 3),
            "training_share": round((seconds[TRAINING] + below) / wall, 4) if wall > 0 else None,
            "buckets": {bucket: round(s, 3) for bucket, s in seconds.items()},
            "bucket": self.bucket,
            "asked": self.asked_size(),
            "below_size": {
                "short_slot_s": round(short_slot_s, 3),
                "mean_short": round(short_slot_s / below, 2) if below > 0 else 0,
                "most_short": most_short,
            },
            "causes": {cause: round(s, 3) for cause, s in causes.items()},
            "hosts": {host: round(s, 3) for host, s in sorted(hosts.items(), key=lambda kv: -kv[1])},
            "commit": self.commit,
            "commits_seen": self.commits_seen,
            "interruption": interruption,
        }

    # -- saving ------------------------------------------------------------------------------------
    def due(self, now: float) -> bool:
        """Does the ledger need saving: a transition, or SAVE_EVERY_S since the last save with commits reported since
        or in an interruption (a registry started again counts the gap from there as PAUSED)? A job that trains
        with nothing reported saves nothing."""
        if self.changed:
            return True
        return (self.progressed or self.bucket in INTERRUPTED) and now - self.saved_at >= SAVE_EVERY_S

    def saved(self, at: float, timeline: bool) -> None:
        """What ledger_record.to_saved gave at `at` is saved (and its timeline, if `timeline`): the ledger is not
        `due` until it changes or SAVE_EVERY_S pass."""
        self.changed, self.progressed, self.saved_at = False, False, at
        self.timeline_changed = self.timeline_changed and not timeline


def _interruption(cause: str, host: str, at: float, reason: str, commit: int = 0) -> dict[str, Any]:
    """An interruption opened at `at`; `rolled_back_to`: the commit the job goes back to (0: its start)."""
    entry = {"cause": cause, "host": host, "at": at, "reason": reason, "faults": 1, "rolled_back_to": commit}
    return entry | dict.fromkeys((*INTERRUPTED, LOST_WORK), 0.0)


def wall(instant: float, as_wall: Callable[[float], float | None]) -> float | None:
    """An instant of the registry's clock as wall-clock seconds (None: none, -inf)."""
    return None if instant == -float("inf") else round(as_wall(instant) or 0.0, 3)


def shown(entry: dict[str, Any], as_wall: Callable[[float], float | None]) -> dict[str, Any]:
    """An interruption as shown and saved: seconds to the millisecond, its instant as wall-clock seconds."""
    rounded = {key: round(value, 3) if isinstance(value, float) else value for key, value in entry.items()}
    return {**rounded, "at": wall(entry["at"], as_wall)}
