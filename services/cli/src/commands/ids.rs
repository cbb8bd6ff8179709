//! Ids as a person gives them: every command that names an existing entity takes its whole
//! UUID, its short form (the last 12 hex digits, as text output and the console print it)
//! or the start of it (`provledger_events::IdRef`). A short one is resolved here to the one
//! entity it names: from the data dir's id index, or with `--nats` from the service's
//! (`q.id.resolve`). None, or more than one, is refused naming what was looked for and, if
//! ambiguous, the candidates.

use std::time::Duration;

use provledger_events::{short_id, AggregateKind, IdRef, SledLog};
use provledger_serve::IdMatches;
use serde_json::json;
use uuid::Uuid;

use super::CommandError;

/// How long a resolve waits for the service's reply.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where short ids are looked up.
pub enum IdSource<'a> {
    /// A data dir (embedded, or a stopped service's), projected first if behind.
    Local(&'a SledLog),
    /// A running service, over NATS.
    Remote {
        nats_url: &'a str,
        auth: &'a provledger_client::NatsAuth,
        prefix: &'a str,
    },
}

/// The one id of `kind` that `r` names. A whole UUID is taken as given (the command then
/// says if it is unknown); a short one must name exactly one entity.
pub async fn resolve(
    source: &IdSource<'_>,
    kind: AggregateKind,
    r: &IdRef,
) -> Result<Uuid, CommandError> {
    let digits = match r {
        IdRef::Full(id) => return Ok(*id),
        IdRef::Short(digits) => digits,
    };
    let found = lookup(source, kind, r).await?;
    one_of(kind, digits, found, source)
}

async fn lookup(
    source: &IdSource<'_>,
    kind: AggregateKind,
    r: &IdRef,
) -> Result<IdMatches, CommandError> {
    match source {
        IdSource::Local(log) => {
            let store = super::state::open_local_store(log).await?;
            Ok(store.resolve_ids(Some(kind), r)?)
        }
        IdSource::Remote {
            nats_url,
            auth,
            prefix,
        } => {
            let subject = format!("{prefix}.q.id.resolve");
            let body = json!({ "id": r.to_string(), "kind": kind }).to_string();
            let value = super::query::ask(nats_url, auth, &subject, body, RESOLVE_TIMEOUT)
                .await
                .map_err(|e| {
                    CommandError::Infrastructure(format!(
                        "{e} (a short id is resolved by the running service; give the whole \
                         id to go without it)"
                    ))
                })?;
            super::query::refusal(&value)?;
            let data: provledger_serve::messages::IdResolveData =
                serde_json::from_value(value["data"].clone()).map_err(|e| {
                    CommandError::Problem(format!(
                        "the service's q.id.resolve reply does not parse: {e}"
                    ))
                })?;
            Ok(IdMatches {
                ids: data.matches,
                more: data.more,
            })
        }
    }
}

/// The single match, or why there is none.
fn one_of(
    kind: AggregateKind,
    digits: &str,
    found: IdMatches,
    source: &IdSource<'_>,
) -> Result<Uuid, CommandError> {
    let ids: Vec<Uuid> = found
        .ids
        .iter()
        .filter(|a| a.kind == kind)
        .map(|a| a.id)
        .collect();
    match (ids.as_slice(), found.more) {
        ([id], false) => Ok(*id),
        ([], _) => {
            let place = match source {
                IdSource::Local(_) => "in this data dir",
                IdSource::Remote { .. } => "at the service (--nats)",
            };
            Err(CommandError::Problem(format!(
                "no {kind} has an id ending or beginning with {digits} {place}; `operation list`, \
                 `history` and the console show ids (the short form is an id's last 12 hex digits)"
            )))
        }
        (many, more) => Err(ambiguous(
            &format!(
                "{digits} is ambiguous: it names {}{} {kind}s",
                many.len(),
                if more { " or more" } else { "" },
            ),
            many.iter()
                .map(|id| format!("{kind}/{id}  ({})", short_id(id))),
        )),
    }
}

/// The refusal of an id that names several: what it names, then each candidate whole.
fn ambiguous(names: &str, candidates: impl Iterator<Item = String>) -> CommandError {
    let mut text = format!("{names}; give more digits or the whole id:");
    for candidate in candidates {
        text.push_str(&format!("\n  {candidate}"));
    }
    CommandError::BadInput(text)
}

/// The one compensation among `candidates` (an operation's plan) that `r` names.
pub fn resolve_compensation(
    operation: Uuid,
    candidates: impl IntoIterator<Item = Uuid>,
    r: &IdRef,
) -> Result<Uuid, CommandError> {
    let matching: Vec<Uuid> = candidates.into_iter().filter(|c| r.matches(c)).collect();
    match matching.as_slice() {
        [one] => Ok(*one),
        [] => Err(CommandError::Problem(format!(
            "operation {operation} has no compensation {r} in its plan (`operation show` lists \
             them with their full ids)"
        ))),
        many => Err(ambiguous(
            &format!(
                "{r} is ambiguous: it names {} compensations of operation {operation}",
                many.len()
            ),
            many.iter().map(Uuid::to_string),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compensation_is_named_by_a_unique_short_id_and_an_ambiguous_one_lists_them() {
        let op = Uuid::from_u128(7);
        let a = Uuid::parse_str("01a20c10-bda9-71ad-a2a6-71eec13912d3").unwrap();
        let b = Uuid::parse_str("01a20c10-bda9-71ad-a2a6-000013912d3f").unwrap();
        // Given a plan of two compensations sharing their head,
        let candidates = [a, b];
        // when one is named by its short form, then it is that one;
        let short: IdRef = "71eec13912d3".parse().unwrap();
        assert_eq!(resolve_compensation(op, candidates, &short).unwrap(), a);
        // when by the head they share, then both are named, whole.
        let head: IdRef = "01a20c10".parse().unwrap();
        let e = resolve_compensation(op, candidates, &head).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let text = e.to_string();
        assert!(
            text.contains(&a.to_string()) && text.contains(&b.to_string()),
            "{text}"
        );
        // and one that names none says where to look.
        let none: IdRef = "ffffffffffff".parse().unwrap();
        let e = resolve_compensation(op, candidates, &none).unwrap_err();
        assert!(e.to_string().contains("operation show"), "{e}");
    }
}
