//! Labels a person can tell apart: an entity's name where it has one (`cluster analytics`,
//! `vm workers-3f9c2a71`, `provider cmp-1`), an operation's kind and short id
//! (`create_cluster 71eec13912d3`, the id the CLI and the console print for it), and
//! otherwise the id's short form, its random tail (`provledger_events::short_id`: UUID v7
//! ids share their time prefix).

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
                    // Its short id, not a number of the demo's own: the one name of it
                    // that `provledger operation list` and the console also show.
                    format!("{kind} {}", short(&id))
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
    pub fn render_commit(&self, commit: &Commit) -> Vec<Vec<String>> {
        let head = format!(
            "#{:<4} {:<27} v{:<3}",
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
                let line = format!("  {prefix} {:<27} ", event.name());
                let indent = line.chars().count();
                wrap(&format!("{line}{summary}"), indent)
            })
            .collect()
    }
}

/// Breaks a line at spaces into lines of at most [`LINE_COLUMNS_MAX`] characters, the
/// continuation lines indented by `indent` columns, so that nothing is cut off (a failure
/// reason or a rule is read whole). A word longer than a line is split where it must be.
pub fn wrap(line: &str, indent: usize) -> Vec<String> {
    let pad = " ".repeat(indent.min(LINE_COLUMNS_MAX / 2));
    let mut out = Vec::new();
    let mut current = String::new();
    // Whether the line being filled has no token yet (a continuation holds only its pad),
    // and whether it holds a word, not only spaces: only a line with a word is broken.
    let mut line_is_fresh = true;
    let mut line_has_word = false;
    // Splitting at single spaces keeps runs of spaces (the columns' padding) as empty tokens.
    for word in line.trim_end().split(' ') {
        let width = current.chars().count() + usize::from(!line_is_fresh);
        if line_has_word && width + word.chars().count() > LINE_COLUMNS_MAX {
            out.push(std::mem::replace(&mut current, pad.clone()));
            line_is_fresh = true;
            line_has_word = false;
        }
        if line_is_fresh && word.is_empty() && !out.is_empty() {
            continue;
        }
        if !line_is_fresh {
            current.push(' ');
        }
        current.push_str(word);
        line_is_fresh = false;
        line_has_word |= !word.is_empty();
        while current.chars().count() > LINE_COLUMNS_MAX {
            let head: String = current.chars().take(LINE_COLUMNS_MAX).collect();
            let tail: String = current.chars().skip(LINE_COLUMNS_MAX).collect();
            out.push(head);
            current = format!("{pad}{tail}");
        }
    }
    out.push(current.trim_end().to_string());
    out
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
        assert_eq!(
            names.shorten(&text),
            "consumer=workers-1 other=0000abcdef01."
        );
    }

    #[test]
    fn long_lines_are_wrapped_within_the_limit_and_nothing_is_lost() {
        // Given a sentence three times as wide as a line, and a word wider than a line,
        let words: Vec<String> = (0..60).map(|i| format!("word{i}")).collect();
        let sentence = format!("  reason: {}", words.join(" "));
        let long_word = "x".repeat(300);
        for line in [sentence.as_str(), long_word.as_str()] {
            // when they are wrapped with a hanging indent,
            let wrapped = wrap(line, 4);
            // then every line fits, continuations are indented, and every character is kept.
            assert!(wrapped.len() > 1, "{wrapped:?}");
            assert!(wrapped
                .iter()
                .all(|l| l.chars().count() <= LINE_COLUMNS_MAX));
            assert!(wrapped[1..].iter().all(|l| l.starts_with("    ")));
            let rejoined: String = wrapped
                .iter()
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" ");
            let squeezed = |t: &str| t.split_whitespace().collect::<String>();
            assert_eq!(squeezed(&rejoined), squeezed(line));
        }
        assert_eq!(wrap("short  ", 4), vec!["short".to_string()]);
    }
}
