//! `provledger operation list [--status S] [--kind K] [--target KIND/ID] [--since 10m]`:
//! the operator's worklist, newest first. `operation show OP`: one operation whole, with
//! the command that moves it on. `operation cancel OP --reason TEXT`: cancels a running
//! operation, and the rollback follows. With `--nats` it asks a running service
//! (`q.operation.list`); embedded (or on a stopped service's data dir) it reads the local
//! projection store. Either way the listing walks the store's operation indexes (status,
//! kind, target), not every operation.

use std::time::Duration;

use provledger_client::{read_operation, CancelNotices, Ledger, Stamper, Writer};
use provledger_events::catalogue::Executor;
use provledger_events::{AggregateId, Event, Expectation, SledLog, Timestamp};
use provledger_projections::operation::{CompensationProgress, OperationStatus, StepProgress};
use provledger_projections::planner::{action_word, render_plan};
use provledger_projections::view::{age, CompensationView, OperationView};
use provledger_projections::Entity;
use provledger_serve::OperationFilter;
use serde_json::{json, Value};
use uuid::Uuid;

use super::state::open_local_store;
use super::{print_json, printable, CommandError};

/// How long the service may take to answer (its own waits are bounded well below this).
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// What `operation list` asks for.
pub struct ListRequest {
    pub filter: OperationFilter,
    pub limit: usize,
    pub after: Option<Uuid>,
    /// What ages are counted to (`--since` was counted back from it).
    pub now: Timestamp,
}

/// Lists from the local store.
pub async fn list_local(log: &SledLog, req: ListRequest, json: bool) -> Result<(), CommandError> {
    let store = open_local_store(log).await?;
    let mut views = Vec::new();
    let listed = store
        .operations_newest_first(&req.filter, req.after)
        .filter(|e| e.as_ref().map_or(true, |e| req.filter.accepts(e)));
    for entity in listed.take(req.limit) {
        if let provledger_projections::Entity::Operation(op) = entity? {
            views.push(
                serde_json::to_value(provledger_projections::view::OperationSummary::of(&op))
                    .unwrap_or(Value::Null),
            );
        }
    }
    print_list(&views, &req, json);
    Ok(())
}

/// Lists through a running service.
pub async fn list_remote(
    nats_url: &str,
    auth: &provledger_client::NatsAuth,
    prefix: &str,
    req: ListRequest,
    json: bool,
) -> Result<(), CommandError> {
    let mut body = json!({ "limit": req.limit });
    if let Some(s) = &req.filter.status {
        body["status"] = s.as_str().into();
    }
    if let Some(k) = &req.filter.kind {
        body["kind"] = k.as_str().into();
    }
    if let Some(t) = &req.filter.target {
        body["target"] = t.to_string().into();
    }
    if let Some(since) = &req.filter.since {
        body["since"] = since.to_string().into();
    }
    if let Some(a) = &req.after {
        body["after"] = a.to_string().into();
    }
    let subject = format!("{prefix}.q.operation.list");
    let value = super::query::ask(nats_url, auth, &subject, body.to_string(), LIST_TIMEOUT).await?;
    super::query::refusal(&value)?;
    let views = value["data"].as_array().cloned().unwrap_or_default();
    print_list(&views, &req, json);
    Ok(())
}

fn print_list(views: &[Value], req: &ListRequest, json: bool) {
    if json {
        print_json(&Value::Array(views.to_vec()));
        return;
    }
    if views.is_empty() {
        println!("no operation matches");
        return;
    }
    println!("{}", header());
    for v in views {
        println!("{}", line(v, req.now));
    }
    if views.len() == req.limit {
        if let Some(last) = views.last().and_then(|v| v["id"].as_str()) {
            println!("(older ones may follow: add --after {last})");
        }
    }
}

/// The column names, aligned with [`line`].
fn header() -> String {
    format!(
        "{:<36}  {:<20} {:<16} {:<20} {:>7} {:>7}  {}",
        "ID", "KIND", "STATUS", "STARTED", "AGE", "IDLE", "TARGET"
    )
}

/// One operation on one line: full id (to paste into `rollback run`), kind, status, when it
/// started, its age and how long since its last commit (a `running` operation idle for
/// hours has lost its writer), target, and for a stopped rollback how many compensations
/// are not done.
fn line(v: &Value, now: Timestamp) -> String {
    let word = |field: &str| v[field].as_str().unwrap_or("-").to_string();
    let time = |field: &str| {
        v[field]
            .as_str()
            .and_then(|t| Timestamp::parse_rfc3339(t).ok())
    };
    let since = |field: &str| time(field).map_or("-".to_string(), |t| age(t, now));
    let started = time("started_at").map_or("-".to_string(), |t| {
        // To the second: the column's width.
        Timestamp::from_unix_ms(t.unix_ms() - t.unix_ms().rem_euclid(1000)).to_rfc3339()
    });
    let id = v["id"].as_str().unwrap_or("-");
    let open = v["compensations_not_done"].as_u64().unwrap_or(0);
    let mut out = format!(
        "{id:<36}  {:<20} {:<16} {:<20} {:>7} {:>7}  {}",
        word("kind"),
        word("status"),
        started,
        since("started_at"),
        since("last_commit_at"),
        word("target")
    );
    if word("status") == "needs_attention" {
        out.push_str(&format!("  ({open} compensation(s) not done)"));
    }
    out
}

/// How long one line of `operation show` may be.
const SHOW_COLUMNS: usize = 100;

/// Steps `operation show` lists in text (`--json` has them all).
const SHOW_STEPS_MAX: usize = 50;

/// Compensations `operation show` lists in text (`--json` has them all).
const SHOW_COMPENSATIONS_MAX: usize = 200;

/// What `operation cancel` is asked to do.
pub struct Cancel {
    pub id: Uuid,
    pub reason: String,
    pub actor: String,
    /// Where the executors answer, for the rollback driven embedded.
    pub executors_url: Option<String>,
    pub nats_url: Option<String>,
    pub auth: provledger_client::NatsAuth,
    pub prefix: String,
}

/// `operation cancel OP --reason TEXT`: records `cancellation_requested` through the write
/// path (the fold refuses it, with why, on an operation that already stopped or closed),
/// tells a live runner over NATS, and then the rollback follows: with `--nats` serve's
/// rollback worker carries it out (this command says when); embedded no runner can be
/// alive (this process holds the data dir), so this command drives the rollback to the
/// end as `rollback run` does.
pub async fn cancel(writer: &Writer<Ledger>, c: Cancel, json: bool) -> Result<(), CommandError> {
    let id = c.id;
    read_operation(writer, id).await.map_err(|_| {
        CommandError::Problem(format!(
            "operation {id} not found in this ledger (check --data-dir / --nats)"
        ))
    })?;
    let draft = Stamper::system()
        .draft(
            &c.actor,
            vec![Event::cancellation_requested(c.reason.clone())],
        )
        .with_operation(id);
    writer
        .record(AggregateId::operation(id), Expectation::Any, draft)
        .await
        .map_err(|e| match CommandError::from(e) {
            CommandError::Problem(m) => {
                CommandError::Problem(format!("cancellation of operation {id} refused: {m}"))
            }
            other => other,
        })?;
    if !json {
        println!(
            "cancellation of operation {id} recorded by {}: {}",
            printable(&c.actor),
            printable(&c.reason)
        );
    }
    if !matches!(writer.log(), Ledger::JetStream(_)) {
        // Embedded: the rollback follows here, as `rollback run` drives it.
        return super::rollback::run(
            writer,
            id,
            c.executors_url.as_deref(),
            &c.auth,
            &c.prefix,
            json,
        )
        .await;
    }
    if let Some(url) = &c.nats_url {
        // Wakes a live runner now rather than at its next append; the log already decides.
        let client = provledger_client::connect_nats(url, "provledger-cancel", &c.auth).await?;
        CancelNotices::nats(client, &c.prefix)
            .publish(id, &c.reason)
            .await;
    }
    let op = read_operation(writer, id)
        .await
        .map_err(|e| CommandError::Problem(e.to_string()))?;
    if json {
        print_json(&op.view());
        return Ok(());
    }
    let policy = super::rollback::cli_policy(writer);
    print!("{}", super::rollback::pending_note(&op, &policy));
    let invocation = super::invocation::current();
    println!(
        "the rollback follows: serve's rollback worker plans and drives it once the operation is \
         cancelled"
    );
    println!(
        "{}",
        wrap_command(
            "follow it: ",
            &invocation.command(&format!("operation show {id}"))
        )
    );
    println!(
        "{}",
        wrap_command(
            "no serve running? ",
            &invocation.command(&format!("rollback run {id}"))
        )
    );
    Ok(())
}

/// `operation show OP` from the local store (embedded, or a stopped service's data dir).
pub async fn show_local(
    log: &SledLog,
    id: Uuid,
    now: Timestamp,
    json: bool,
) -> Result<(), CommandError> {
    let store = open_local_store(log).await?;
    let Some(Entity::Operation(op)) = store.entity(&AggregateId::operation(id))? else {
        return Err(not_found(id));
    };
    show(&OperationView::of(&op), now, false, json)
}

/// `operation show OP` through a running service (`q.operation.get`).
pub async fn show_remote(
    nats_url: &str,
    auth: &provledger_client::NatsAuth,
    prefix: &str,
    id: Uuid,
    now: Timestamp,
    json: bool,
) -> Result<(), CommandError> {
    let subject = format!("{prefix}.q.operation.get");
    let body = json!({ "id": id }).to_string();
    let value = super::query::ask(nats_url, auth, &subject, body, LIST_TIMEOUT).await?;
    if value["error"]["code"].as_str() == Some("not_found") {
        return Err(not_found(id));
    }
    super::query::refusal(&value)?;
    let view: OperationView = serde_json::from_value(value["data"].clone()).map_err(|e| {
        CommandError::Problem(format!("the service's operation view does not parse: {e}"))
    })?;
    show(&view, now, true, json)
}

fn not_found(id: Uuid) -> CommandError {
    CommandError::Problem(format!(
        "operation {id} not found in this ledger (check --data-dir / --nats; `operation list` \
         lists them)"
    ))
}

fn show(
    view: &OperationView,
    now: Timestamp,
    served: bool,
    json: bool,
) -> Result<(), CommandError> {
    if json {
        print_json(&serde_json::to_value(view).unwrap_or(Value::Null));
    } else {
        print!("{}", render_show(view, now, served));
    }
    Ok(())
}

use provledger_projections::planner::json_word as word;

/// `operation show`'s text, at most [`SHOW_COLUMNS`] wide: long text is wrapped, commands
/// are continued with ` \` so that they paste as printed.
pub fn render_show(v: &OperationView, now: Timestamp, served: bool) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    let id = v.id;
    let status = v.status.map_or("-".to_string(), |s| word(&s));
    line(format!(
        "operation {id} ({})",
        v.kind.map_or("-".to_string(), |k| word(&k))
    ));
    line(format!(
        "  target       {}",
        v.target.map_or("-".to_string(), |t| t.to_string())
    ));
    let running = v.status == Some(OperationStatus::Running);
    let stage = v
        .stage
        .as_ref()
        .map(|s| {
            let at = if running { "in" } else { "stopped in" };
            format!(" ({at} stage {})", printable(s))
        })
        .unwrap_or_default();
    line(format!("  status       {status}{stage}"));
    let time = |t: Option<Timestamp>, with_age: &str| {
        t.map_or("-".to_string(), |t| {
            format!("{}  ({with_age} {})", t.to_rfc3339(), age(t, now))
        })
    };
    line(format!("  started_at   {}", time(v.started_at, "age")));
    if v.failed_at.is_some() {
        line(format!("  failed_at    {}", time(v.failed_at, "for")));
    }
    line(format!("  finished_at  {}", time(v.finished_at, "for")));
    line(format!("  last commit  {}", time(v.last_commit_at, "idle")));
    if let Some(e) = &v.error {
        let at = match &e.step {
            Some(step) => format!("stage {}, step {}", printable(&e.stage), printable(step)),
            None => format!("stage {}", printable(&e.stage)),
        };
        wrapped(
            &mut line,
            "  error        ",
            &format!("{at}: {}", printable(&e.message)),
        );
    }
    if let Some(reason) = &v.cancellation_reason {
        wrapped(&mut line, "  cancellation ", &printable(reason));
    }
    if v.target_deleted {
        line("  target being deleted by a user: the rollback removes what it made".into());
    }
    // Stages, each with its policy and progress.
    let stages: Vec<String> = v
        .stages
        .iter()
        .map(|s| {
            let progress = if v.steps.iter().any(|st| st.stage == s.name)
                || v.stage.as_deref() == Some(s.name.as_str())
            {
                if v.stage.as_deref() != Some(s.name.as_str()) {
                    "passed"
                } else if running {
                    "current"
                } else {
                    "stopped here"
                }
            } else {
                "not reached"
            };
            format!("{} ({}, {progress})", printable(&s.name), word(&s.policy))
        })
        .collect();
    wrapped(
        &mut line,
        "  stages       ",
        &if stages.is_empty() {
            "-".to_string()
        } else {
            stages.join(", ")
        },
    );
    // Steps.
    line(format!("steps ({}):", v.steps.len()));
    for (i, s) in v.steps.iter().enumerate().take(SHOW_STEPS_MAX) {
        wrapped(
            &mut line,
            &format!("  {:>3}. ", i + 1),
            &format!(
                "{}/{}: {}",
                printable(&s.stage),
                printable(&s.name),
                word(&s.state)
            ),
        );
        wrapped(
            &mut line,
            "       ",
            &format!(
                "{} {} at {}",
                effect_word(&s.effect.kind),
                printable(&s.effect.resource),
                printable(&s.effect.executor)
            ),
        );
    }
    if v.steps.len() > SHOW_STEPS_MAX {
        line(format!(
            "  ... {} more (--json has them all)",
            v.steps.len() - SHOW_STEPS_MAX
        ));
    }
    if !v.started.is_empty() {
        line(format!(
            "started, outcome never recorded ({}):",
            v.started.len()
        ));
        for s in &v.started {
            wrapped(
                &mut line,
                "  ",
                &format!(
                    "{}/{} at {}, idempotency key {}",
                    printable(&s.stage),
                    printable(&s.name),
                    printable(&s.executor),
                    printable(&s.idempotency_key)
                ),
            );
        }
    }
    // The plan and each compensation.
    match &v.rollback_plan {
        None => line("rollback plan: none recorded".into()),
        Some(plan) => {
            line(format!(
                "rollback plan: {}",
                v.rollback_outcome
                    .map_or("in progress".to_string(), |o| format!(
                        "finished {}",
                        word(&o)
                    ))
            ));
            for l in render_plan(plan).lines() {
                if l.starts_with("compensations") || l.starts_with("  ") && l.contains(" id ") {
                    continue; // listed below, with full ids and states
                }
                wrapped(&mut line, "  ", &printable(l));
            }
            line(format!(
                "compensations ({}), in order:",
                v.compensations.len()
            ));
            for (i, c) in v
                .compensations
                .iter()
                .enumerate()
                .take(SHOW_COMPENSATIONS_MAX)
            {
                line(format!(
                    "  {:>3}. {}  {}",
                    i + 1,
                    c.compensation_id,
                    state_of(c)
                ));
                wrapped(
                    &mut line,
                    "       ",
                    &format!(
                        "{} {} by {}  [{}/{}]",
                        action_word(&c.action),
                        printable(&c.resource),
                        executor_name(&c.executor),
                        printable(&c.stage),
                        printable(&c.step)
                    ),
                );
                if let Some(e) = &c.last_error {
                    if c.state != CompensationProgress::Done {
                        wrapped(&mut line, "       last error: ", &printable(e));
                    }
                }
                if let Some(r) = &c.resolved {
                    wrapped(&mut line, "       resolved by hand: ", &printable(r));
                }
            }
            if v.compensations.len() > SHOW_COMPENSATIONS_MAX {
                line(format!(
                    "  ... {} more (--json has them all)",
                    v.compensations.len() - SHOW_COMPENSATIONS_MAX
                ));
            }
        }
    }
    for l in remains(v) {
        line(l);
    }
    for l in next_commands(v, served) {
        line(l);
    }
    out
}

/// A compensation's state in words: done, planned, requested or failed, with attempts.
fn state_of(c: &CompensationView) -> String {
    match (c.state, c.attempts) {
        (CompensationProgress::Done, _) if c.resolved.is_some() => "done (resolved by hand)".into(),
        (CompensationProgress::Planned, 0) => "planned, never attempted".into(),
        (state, n) => format!("{} after {n} attempt(s)", word(&state)),
    }
}

fn executor_name(executor: &Executor) -> String {
    match executor {
        Executor::Ledger => "ledger".into(),
        Executor::Service(name) => printable(name).into_owned(),
    }
}

/// What remains at which executor: the effects not compensated (a step done and not
/// undone, or kept on purpose by the plan), and the actions whose outcome is unknown.
fn remains(v: &OperationView) -> Vec<String> {
    let mut by_executor: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    // A step without a compensation removed or changed something (a node terminated):
    // nothing of it is held anywhere.
    for s in v.steps.iter().filter(|s| s.compensation.is_some()) {
        if s.state == StepProgress::Compensated {
            continue;
        }
        let how = match s.state {
            StepProgress::Retained => "kept by the plan".to_string(),
            StepProgress::Done => "not undone".to_string(),
            other => word(&other),
        };
        by_executor
            .entry(printable(&s.effect.executor).into_owned())
            .or_default()
            .push(format!(
                "{} {} ({how})",
                effect_word(&s.effect.kind),
                printable(&s.effect.resource)
            ));
    }
    let undone = |stage: &str, step: &str| {
        v.compensations
            .iter()
            .any(|c| c.stage == stage && c.step == step && c.state == CompensationProgress::Done)
    };
    for s in v.started.iter().filter(|s| !undone(&s.stage, &s.name)) {
        by_executor
            .entry(printable(&s.executor).into_owned())
            .or_default()
            .push(format!(
                "{} (outcome unknown, key {})",
                printable(&s.name),
                printable(&s.idempotency_key)
            ));
    }
    if by_executor.is_empty() {
        return vec!["remains at the executors: nothing".into()];
    }
    let mut out = vec!["remains at the executors:".to_string()];
    for (executor, what) in by_executor {
        out.push(format!("  {executor} ({}):", what.len()));
        for item in what {
            wrapped(&mut |l| out.push(l), "    - ", &item);
        }
    }
    out
}

/// An effect's kind as JSON names it (a custom kind by its own name).
fn effect_word(kind: &provledger_events::catalogue::EffectKind) -> String {
    match serde_json::to_value(kind) {
        Ok(Value::String(s)) => s,
        Ok(Value::Object(map)) if map.len() == 1 => map
            .values()
            .next()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{kind:?}")),
        _ => format!("{kind:?}"),
    }
}

/// The command that moves the operation on, carrying this invocation's global flags.
fn next_commands(v: &OperationView, served: bool) -> Vec<String> {
    let invocation = super::invocation::current();
    let id = v.id;
    let cmd = |rest: String| invocation.command(&rest);
    let mut out = Vec::new();
    let mut say = |prefix: &str, command: String| out.push(wrap_command(prefix, &command));
    let worker = if served {
        "serve's rollback worker drives it; "
    } else {
        ""
    };
    match v.status {
        Some(OperationStatus::Running) if v.cancellation_reason.is_some() => {
            let wait = provledger_projections::rollback::RetryPolicy::default().runner_stop_wait_ms;
            let note = if served {
                format!(
                    "next: its runner stops at its next step, or (if it died) serve's rollback \
                     worker records the cancellation after {} s without a commit; or: ",
                    wait / 1000
                )
            } else {
                "next (no runner can be alive embedded: it records the cancellation at once): "
                    .to_string()
            };
            say(&note, cmd(format!("rollback run {id}")));
        }
        Some(OperationStatus::Running) => {
            say(
                "next: it is running; if its writer died (see last commit): ",
                cmd(format!("operation cancel {id} --reason TEXT")),
            );
        }
        Some(OperationStatus::Failed)
        | Some(OperationStatus::Cancelled)
        | Some(OperationStatus::RollingBack)
            if v.rollback_outcome.is_none() =>
        {
            say(
                &format!("next: {worker}or: "),
                cmd(format!("rollback run {id}")),
            );
        }
        Some(OperationStatus::NeedsAttention) => {
            let open: Vec<&CompensationView> = v
                .compensations
                .iter()
                .filter(|c| c.state != CompensationProgress::Done)
                .collect();
            let failed: Vec<&&CompensationView> = open
                .iter()
                .filter(|c| c.attempts > 0 && c.executor != Executor::Ledger)
                .collect();
            // The ledger's own compensations are applied when the rollback resumes.
            let untried = open
                .iter()
                .filter(|c| c.attempts == 0 && c.executor != Executor::Ledger)
                .count();
            let why = match (failed.is_empty(), untried) {
                (true, _) => "next: request what is not done:".to_string(),
                (false, 0) => "next: fix what fails (the last errors above), then:".to_string(),
                (false, n) => format!(
                    "next: fix what fails (the last errors above), then request it and the {n} \
                     never attempted (the executors' to do, never resolved by hand):"
                ),
            };
            say(&format!("{why} "), cmd(format!("rollback run {id}")));
            for c in failed {
                say(
                    &format!("  or, once {} is removed by hand: ", c.compensation_id),
                    cmd(format!(
                        "rollback resolve {id} --compensation {} --reason TEXT",
                        c.compensation_id
                    )),
                );
            }
        }
        Some(OperationStatus::Held) => {
            out.push("next: nothing; the operation is closed (held: the plan kept what is listed as kept)".into());
        }
        Some(_) => out.push("next: nothing; the operation is closed".into()),
        None => out.push("next: nothing; the operation never started".into()),
    }
    out
}

/// `text` wrapped to [`SHOW_COLUMNS`] as lines, each ending in a newline.
pub fn wrap_text(text: &str) -> String {
    let mut out = String::new();
    for paragraph in text.lines() {
        wrapped(
            &mut |l| {
                out.push_str(&l);
                out.push('\n');
            },
            "",
            paragraph,
        );
    }
    out
}

/// `text` after `prefix`, wrapped at spaces to [`SHOW_COLUMNS`], continued under the
/// prefix's width.
fn wrapped(line: &mut impl FnMut(String), prefix: &str, text: &str) {
    let indent = " ".repeat(prefix.chars().count());
    let width = SHOW_COLUMNS.saturating_sub(prefix.chars().count()).max(20);
    let mut current = String::new();
    let mut first = true;
    let mut emit = |s: &str, first: &mut bool| {
        let head = if *first { prefix } else { &indent };
        line(format!("{head}{s}").trim_end().to_string());
        *first = false;
    };
    for word in text.split(' ') {
        let mut word = word.to_string();
        while word.chars().count() > width {
            // A word longer than a line (a long resource name) is cut across lines.
            if !current.is_empty() {
                emit(&current, &mut first);
                current.clear();
            }
            let head: String = word.chars().take(width).collect();
            word = word.chars().skip(width).collect();
            emit(&head, &mut first);
        }
        if current.chars().count() + 1 + word.chars().count() > width && !current.is_empty() {
            emit(&current, &mut first);
            current.clear();
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(&word);
    }
    if !current.is_empty() || first {
        emit(&current, &mut first);
    }
}

/// A command to paste, after `prefix`: on one line when it fits [`SHOW_COLUMNS`], else
/// on its own lines continued with ` \` (the shell joins them), never cut inside a word
/// or a quoted argument.
pub fn wrap_command(prefix: &str, command: &str) -> String {
    if prefix.chars().count() + command.chars().count() <= SHOW_COLUMNS {
        return format!("{prefix}{command}");
    }
    let mut lines: Vec<String> = wrap_text(prefix.trim_end())
        .lines()
        .map(str::to_string)
        .collect();
    let mut current = "    ".to_string();
    for word in shell_words(command) {
        if current.trim().is_empty() {
            current.push_str(&word);
        } else if current.chars().count() + 1 + word.chars().count() + 2 > SHOW_COLUMNS {
            lines.push(format!("{current} \\"));
            current = format!("      {word}");
        } else {
            current.push(' ');
            current.push_str(&word);
        }
    }
    lines.push(current);
    lines.join("\n")
}

/// A command's words, a quoted argument ('...' or "...") kept whole.
fn shell_words(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut current = String::new();
    let mut quote: Option<char> = None;
    for c in command.chars() {
        match (quote, c) {
            (None, ' ') => {
                if !current.is_empty() {
                    words.push(std::mem::take(&mut current));
                }
            }
            (None, '\'' | '"') => {
                quote = Some(c);
                current.push(c);
            }
            (Some(q), c) if c == q => {
                quote = None;
                current.push(c);
            }
            _ => current.push(c),
        }
    }
    if !current.is_empty() {
        words.push(current);
    }
    words
}
