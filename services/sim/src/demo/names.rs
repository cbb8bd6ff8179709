//! Labels a person can tell apart: an entity's name where it has one (`cluster analytics`,
//! `vm workers-3f9c2a71`, `provider cmp-1`), an operation's kind and number
//! (`op create_cluster#2`), and otherwise the id's short form, its random tail
//! (`provledger_events::short_id`: UUID v7 ids share their time prefix).

use std::collections::HashMap;

use provledger_events::{AggregateKind, Commit, Event};
use provledger_projections::timeline;
use uuid::Uuid;

/// The widest line the demo prints.
pub const LINE_COLUMNS_MAX: usize = 120;

/// The short form of an id, the same everywhere ids are shortened (its random tail).
pub fn short(id: &Uuid) -> String {
    provledger_events::short_id(id)
}

/// Labels of the aggregates (and of the resources named by their ids) seen so far.
#[derive(Debug, Default)]
pub struct Names {
    labels: HashMap<Uuid, String>,
    operations_of_kind: HashMap<String, usize>,
}

impl Names {
    /// Learns the names a commit introduces (a create, a registration, an operation start).
    pub fn learn(&mut self, commit: &Commit) {
        let id = commit.aggregate.id;
        for event in &commit.events {
            let label = match (commit.aggregate.kind, event) {
                (AggregateKind::Cluster, Event::ClusterCreateRequested { name, .. }) => {
                    format!("cluster {name}")
                }
                (AggregateKind::Instance, Event::InstanceCreateRequested { name, .. }) => {
                    format!("vm {name}")
                }
                (AggregateKind::Provider, Event::ProviderRegistered { name, .. }) => {
                    format!("provider {name}")
                }
                (AggregateKind::Operation, Event::OperationStarted { kind, .. }) => {
                    let kind = serde_json::to_value(kind)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_string))
                        .unwrap_or_else(|| "operation".into());
                    let n = self.operations_of_kind.entry(kind.clone()).or_insert(0);
                    *n += 1;
                    format!("op {kind}#{n}")
                }
                _ => continue,
            };
            self.labels.entry(id).or_insert(label);
        }
    }

    /// The label of an id: its name, or its short form.
    pub fn label(&self, id: &Uuid) -> String {
        self.labels.get(id).cloned().unwrap_or_else(|| short(id))
    }

    /// The label of an aggregate: its name, or its kind and short id.
    pub fn aggregate(&self, commit: &Commit) -> String {
        match self.labels.get(&commit.aggregate.id) {
            Some(l) => l.clone(),
            None => format!("{} {}", commit.aggregate.kind, short(&commit.aggregate.id)),
        }
    }

    /// Replaces every UUID in `text` by its label (bare name without the kind word).
    pub fn shorten(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(found) = find_uuid(rest) {
            out.push_str(&rest[..found]);
            let id_text = &rest[found..found + 36];
            match Uuid::parse_str(id_text) {
                Ok(id) => {
                    let label = self.label(&id);
                    // "vm workers-1a2b" reads as "workers-1a2b" inside a sentence.
                    out.push_str(label.split_once(' ').map_or(label.as_str(), |(_, n)| n));
                }
                Err(_) => out.push_str(id_text),
            }
            rest = &rest[found + 36..];
        }
        out.push_str(rest);
        out
    }

    /// One commit, printed once: its first line carries the position, the aggregate and
    /// the version; each further event of the commit goes on its own indented line.
    pub fn render_commit(&self, commit: &Commit) -> Vec<String> {
        let head = format!(
            "#{:<4} {:<26} v{:<3}",
            commit.position,
            self.aggregate(commit),
            commit.version
        );
        let pad = " ".repeat(head.chars().count());
        commit
            .events
            .iter()
            .enumerate()
            .map(|(i, event)| {
                let prefix = if i == 0 { head.as_str() } else { pad.as_str() };
                let summary = self.shorten(&timeline::summary(event));
                fit(&format!("  {prefix} {:<27} {summary}", event.name()))
            })
            .collect()
    }
}

/// Cuts a line to [`LINE_COLUMNS_MAX`] characters, marking the cut.
pub fn fit(line: &str) -> String {
    let line = line.trim_end();
    if line.chars().count() <= LINE_COLUMNS_MAX {
        return line.to_string();
    }
    let mut cut: String = line.chars().take(LINE_COLUMNS_MAX - 3).collect();
    cut.push_str("...");
    cut
}

/// The byte offset of the first hyphenated UUID in `text`.
fn find_uuid(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let shape = |b: &[u8]| {
        b.len() >= 36
            && b[..36].iter().enumerate().all(|(i, c)| match i {
                8 | 13 | 18 | 23 => *c == b'-',
                _ => c.is_ascii_hexdigit(),
            })
    };
    (0..bytes.len().saturating_sub(35)).find(|&i| shape(&bytes[i..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_become_labels_and_unknown_ones_their_tail() {
        let mut names = Names::default();
        let known = Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_1234_5678);
        names.labels.insert(known, "vm workers-1".into());
        let unknown = Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_abcd_ef01);
        let text = format!("consumer={known} other={unknown}.");
        assert_eq!(names.shorten(&text), "consumer=workers-1 other=abcdef01.");
    }

    #[test]
    fn long_lines_are_cut_to_the_limit() {
        let line = "x".repeat(500);
        assert_eq!(fit(&line).chars().count(), LINE_COLUMNS_MAX);
        assert_eq!(fit("short  "), "short");
    }
}
