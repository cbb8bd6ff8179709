//! A worker's side of leases (see `provledger_projections::recovery`): record
//! `task_started` with a lease when the task really starts, renew it while working, at
//! most once per half lease (the heartbeat is bounded in rate however often the worker
//! calls), and record `task_finished` at the end.

use std::time::Duration;

use provledger_events::catalogue::{TaskOutcome, TaskState};
use provledger_events::{AggregateId, Event, EventLog, Expectation, Timestamp};
use uuid::Uuid;

use crate::clock::Stamper;
use crate::write::{record, RecordError};

/// A task this worker holds.
#[derive(Debug, Clone)]
pub struct TaskLease {
    instance: AggregateId,
    task: TaskState,
    worker: String,
    lease: Duration,
    until: Timestamp,
}

impl TaskLease {
    /// Records `task_started` for `task` on `instance` with a lease of `lease` from now.
    pub async fn start<L: EventLog>(
        log: &L,
        instance: Uuid,
        task: TaskState,
        worker: &str,
        lease: Duration,
        stamper: &Stamper,
    ) -> Result<TaskLease, RecordError> {
        let until = stamper.now().plus_ms(lease.as_millis() as i64);
        let event = Event::TaskStarted {
            task_state: task,
            worker_id: worker.to_string(),
            lease_until: until,
        };
        let aggregate = AggregateId::instance(instance);
        record(
            log,
            aggregate,
            Expectation::Any,
            stamper.draft(worker, vec![event]),
        )
        .await?;
        Ok(TaskLease {
            instance: aggregate,
            task,
            worker: worker.to_string(),
            lease,
            until,
        })
    }

    pub fn until(&self) -> Timestamp {
        self.until
    }

    /// Renews the lease if less than half of it is left; otherwise writes nothing.
    /// Returns whether a renewal was recorded.
    pub async fn renew_if_due<L: EventLog>(
        &mut self,
        log: &L,
        stamper: &Stamper,
    ) -> Result<bool, RecordError> {
        let now = stamper.now();
        let half = (self.lease.as_millis() / 2) as i64;
        if now.plus_ms(half) < self.until {
            return Ok(false);
        }
        let until = now.plus_ms(self.lease.as_millis() as i64);
        let event = Event::TaskLeaseRenewed {
            worker_id: self.worker.clone(),
            lease_until: until,
        };
        record(
            log,
            self.instance,
            Expectation::Any,
            stamper.draft(&self.worker, vec![event]),
        )
        .await?;
        self.until = until;
        Ok(true)
    }

    /// Records `task_finished` with `outcome`.
    pub async fn finish<L: EventLog>(
        self,
        log: &L,
        outcome: TaskOutcome,
        reason: &str,
        stamper: &Stamper,
    ) -> Result<(), RecordError> {
        let event = Event::TaskFinished {
            task_state: self.task,
            outcome,
            reason: reason.to_string(),
        };
        record(
            log,
            self.instance,
            Expectation::Any,
            stamper.draft(&self.worker, vec![event]),
        )
        .await
        .map(|_| ())
    }
}
