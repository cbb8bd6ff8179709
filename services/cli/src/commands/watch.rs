//! `provledger watch [KIND/ID] [--after P] [--kind K]... [--operation OP] [--event TYPE]...`:
//! the ledger's changes as serve applies them, one line per commit (as `kubectl get -w` or
//! `nats sub`), through `provledger_client::follow::Follower` (docs/following.md): the
//! commits after `--after`, then each new one, in position order, none missed and none
//! twice. Without `--after` it starts at the end that the answering replica reports in
//! `q.health` (`position`: what it has applied), so it shows what happens from now on.
//!
//! It ends on SIGINT or SIGTERM (exit 0, naming on stderr the position to resume from) and
//! on a closed stdout (SIGPIPE, which `main` restores to its default). The filter is the
//! one `q.changes` applies (`ChangeFilter`); event names are checked against the catalogue
//! here, before anything is asked, so that a typo is told at once.

use std::collections::BTreeSet;
use std::io::Write;
use std::time::Duration;

use provledger_client::follow::{Change, ChangeFilter, FollowError, Followed, Follower};
use provledger_events::{short_aggregate, short_id, Commit};
use provledger_projections::timeline;
use provledger_serve::messages::HistoryItem;

use super::signals::StopSignal;
use super::{printable, CommandError};

/// How long the start asks `q.health` for the current end.
const END_REPLY_WAIT: Duration = Duration::from_secs(10);
/// The characters of a text line's event summaries, at most: a commit of many events
/// stays one readable line (`--json` has them whole).
const SUMMARY_CHARS_MAX: usize = 120;

/// What to follow, and how to print it.
pub struct Watch<'a> {
    pub nats_url: &'a str,
    pub auth: &'a provledger_client::NatsAuth,
    pub prefix: &'a str,
    pub filter: ChangeFilter,
    /// The last position already seen (0: from the first commit); `None`: from now.
    pub after: Option<u64>,
    pub json: bool,
}

/// The `--event` names, each checked against the catalogue (exit 2 naming an unknown one,
/// as `q.changes` would refuse it).
pub fn event_types(given: Vec<String>) -> Result<BTreeSet<String>, CommandError> {
    let known = provledger_events::Event::names();
    given
        .into_iter()
        .map(|name| {
            if known.contains(&name) {
                Ok(name)
            } else {
                Err(CommandError::BadInput(format!(
                    "--event {:?} is not an event of the catalogue (docs/events.md)",
                    printable(&name)
                )))
            }
        })
        .collect()
}

/// Follows until a signal, a closed stdout, or an error of the follower.
pub async fn run(watch: Watch<'_>) -> Result<(), CommandError> {
    let mut stop = StopSignal::listen()?;
    let after = match watch.after {
        Some(after) => after,
        None => match stop.or(current_end(&watch)).await {
            Some(end) => end?,
            None => return Ok(()),
        },
    };
    let client = provledger_client::connect_nats(watch.nats_url, "provledger-watch", watch.auth);
    let client = match stop.or(client).await {
        Some(client) => client?,
        None => return stopped(after),
    };
    let started = Follower::start(client, watch.prefix, watch.filter, after);
    let mut follower = match stop.or(started).await {
        Some(follower) => follower.map_err(follow_error)?,
        None => return stopped(after),
    };
    let mut told_current = false;
    loop {
        // A cancelled `next` has handed nothing over: its position is still where to resume.
        let Some(followed) = stop.or(follower.next()).await else {
            return stopped(follower.position());
        };
        match followed.map_err(follow_error)? {
            Followed::Change(change) => {
                if !print_change(&change, watch.json)? {
                    return Ok(());
                }
            }
            Followed::Current { position } if !told_current && !watch.json => {
                told_current = true;
                eprintln!("-- current at {position}, waiting for changes");
            }
            Followed::Current { .. } => {}
        }
    }
}

/// The end the answering replica has applied (`q.health`'s `position`): where "from now"
/// starts.
async fn current_end(watch: &Watch<'_>) -> Result<u64, CommandError> {
    let subject = format!("{}.q.health", watch.prefix);
    let reply = super::query::ask(
        watch.nats_url,
        watch.auth,
        &subject,
        "{}".into(),
        END_REPLY_WAIT,
    )
    .await?;
    super::query::refusal(&reply)?;
    reply["data"]["position"].as_u64().ok_or_else(|| {
        CommandError::Problem(format!("{subject} answered without a position: {reply}"))
    })
}

/// A signal ended the watch: say where to resume.
fn stopped(position: u64) -> Result<(), CommandError> {
    eprintln!("-- stopped; resume with --after {position}");
    Ok(())
}

/// Prints one change: its JSON on one line, or its text line. `false` once stdout is
/// closed (where SIGPIPE does not end the process first).
fn print_change(change: &Change, json: bool) -> Result<bool, CommandError> {
    let line = if json {
        let item = HistoryItem {
            commit: change.commit.clone(),
            timeline: change.timeline.clone(),
        };
        serde_json::to_string(&item).map_err(|e| {
            CommandError::Problem(format!(
                "cannot render the change at #{} as JSON: {e}",
                change.commit.position
            ))
        })?
    } else {
        text_line(&change.commit)
    };
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}") {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(CommandError::Infrastructure(format!(
            "cannot write to stdout: {e}"
        ))),
    }
}

/// `#POSITION  KIND/SHORT vVERSION  EVENTS SUMMARY  by ACTOR  op SHORT`: the ledger's text
/// (names, descriptions, the actor) with its control characters escaped.
fn text_line(commit: &Commit) -> String {
    let names: Vec<&str> = commit.events.iter().map(|e| e.name()).collect();
    let summaries: Vec<String> = commit.events.iter().map(timeline::summary).collect();
    let mut summary = summaries.join("; ");
    if let Some((cut, _)) = summary.char_indices().nth(SUMMARY_CHARS_MAX) {
        summary.truncate(cut);
        summary.push_str("...");
    }
    let mut line = format!(
        "#{:<6} {} v{:<3} {} {}  by {}",
        commit.position,
        short_aggregate(&commit.aggregate),
        commit.version,
        names.join(","),
        summary,
        commit.actor,
    );
    if let Some(op) = &commit.operation_id {
        line.push_str(&format!("  op {}", short_id(op)));
    }
    printable(&line).into_owned()
}

/// The follower's errors as the command's: a refusal of the request (an event `q.changes`
/// does not know, say) is bad input; serve not answering, or NATS gone, is infrastructure.
fn follow_error(e: FollowError) -> CommandError {
    match &e {
        FollowError::Refused { code, .. } if code == "bad_request" => {
            CommandError::BadInput(e.to_string())
        }
        FollowError::Refused { .. } => CommandError::Problem(e.to_string()),
        FollowError::Subscribe { .. } | FollowError::CatchUp { .. } | FollowError::FeedEnded => {
            CommandError::Infrastructure(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::catalogue::samples;
    use provledger_events::{AggregateId, CommitDraft, Hash};
    use uuid::Uuid;

    #[test]
    fn a_text_line_names_the_commit_shortly_and_escapes_the_ledgers_text() {
        // Given a commit of an operation whose actor holds an escape sequence,
        let mut draft = CommitDraft::now("svc\u{1b}[2J", vec![samples::all().remove(0)]);
        let op = Uuid::parse_str("01a20c10-bda9-71ad-a2a6-71eec13912d3").unwrap();
        draft.operation_id = Some(op);
        let cluster = AggregateId::cluster(Uuid::from_u128(0xabc));
        let mut commit = Commit::seal(cluster, 1, Hash::ZERO, draft);
        commit.position = 1217;
        // when it is rendered as a line,
        let line = text_line(&commit);
        // then it has its position, short aggregate, version, event, actor and operation,
        assert!(
            line.starts_with("#1217   cluster/000000000abc v1 "),
            "{line}"
        );
        assert!(
            line.contains("cluster_create_requested name=analytics"),
            "{line}"
        );
        assert!(line.contains("  op 71eec13912d3"), "{line}");
        // and no control character from the ledger reaches the terminal.
        assert!(!line.chars().any(char::is_control), "{line}");
        assert!(line.contains("by svc\\u{1b}[2J"), "{line}");
    }

    #[test]
    fn an_event_name_outside_the_catalogue_is_refused_naming_it() {
        let known = event_types(vec!["vm_state_changed".into()]).unwrap();
        assert!(known.contains("vm_state_changed"));
        let e = event_types(vec!["vm_state_changed".into(), "vm_flew_away".into()]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("vm_flew_away"), "{e}");
    }
}
