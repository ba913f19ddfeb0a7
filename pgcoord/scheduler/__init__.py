"""``Scheduler``: run-once cron across replicas, on ``pgcoord.job_slots``.

Every replica runs the same loop, with no leader. The schedules are rows of
``pgcoord.schedules`` (declared in code with ``@cron``, or added at run time
naming a handler registered with ``@job``); a replica loads those it has a
function for, and keeps each one's next slot in memory. Each tick reads the
database clock and the schedules' change counter (reloading when it moved),
then decides every due slot of every schedule in a few set-based statements
(``schedule_decide``): a claim for each slot to run, a ``missed`` or
``skipped`` row for the others. The table's primary key (job, slot instant)
lets exactly one claim succeed, and that replica runs the slot. Every slot since
a schedule was registered ends as a row in a terminal state with a reason:
succeeded, failed, abandoned, missed or skipped. Cron expressions are evaluated
by cronsim, which follows Debian cron across daylight-saving changes; a claimed
slot runs under a lease-like claim.

When a runner dies, its claim expires; with ``on_crash="skip"`` any replica
then records the slot ``abandoned`` (at most once); with ``"retry"`` one
replica takes it over as the next attempt, up to ``max_attempts``.

The loop survives the database: a tick that fails (a lost connection, a
server restart, a terminated session) is logged and tried again after a
back-off; it never ends ``run()``.

The modules, one concept each. With no I/O: ``cron`` (one schedule's slots:
which instants, which run, which are missed), ``plan`` (a tick's decisions over
many schedules, batches, back-off, backfill ranges), ``registry`` (the code's
schedules and the handlers; a loaded row as a runnable ``Job``). With I/O:
``store`` (the statements on schedules and job_slots), ``claims`` (claims made,
runs started), ``runner`` (one claimed slot: body, heartbeat, timeout, record),
``runs`` (the runs of a replica, which the scheduler holds), ``finisher`` (run
ends recorded in batches), ``alerts`` (schedules that keep failing),
``membership`` (what a ``member=`` means for the scheduler) and ``loop`` (the
``Scheduler``). ``pgcoord.schedules`` changes schedules at run time.
"""

from .._drivers.capacity import pool_capacity
from .loop import Scheduler
from .runner import Slot

__all__ = ["Scheduler", "Slot", "pool_capacity"]
