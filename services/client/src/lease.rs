//! A worker's side of leases (see `provledger_projections::recovery`): record
//! `task_started` with a lease when the task really starts, renew it while working, at
//! most once per half lease (the heartbeat is bounded in rate however often the worker
//! calls), and record `task_finished` at the end.
//!
//! The bounds are the decider's (`provledger_projections::lease`): a lease of
//! `LEASE_MS_MIN` to `LEASE_MS_MAX`, and a renewal no sooner than
//! [`renewal_not_before`] of the lease it renews. Each commit is recorded at the very
//! time the lease was computed from, so what this side finds due the decider admits.

use std::time::Duration;

use provledger_events::catalogue::{TaskOutcome, TaskState};
use provledger_events::{AggregateId, Event, EventLog, Expectation, Timestamp};
use provledger_projections::lease::renewal_not_before;
use uuid::Uuid;

use crate::clock::Stamper;
use crate::write::{RecordError, Writer};

/// A task this worker holds.
#[derive(Debug, Clone)]
pub struct TaskLease {
    instance: AggregateId,
    task: TaskState,
    worker: String,
    lease: Duration,
    /// When the current lease was granted: the `recorded_at` of its commit.
    since: Timestamp,
    until: Timestamp,
}

impl TaskLease {
    /// Records `task_started` for `task` on `instance` with a lease of `lease` from now.
    /// A lease outside `LEASE_MS_MIN..=LEASE_MS_MAX` is refused by the decider
    /// (`lease_too_short`, `lease_too_long`).
    pub async fn start<L: EventLog>(
        writer: &Writer<L>,
        instance: Uuid,
        task: TaskState,
        worker: &str,
        lease: Duration,
        stamper: &Stamper,
    ) -> Result<TaskLease, RecordError> {
        let since = stamper.now();
        let until = since.plus_ms(lease_ms(lease));
        let event = Event::task_started(task, worker, until);
        let aggregate = AggregateId::instance(instance);
        writer
            .record(
                aggregate,
                Expectation::Any,
                stamper.draft_at(since, worker, vec![event]),
            )
            .await?;
        Ok(TaskLease {
            instance: aggregate,
            task,
            worker: worker.to_string(),
            lease,
            since,
            until,
        })
    }

    pub fn until(&self) -> Timestamp {
        self.until
    }

    /// The earliest time the current lease may be renewed: half its length after it was
    /// granted (the decider's rule).
    pub fn renewal_due_at(&self) -> Timestamp {
        renewal_not_before(self.since, self.until)
    }

    /// Renews the lease if half of it has passed since it was granted; otherwise writes
    /// nothing. Returns whether a renewal was recorded.
    pub async fn renew_if_due<L: EventLog>(
        &mut self,
        writer: &Writer<L>,
        stamper: &Stamper,
    ) -> Result<bool, RecordError> {
        let now = stamper.now();
        if now < self.renewal_due_at() {
            return Ok(false);
        }
        let until = now.plus_ms(lease_ms(self.lease));
        let event = Event::task_lease_renewed(&self.worker, until);
        writer
            .record(
                self.instance,
                Expectation::Any,
                stamper.draft_at(now, &self.worker, vec![event]),
            )
            .await?;
        self.since = now;
        self.until = until;
        Ok(true)
    }

    /// Records `task_finished` with `outcome`.
    pub async fn finish<L: EventLog>(
        self,
        writer: &Writer<L>,
        outcome: TaskOutcome,
        reason: &str,
        stamper: &Stamper,
    ) -> Result<(), RecordError> {
        let event = Event::task_finished(self.task, outcome, reason);
        writer
            .record(
                self.instance,
                Expectation::Any,
                stamper.draft(&self.worker, vec![event]),
            )
            .await
            .map(|_| ())
    }
}

fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)
}
