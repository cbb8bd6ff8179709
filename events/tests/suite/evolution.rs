//! Event evolution, end to end, on a toy catalogue: "add a field" to an event, through the
//! same generic envelope, codec and registry code that real commits go through
//! (`codec::decode_envelope`, `Envelope`, `catalogue::versions`). The real catalogue has not
//! changed yet, so this is where the procedure of docs/events.md ("How to change an event")
//! is shown to keep old commits readable, verifiable and byte-exact.

use provledger_events::catalogue::samples;
use provledger_events::catalogue::versions::{Registry, Upcaster, Versioned, REGISTRY};
use provledger_events::codec::envelope::Envelope;
use provledger_events::codec::stored::Stored;
use provledger_events::codec::{self, DecodeError, FORMAT_1, FORMAT_2};
use provledger_events::{AggregateId, Hash, Timestamp};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The catalogue before the change: every event at layout 1.
mod before {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub enum Ev {
        Opened { name: String },
        Noted { text: String },
    }

    pub static REGISTRY: Registry<Ev> = Registry {
        current: &[],
        upcasters: &[],
    };

    impl Versioned for Ev {
        fn registry() -> &'static Registry<Ev> {
            &REGISTRY
        }
    }
}

/// The catalogue after the change: `Noted` (tag 1) gained `traceparent`, so it is at
/// layout 2, and its layout 1 is read by an upcaster from a frozen copy.
mod after {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub enum Ev {
        Opened {
            name: String,
        },
        Noted {
            text: String,
            #[serde(default)]
            traceparent: Option<String>,
        },
    }

    /// What `catalogue/legacy/noted_v1.rs` would hold: layout 1, frozen.
    mod legacy {
        #[derive(serde::Deserialize)]
        pub struct NotedV1 {
            pub text: String,
        }
    }

    /// Layout 1 of `Noted` in today's layout: the trace was not recorded.
    fn noted_v1(fields: &[u8]) -> Result<(Ev, usize), bincode::error::DecodeError> {
        let (old, used): (legacy::NotedV1, usize) =
            bincode::serde::decode_from_slice(fields, bincode::config::standard())?;
        let event = Ev::Noted {
            text: old.text,
            traceparent: None,
        };
        Ok((event, used))
    }

    pub static REGISTRY: Registry<Ev> = Registry {
        current: &[(1, 2)],
        upcasters: &[Upcaster {
            tag: 1,
            from: 1,
            read: noted_v1,
        }],
    };

    impl Versioned for Ev {
        fn registry() -> &'static Registry<Ev> {
            &REGISTRY
        }
    }
}

const TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn aggregate() -> AggregateId {
    AggregateId::cluster(Uuid::from_u128(0x39))
}

/// A commit of `events` at `version`, linked to `prev` and sealed, as a writer of that
/// catalogue would build it.
fn seal<E: Versioned>(version: u64, prev: Hash, events: Vec<E>) -> Envelope<E> {
    let mut envelope = Envelope {
        commit_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0000 + version as u128),
        aggregate: aggregate(),
        version,
        operation_id: None,
        causation_id: None,
        actor: "evolution".into(),
        recorded_at: Timestamp(1_800_000_000_000 + version as i64),
        trace: None,
        events,
        prev_hash: prev,
        hash: Hash::ZERO,
        stored: Stored::default(),
    };
    envelope.hash = envelope.compute_hash();
    envelope
}

/// The old build's log: three chained format-1 commits, one holding two events.
fn old_log() -> Vec<Vec<u8>> {
    use before::Ev::*;
    let histories = [
        vec![Opened { name: "c1".into() }],
        vec![Noted { text: "a".into() }],
        vec![Opened { name: "c2".into() }, Noted { text: "b".into() }],
    ];
    let mut prev = Hash::ZERO;
    let mut log = Vec::new();
    for (i, events) in histories.into_iter().enumerate() {
        let commit = seal(i as u64 + 1, prev, events);
        prev = commit.hash;
        log.push(commit.encode().unwrap());
    }
    log
}

/// Checks what an auditor checks: every hash valid, versions 1..n, each link to the last.
fn assert_chain<E: Versioned + std::fmt::Debug>(commits: &[Envelope<E>]) {
    let mut prev = Hash::ZERO;
    for (i, commit) in commits.iter().enumerate() {
        assert_eq!(commit.version, i as u64 + 1);
        assert!(commit.hash_is_valid(), "v{}: hash", commit.version);
        assert_eq!(commit.prev_hash, prev, "v{}: link", commit.version);
        prev = commit.hash;
    }
}

/// Given a log written before `Noted` gained a field, when the new build reads it, then
/// every commit upcasts, verifies, chains and re-encodes to its original bytes; and when
/// the new build writes, then a commit with the new field is format 2 and chains on, a
/// commit without it is format 1 and the old build reads it, while the old build refuses
/// the format-2 commit with a typed error; and an edited upcast commit fails its hash.
#[test]
fn adding_a_field_keeps_old_commits_readable_and_verifiable() {
    // Given the old build's log (step 1), then every payload is format 1.
    let log = old_log();
    assert!(log.iter().all(|bytes| bytes[0] == FORMAT_1));

    // When the new build decodes it (step 2)...
    let decoded: Vec<Envelope<after::Ev>> = log
        .iter()
        .map(|bytes| codec::decode_envelope(bytes).unwrap())
        .collect();
    // ...then `Noted` comes out in today's layout, without the field it did not have,
    assert_eq!(
        decoded[1].events,
        vec![after::Ev::Noted {
            text: "a".into(),
            traceparent: None
        }]
    );
    assert_eq!(
        decoded[2].events[1],
        after::Ev::Noted {
            text: "b".into(),
            traceparent: None
        }
    );
    // the hashes and the chain verify,
    assert_chain(&decoded);
    // each commit re-encodes to its original bytes, in format 1 at layout 1,
    for (commit, bytes) in decoded.iter().zip(&log) {
        assert_eq!(&commit.encode().unwrap(), bytes, "v{}", commit.version);
        assert_eq!(commit.format(), FORMAT_1);
        assert!(commit.event_versions().iter().all(|v| *v == 1));
    }
    // and only the commits that held an upcast event keep their stored form.
    let kept: Vec<bool> = decoded.iter().map(|c| c.stored.is_kept()).collect();
    assert_eq!(kept, vec![false, true, true]);

    // When the new build writes the new field on the old tip (step 3)...
    let tip = decoded.last().unwrap();
    let traced = seal(
        4,
        tip.hash,
        vec![
            after::Ev::Opened { name: "c3".into() },
            after::Ev::Noted {
                text: "c".into(),
                traceparent: Some(TRACE.into()),
            },
        ],
    );
    let traced_bytes = traced.encode().unwrap();
    // ...then it is format 2 with the changed event at layout 2, and it reads back with
    // the field, and chains.
    assert_eq!(traced_bytes[0], FORMAT_2);
    let traced_back: Envelope<after::Ev> = codec::decode_envelope(&traced_bytes).unwrap();
    assert_eq!(traced_back, traced);
    assert_eq!(traced_back.event_versions(), vec![1, 2]);
    assert_eq!(traced_back.encode().unwrap(), traced_bytes);
    assert!(
        !traced_back.stored.is_kept(),
        "format 2 is the minimal format here"
    );

    // When the new build writes a commit of unchanged events only (step 4)...
    let plain = seal(
        5,
        traced.hash,
        vec![after::Ev::Opened { name: "c4".into() }],
    );
    let plain_bytes = plain.encode().unwrap();
    // ...then it is format 1, and the old build reads and verifies it.
    assert_eq!(plain_bytes[0], FORMAT_1);
    let old_reads: Envelope<before::Ev> = codec::decode_envelope(&plain_bytes).unwrap();
    assert_eq!(
        old_reads.events,
        vec![before::Ev::Opened { name: "c4".into() }]
    );
    assert!(old_reads.hash_is_valid());

    let mut whole = decoded.clone();
    whole.push(traced_back);
    whole.push(codec::decode_envelope(&plain_bytes).unwrap());
    assert_chain(&whole);

    // When the old build reads the format-2 commit (step 5), then it refuses it by name,
    // as written by a newer build.
    let refused = codec::decode_envelope::<before::Ev>(&traced_bytes).unwrap_err();
    assert_eq!(
        refused,
        DecodeError::UnknownEventVersion {
            index: 1,
            tag: 1,
            version: 2,
            newest: 1
        }
    );
    assert!(refused.written_by_newer_build());

    // When an upcast commit's event is edited (step 6), then its hash no longer verifies;
    let mut forged = decoded[1].clone();
    forged.events = vec![after::Ev::Noted {
        text: "forged".into(),
        traceparent: None,
    }];
    assert!(!forged.hash_is_valid(), "an edited upcast event");
    // and so does one whose stored bytes were edited.
    let mut damaged = log[1].clone();
    let at = damaged.len() - 64 - 1; // the last byte of "a", before the two hashes
    damaged[at] = b'z';
    let damaged: Envelope<after::Ev> = codec::decode_envelope(&damaged).unwrap();
    assert!(!damaged.hash_is_valid(), "edited stored bytes");
}

/// Given a registry, then every old layout `1..current` of every tag has exactly one
/// upcaster, and none reads a layout at or above the current one: the real catalogue's, the
/// toy's, and (as a check of the check) a registry missing one.
#[test]
fn every_old_layout_has_an_upcaster() {
    let tags = samples::all().len() as u32;
    assert_eq!(REGISTRY.problems(tags), Vec::<String>::new());
    assert_eq!(after::REGISTRY.problems(2), Vec::<String>::new());
    assert_eq!(before::REGISTRY.problems(2), Vec::<String>::new());

    fn never(_: &[u8]) -> Result<(after::Ev, usize), bincode::error::DecodeError> {
        Err(bincode::error::DecodeError::Other("unused"))
    }
    let incomplete: Registry<after::Ev> = Registry {
        current: &[(1, 3), (5, 2)],
        upcasters: &[
            Upcaster {
                tag: 1,
                from: 1,
                read: never,
            },
            Upcaster {
                tag: 0,
                from: 1,
                read: never,
            },
        ],
    };
    assert_eq!(
        incomplete.problems(2),
        vec![
            "tag 1: layout 2 has 0 upcasters, expected exactly 1".to_string(),
            "current: tag 5 is not a variant (0..2)".to_string(),
            "tag 5: layout 1 has 0 upcasters, expected exactly 1".to_string(),
            "tag 0: an upcaster reads layout 1, but the current layout is 1".to_string(),
        ]
    );
}

/// Given the procedure in docs/events.md ("How to change an event"), then every file it
/// names exists and every test it names is a test of this crate: the procedure cannot drift
/// from the code silently.
#[test]
fn the_procedure_in_docs_names_what_exists() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("docs/events.md")).unwrap();
    let section = doc
        .split_once("## How to change an event")
        .expect("docs/events.md has the section")
        .1;
    let suite = ["codec.rs", "evolution.rs"]
        .map(|f| std::fs::read_to_string(root.join("events/tests/suite").join(f)).unwrap())
        .join("\n");
    for path in [
        "events/src/catalogue/versions.rs",
        "events/src/catalogue/samples.rs",
        "events/src/codec/envelope.rs",
        "events/tests/suite/evolution.rs",
        "events/tests/golden/format2.hex",
    ] {
        let short = path.rsplit_once('/').map_or(path, |(_, file)| file);
        assert!(section.contains(short), "the section names {short}");
        assert!(root.join(path).exists(), "{path} exists");
    }
    let tests = [
        "golden_encoding_of_one_commit_per_event_kind",
        "golden_format_2_of_one_commit_per_event_kind",
        "every_old_layout_has_an_upcaster",
        "the_hash_covers_the_payload_between_format_byte_and_hash",
    ];
    for test in tests {
        assert!(
            section.contains(&format!("`{test}`")),
            "the section names {test}"
        );
        assert!(suite.contains(&format!("fn {test}()")), "{test} is a test");
    }
    // Every test the section names in backticks is one of those.
    let named: Vec<&str> = section
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|word| {
            word.contains('_') && word.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        })
        .filter(|word| suite.contains(&format!("fn {word}()")))
        .collect();
    assert!(named.iter().all(|word| tests.contains(word)), "{named:?}");
}
