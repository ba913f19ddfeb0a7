"""Every feature of pgcoord across what Patroni does to a primary, with real processes.

One Patroni cluster (etcd, a primary and a synchronous standby; ttl 20, loop_wait 2,
retry_timeout 4, primary_start_timeout 0) and three replica processes
(tests/integration/ha_replica.py: asyncpg, psycopg, SQLAlchemy), each with an elector
of its own and one on a Member, two LockHolder bodies, a Lease and a member lease
whose holders make fenced writes, Partitions on the member and a per-second
scheduler job, all on the multi-host DSN ``host=127.0.0.1,127.0.0.1 port=p1,p2
target_session_attrs=read-write``.

The module fixture runs the four events one after the other on that one cluster and
fleet (a fresh cluster per event would cost 15 s each and prove nothing more):

1. ``patronictl switchover``;
2. SIGKILL of the primary's postmaster (a failover: ``primary_start_timeout: 0``);
3. etcd stopped for 20 s: Patroni demotes the primary to read-only, and promotes a
   node again once etcd is back;
4. the same with ``failsafe_mode: true`` (set at run time through PATCH /config):
   the primary stays writable, nothing is lost;
5. SIGKILL of the primary's Patroni agent (not its postgres), started again 5 s later
   as a service manager would: the primary goes on, no session is cut.

After each, it waits until every feature is back, and the tests check, per event:
nothing ended ``run()``; every LockHolder body whose session died got ``LockLost``;
one leader again with a greater fence; fences only grow, in commit order (no stale
write accepted); no slot started twice; every slot is settled; partitions owned again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

import pgcoord
import pgcoord.migrations
from pgcoord._core import readonly

from ..integration.ha import Event, Fleet
from .patroni import PatroniCluster

TTL = 4.0
OUTAGE = 20.0
TERMINAL = {"succeeded", "failed", "abandoned", "missed", "skipped"}
EVENTS = ("switchover", "sigkill", "dcs-loss", "dcs-loss-failsafe", "agent-kill")
# Whether the event ends the primary's sessions (so every LockHolder body must lose).
CUTS_SESSIONS = {"switchover": True, "sigkill": True, "dcs-loss": True, "dcs-loss-failsafe": False,
                 "agent-kill": False}
PARTS = 4
# Sessions a second that one replica process may open on the servers while no node
# takes writes. Measured: 55-64, most of them the replica's own retries (its
# LockHolder and lease bodies start again 0.1 s after an error, each attempt trying
# both hosts); pgcoord's loops back off to about ttl / 3. A loop of pgcoord's with no
# back-off would add a few hundred. Room over the measure for a loaded host.
RETRY_BOUND = 150
# The first test's setup runs the four events (about two minutes; the suite's 120 s
# limit is for one test): a bound of its own, generous.
pytestmark = pytest.mark.timeout(420)


@dataclass
class Outcome:
    name: str
    started: float  # unix time the event began
    writable: float = 0.0  # unix time a primary took writes again
    ended: float = 0.0  # unix time every feature was seen back
    before: dict[str, dict[str, Any]] = field(default_factory=dict)
    # A DCS loss's probes of each node, about once a second while etcd is down:
    # (unix time, {node: (in recovery, sessions ever opened on it) or None: no answer}).
    probes: list[tuple[float, dict[str, tuple[bool, int] | None]]] = field(default_factory=list)
    outage: tuple[float, float] = (0.0, 0.0)  # unix times etcd stopped and started again
    after: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Run:
    cluster: PatroniCluster
    fleet: Fleet
    outcomes: dict[str, Outcome]
    events: list[Event] = field(default_factory=list)


def _wait_all_back(fleet: Fleet, cluster: PatroniCluster, outcome: Outcome, timeout: float) -> None:
    """Until every feature has shown life after the event, then the replicas' states."""
    fleet.wait_for("slot", fleet.name("job"), after=outcome.writable, count=3, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        states = fleet.states()
        leaders = {f: [s[f] for s in states.values() if s[f] is not None]
                   for f in ("elector", "member-elector")}
        parts = sorted(p for s in states.values() for p in s["parts"])
        locks = {k for s in states.values() for k in s["locks"]}
        leased = [s["lease"] for s in states.values() if s["lease"] is not None]
        # Written since a primary took writes again: a write from before the demotion
        # said nothing of the writer's pool, and the next event then began while the
        # elector's first write of its new term was still pending.
        written = {name for (name,) in fleet.query(
            "select distinct name from ha_writes where at > to_timestamp(%s)", outcome.writable)}
        if (all(len(v) == 1 for v in leaders.values()) and parts == list(range(PARTS))
                and locks == set(_lock_names(fleet)) and len(leased) == 1
                and written >= {fleet.name(f) for f in ("elector", "lease", "mlease")}):
            outcome.after = states
            outcome.ended = time.time()
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not every feature back in {timeout}s after {outcome.name}: {states}\n"
                                 f"{fleet.output()[-4000:]}\n{cluster.logs()}")
        time.sleep(0.3)


def _lock_names(fleet: Fleet) -> list[str]:
    return [f"{fleet.prefix}:{kind}:{label}" for label in fleet.procs for kind in ("lock", "mlock")]


def _node_state(dsn: str) -> tuple[bool, int] | None:
    """(in recovery, sessions opened since its stats began) of one node, or None."""
    with contextlib.suppress(psycopg.Error), \
            psycopg.connect(dsn, autocommit=True, connect_timeout=1) as conn:
        row = conn.execute("select pg_is_in_recovery(),"
                           " (select coalesce(sum(sessions), 0) from pg_stat_database)").fetchone()
        if row is not None:
            return bool(row[0]), int(row[1])
    return None


def _outage(cluster: PatroniCluster, outcome: Outcome) -> None:
    """etcd down for OUTAGE seconds, each node probed about once a second meanwhile:
    one connection per node and probe, so that what the replicas open can be told
    from what the probes do."""
    stopped = time.time()
    cluster.stop_etcd()
    while time.time() < stopped + OUTAGE:
        outcome.probes.append((time.time(), {n.name: _node_state(n.dsn) for n in cluster.nodes}))
        time.sleep(max(0.0, min(1.0, stopped + OUTAGE - time.time())))
    cluster.start_etcd()
    outcome.outage = (stopped, time.time())


def _event(cluster: PatroniCluster, outcome: Outcome) -> None:
    if outcome.name == "switchover":
        cluster.switchover()
    elif outcome.name == "sigkill":
        cluster.kill_primary()
    elif outcome.name == "agent-kill":
        cluster.kill_primary_agent(down=5)
    else:
        _outage(cluster, outcome)


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    with PatroniCluster(ttl=20, loop_wait=2, retry_timeout=4) as cluster:
        pgcoord.migrations.upgrade(cluster.url())
        fleet = Fleet(cluster, "postgres", ttl=TTL, member_features=True)
        outcomes: dict[str, Outcome] = {}
        result = Run(cluster, fleet, outcomes)
        try:
            start = Outcome("start", time.time(), writable=time.time())
            _wait_all_back(fleet, cluster, start, timeout=60)
            failed = False
            for name in EVENTS:
                if name == "dcs-loss-failsafe":
                    cluster.edit_config(failsafe_mode=True)
                    time.sleep(3)  # a loop or two: the primary writes the /failsafe key
                outcome = Outcome(name, time.time())
                outcomes[name] = outcome
                if failed:
                    outcome.error = "an earlier event did not recover"
                    continue
                try:
                    outcome.before = fleet.states()
                    outcome.started = time.time()
                    _event(cluster, outcome)
                    cluster.wait_writable(timeout=60, poll=0.02)
                    outcome.writable = time.time()
                    _wait_all_back(fleet, cluster, outcome, timeout=60)
                    cluster.wait_healthy(timeout=60)
                except Exception as exc:  # the tests of this event say it
                    outcome.error = f"{type(exc).__name__}: {exc}"
                    failed = True
            time.sleep(TTL + 2)  # the last event's slots settle
            result.events = fleet.events()
            yield result
        finally:
            fleet.stop()


def _outcome(run: Run, name: str) -> Outcome:
    outcome = run.outcomes[name]
    assert outcome.error is None, outcome.error
    return outcome


def _window(run: Run, outcome: Outcome) -> list[Event]:
    return [e for e in run.events if outcome.started <= e.at <= outcome.ended]


@pytest.mark.parametrize("event", EVENTS)
def test_nothing_ends_run(run: Run, event: str) -> None:
    outcome = _outcome(run, event)
    assert [e for e in run.events if e.what == "ended"] == []
    assert all(p.poll() is None for p in run.fleet.procs.values()), run.fleet.output()
    assert outcome.ended > outcome.started


@pytest.mark.parametrize("event", EVENTS)
def test_every_lockholder_body_whose_session_died_gets_locklost(run: Run, event: str) -> None:
    outcome = _outcome(run, event)
    window = _window(run, outcome)
    for key in _lock_names(run.fleet):
        assert any(key in s["locks"] for s in outcome.before.values())
        relocked = [e for e in window if e.name == key and e.what == "locked"]
        lost = [e for e in window if e.name == key and e.what == "lock-lost"]
        # A held lock's body ends only on LockLost; errors come from taking it again
        # while no server takes writes.
        holding = True
        for e in (e for e in window if e.name == key):
            assert not (holding and e.what == "lock-error"), f"{key}: a body ended on {e}, not LockLost"
            holding = e.what == "locked" or (holding and e.what not in ("lock-lost", "lock-error"))
        if CUTS_SESSIONS[event]:
            assert lost and relocked, f"{key}: its session died, its body was not told"
        # A body that took its lock again was told first that it had lost it.
        for again in relocked:
            assert any(e.at < again.at for e in lost), f"{key}: taken again without LockLost"
    if not CUTS_SESSIONS[event]:  # failsafe: the primary never restarted
        assert [e for e in window if e.what == "lock-lost"] == []


@pytest.mark.parametrize("feature", ["elector", "member-elector"])
@pytest.mark.parametrize("event", EVENTS)
def test_one_leader_again_with_a_greater_fence(run: Run, event: str, feature: str) -> None:
    outcome = _outcome(run, event)
    name = run.fleet.name(feature)
    fence_before = max(s[feature] for s in outcome.before.values() if s[feature] is not None)
    leaders = {label: s[feature] for label, s in outcome.after.items() if s[feature] is not None}
    assert len(leaders) == 1, leaders
    [fence_after] = leaders.values()
    new_terms = [e for e in _window(run, outcome) if e.name == name and e.what == "lead"]
    if CUTS_SESSIONS[event]:
        assert new_terms, f"{name}: no new term after {event}"
    else:  # the primary went on and every session with it: the term too
        assert new_terms == [] and fence_after == fence_before, (new_terms, fence_before, fence_after)
    assert fence_after >= fence_before
    for term in new_terms:
        assert int(term.fence) > fence_before
        # Never two leaders: every earlier term's lead() had ended before.
        ended = [e for e in run.events if e.name == name and e.what == "cancelled"
                 and int(e.fence) < int(term.fence)]
        assert {int(e.fence) for e in ended} >= {fence_before}
        assert all(e.at < term.at for e in ended if int(e.fence) <= fence_before)


@pytest.mark.parametrize("event", EVENTS)
def test_fences_only_grow_in_commit_order(run: Run, event: str) -> None:
    outcome = _outcome(run, event)
    for feature in ("elector", "lease", "mlease"):
        name = run.fleet.name(feature)
        rows = run.fleet.query("select fence, at from ha_writes where name = %s order by id", name)
        fences = [int(f) for f, _ in rows]
        assert fences == sorted(fences), f"{name}: a stale fenced write was accepted"
        ts = [at.timestamp() for _, at in rows]
        assert any(t < outcome.started for t in ts) and any(t > outcome.writable for t in ts), \
            f"{name}: fenced writes on both sides of {event}"
        if not CUTS_SESSIONS[event]:  # no session cut: every write still under the fence it had
            held = {int(f) for f, at in rows if outcome.started <= at.timestamp() <= outcome.ended}
            assert held == {fences[sum(t < outcome.started for t in ts) - 1]}, f"{name}: {held}"
    rejected = [e for e in run.events if e.what == "rejected"]
    # A rejected write is a stale fence caught by check_fence: it is fine, and was not
    # accepted (the ordering above); its fence was less than the current one.
    for e in rejected:
        later = run.fleet.query("select max(fence) from ha_writes where name = %s", e.name)[0][0]
        assert int(e.fence) < int(later)


@pytest.mark.parametrize("event", EVENTS)
def test_no_slot_started_twice_and_every_slot_settled(run: Run, event: str) -> None:
    outcome = _outcome(run, event)
    starts = run.fleet.query("select extract(epoch from slot_at), count(*) from ha_starts group by 1")
    assert [(at, n) for at, n in starts if n != 1] == [], "a slot was started twice"
    settled = time.time() - (TTL + 1.5)
    slots = [(float(at), str(state)) for at, state in run.fleet.query(
        "select extract(epoch from slot_at), state from pgcoord.job_slots"
        " where job = %s and slot_at between to_timestamp(%s) and to_timestamp(%s) order by slot_at",
        run.fleet.name("job"), outcome.started - 3, min(settled, outcome.ended + 2))]
    times = [at for at, _ in slots]
    assert times and times[0] < outcome.started < times[-1], slots
    assert times == [times[0] + i for i in range(len(times))], "a slot of the window has no row"
    assert [(at, s) for at, s in slots if s not in TERMINAL] == []


@pytest.mark.parametrize("event", EVENTS)
def test_partitions_are_owned_again(run: Run, event: str) -> None:
    outcome = _outcome(run, event)
    owners = [p for s in outcome.after.values() for p in s["parts"]]
    assert sorted(owners) == list(range(PARTS)), outcome.after
    rows = run.fleet.query("select name, fence from pgcoord.leases where name like %s"
                           " and expires_at > clock_timestamp()", run.fleet.name("parts") + "/%")
    assert len(rows) == PARTS
    if CUTS_SESSIONS[event]:
        # Each part's owner's session died with the primary: each own() ended, and the
        # part was owned again under a fence greater than its last one.
        window = _window(run, outcome)
        for index in range(PARTS):
            part = f"{run.fleet.name('parts')}/{index}"
            ends = [e for e in window if e.name == part and e.what == "unowned"]
            owns = [e for e in window if e.name == part and e.what == "own"]
            assert ends and owns, part
            assert int(owns[-1].fence) > max(int(e.fence) for e in ends)


def _logs(run: Run, outcome: Outcome, label: str, until: float) -> list[tuple[float, str, str]]:
    """(time, level, message) of a replica's pgcoord log lines from the event's start
    to ``until`` (not its drivers': psycopg_pool logs each failed connect of its own)."""
    found = []
    for line in run.fleet.lines[label]:
        if line.startswith("LOG "):
            _, at, name, level, message = line.split(" ", 4)
            if name.startswith("pgcoord") and outcome.started <= float(at) <= until:
                found.append((float(at), level, message))
    return found


NO_WRITES = "the database takes no writes now"
WRITES_AGAIN = "the database takes writes again"
READ_ONLY_SIGNS = ("TargetServerAttributeNotMatched", "session is read-only", "hot standby mode", "25006")


def test_a_read_only_primary_is_said_once_not_once_a_retry(run: Run) -> None:
    # Patroni without its DCS restarts the primary read-only for the rest of the
    # outage: every loop of every replica fails meanwhile, and each process says so
    # once, then once that writes are accepted again.
    outcome = _outcome(run, "dcs-loss")
    # "Writes again" may come after every feature is back: a process holds it for
    # ONCE_GRACE after its last read-only failure that no loop owns (an elector's
    # campaign), since another loop's success on a session of its own proves nothing
    # about the connection that failed. So the window runs past that grace, with room
    # for the next renewal or tick to say it. The next event (failsafe) keeps the
    # primary writable, so a notice of its own in this window would be a defect too.
    until = outcome.ended + readonly.ONCE_GRACE + 15
    time.sleep(max(0.0, until - time.time()))  # the replicas log on: lines come in live
    for label in run.fleet.procs:
        logs = _logs(run, outcome, label, until)
        notices = [at for at, _, m in logs if m.startswith(NO_WRITES)]
        again = [at for at, _, m in logs if m.startswith(WRITES_AGAIN)]
        noisy = [m for _, _, m in logs
                 if not m.startswith(NO_WRITES) and any(s in m for s in READ_ONLY_SIGNS)]
        assert len(notices) == 1, f"{label}: {logs}"
        assert len(again) == 1 and again[0] > notices[0], f"{label}: {logs}"
        assert noisy == [], f"{label}: read-only retries logged one by one: {noisy[:5]}"


def test_failsafe_keeps_the_primary_writable_through_the_outage(run: Run) -> None:
    # Without failsafe the primary is demoted some seconds into the outage (the next
    # test sees it); with it, the same primary answers every probe and every fenced
    # writer goes on writing, under the fence it had, until etcd is back.
    outcome = _outcome(run, "dcs-loss-failsafe")
    stopped, restarted = outcome.outage
    assert len(outcome.probes) >= OUTAGE / 2, outcome.probes
    primaries = [{n for n, state in states.items() if state is not None and not state[0]}
                 for _, states in outcome.probes]
    assert all(p == primaries[0] and len(p) == 1 for p in primaries), outcome.probes
    for feature in ("elector", "lease", "mlease"):
        name = run.fleet.name(feature)
        ts = [at.timestamp() for (at,) in run.fleet.query(
            "select at from ha_writes where name = %s and at between to_timestamp(%s) and to_timestamp(%s)"
            " order by id", name, stopped, restarted)]
        # A write every 20 ms: a gap of seconds would be a demotion or a lost holder.
        gaps = [b - a for a, b in zip([stopped, *ts], [*ts, restarted], strict=True)]
        assert ts and max(gaps) < 5, f"{name}: {len(ts)} writes in the outage, longest gap {max(gaps):.1f}s"


def test_backs_off_while_a_demoted_primary_is_read_only(run: Run) -> None:
    # What the servers see of the replicas' retries while no node takes writes: the
    # sessions opened on either node (pg_stat_database), less the probes' own, per
    # replica process (RETRY_BOUND says what it holds and what it would catch).
    # A spell is a run of probes in which no node takes writes and the same nodes answer
    # (the demoted primary may be down, restarting as a standby, for much of the outage
    # on a loaded machine: the replicas' sessions then go to the nodes that answer).
    outcome = _outcome(run, "dcs-loss")
    spells: list[list[tuple[float, dict[str, tuple[bool, int]]]]] = [[]]
    for at, states in outcome.probes:
        answered = {n: s for n, s in states.items() if s is not None}
        steady = bool(answered) and all(s[0] for s in answered.values())
        if steady and spells[-1] and (
                answered.keys() != spells[-1][-1][1].keys()
                or any(s[1] < spells[-1][-1][1][n][1] for n, s in answered.items())):
            spells.append([])  # another node answers, or one restarted: its counter began again
        if steady:
            spells[-1].append((at, answered))
        elif spells[-1]:
            spells.append([])
    spell = max(spells, key=len)
    # The premise: Patroni demoted the primary, for a good part of the outage.
    seen = " ".join(f"{at - outcome.started:.0f}s:" + ",".join(
        f"{n}={'-' if st is None else 'ro' if st[0] else 'rw'}" for n, st in states.items())
        for at, states in outcome.probes)
    assert len(spell) >= 4 and spell[-1][0] - spell[0][0] >= 3, seen
    (t0, first), (t1, last) = spell[0], spell[-1]
    probes = len(first) * (len(spell) - 1)
    opened = sum(last[n][1] - first[n][1] for n in first) - probes
    per_second = opened / (t1 - t0) / len(run.fleet.procs)
    assert opened > 0, (spell, "the replicas did not retry at all")
    assert per_second < RETRY_BOUND, (
        f"{per_second:.1f} sessions a second per replica process over {t1 - t0:.1f}s of read-only")
