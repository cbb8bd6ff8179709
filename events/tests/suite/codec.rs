//! Codec contract tests: golden encodings of one commit per event, and decoding of
//! arbitrary or mutated bytes never panics.

use std::path::PathBuf;

use proptest::prelude::*;
use provledger_events::catalogue::samples;
use provledger_events::catalogue::versions::REGISTRY;
use provledger_events::codec::{self, DecodeError, FORMAT_1, FORMAT_2};
use provledger_events::{Commit, CommitDraft, Event, Hash, Timestamp};
use uuid::Uuid;

fn sample_commit(index: usize, event: Event) -> Commit {
    let aggregate = samples::aggregate_for(&event);
    let draft = CommitDraft {
        commit_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0000 + index as u128),
        operation_id: Some(Uuid::from_u128(0xAA)),
        causation_id: None,
        actor: "golden".into(),
        recorded_at: Timestamp(1_700_000_000_000),
        events: vec![event],
    };
    let mut c = Commit::seal(aggregate, 1, Hash::ZERO, draft);
    c.position = 1;
    c
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The tag (bincode variant index) of an event.
fn tag_of(event: &Event) -> u32 {
    let cfg = bincode::config::standard();
    let bytes = bincode::serde::encode_to_vec(event, cfg).unwrap();
    bincode::serde::decode_from_slice::<u32, _>(&bytes, cfg)
        .unwrap()
        .0
}

/// Given one pinned format-1 commit per event kind, when decoded, then its hash is valid and
/// it re-encodes to the pinned bytes (what copies and the audit rely on), forever. And while
/// that event is still at layout 1, encoding the sample gives the pinned bytes: a changed
/// layout without a version bump fails here. Set PROVLEDGER_BLESS=1 to write missing files
/// (never to rewrite one: format 1 is frozen).
#[test]
fn golden_encoding_of_one_commit_per_event_kind() {
    let bless = std::env::var("PROVLEDGER_BLESS").is_ok();
    let mut failures = Vec::new();
    for (i, event) in samples::all().into_iter().enumerate() {
        let name = event.name();
        let tag = tag_of(&event);
        let commit = sample_commit(i, event);
        let path = golden_dir().join(format!("{i:02}_{name}.hex"));
        if bless && !path.exists() {
            let bytes = codec::encode(&commit).unwrap();
            assert_eq!(bytes[0], FORMAT_1, "{name}: a new event starts at layout 1");
            std::fs::write(&path, hex(&bytes) + "\n").unwrap();
        }
        let pinned = unhex(&std::fs::read_to_string(&path).unwrap_or_else(|_| {
            panic!(
                "missing golden file {}; run with PROVLEDGER_BLESS=1",
                path.display()
            )
        }));
        // Given the pinned bytes, when decoded, then they verify and re-encode exactly.
        let decoded = codec::decode(&pinned, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(decoded.hash_is_valid(), "{name}: hash");
        assert_eq!(decoded.format(), FORMAT_1, "{name}");
        assert_eq!(
            codec::encode(&decoded).unwrap(),
            pinned,
            "{name}: re-encoding"
        );
        // Given the sample at today's layout, when still at version 1, then it is the pin.
        if REGISTRY.current_version(tag) == 1 {
            if codec::encode(&commit).unwrap() != pinned {
                failures.push(name.clone());
            }
            assert_eq!(decoded, commit, "{name} does not round-trip");
        }
    }
    assert!(
        failures.is_empty(),
        "the layout of {failures:?} changed: bump each in catalogue/versions.rs and add an \
         upcaster for layout 1 (docs/events.md, \"How to change an event\")"
    );
}

/// Given one commit per event kind, when encoded in format 2, then the bytes equal the
/// pinned lines of format2.hex, they decode to the same commit with a valid (format-2) hash,
/// and they re-encode to themselves. PROVLEDGER_BLESS=1 writes the file only if missing.
#[test]
fn golden_format_2_of_one_commit_per_event_kind() {
    let path = golden_dir().join("format2.hex");
    let encoded: Vec<Vec<u8>> = samples::all()
        .into_iter()
        .enumerate()
        .map(|(i, event)| codec::encode_as(&sample_commit(i, event), FORMAT_2).unwrap())
        .collect();
    if std::env::var("PROVLEDGER_BLESS").is_ok() && !path.exists() {
        let text: String = encoded.iter().map(|b| hex(b) + "\n").collect();
        std::fs::write(&path, text).unwrap();
    }
    let pinned = std::fs::read_to_string(&path).expect("format2.hex; run with PROVLEDGER_BLESS=1");
    let pinned: Vec<Vec<u8>> = pinned.lines().map(unhex).collect();
    assert_eq!(pinned.len(), encoded.len(), "one format-2 line per event");
    for (i, (bytes, event)) in pinned.iter().zip(samples::all()).enumerate() {
        let name = event.name();
        if REGISTRY.current_version(tag_of(&event)) == 1 {
            assert_eq!(
                hex(bytes),
                hex(&encoded[i]),
                "{name}: format-2 encoding changed"
            );
        }
        let decoded = codec::decode(bytes, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(decoded.format(), FORMAT_2, "{name}");
        assert!(decoded.hash_is_valid(), "{name}: hash");
        assert_eq!(
            &codec::encode(&decoded).unwrap(),
            bytes,
            "{name}: re-encoding"
        );
        assert_eq!(decoded.events, vec![event], "{name}");
        // The hash rule holds for format 2 too, under its own domain.
        let (body, stored) = bytes[1..].split_at(bytes.len() - 1 - 32);
        let raw = codec::envelope::hash_body("provledger.commit.v2", body);
        assert_eq!(
            raw.0.as_slice(),
            stored,
            "{name}: format-2 hash over the raw bytes"
        );
    }
}

/// The format-2 payload of the `cluster_deleted` sample, whose event is the single byte of
/// its tag, and the index of that event's version byte (version, length, tag, then the two
/// hashes).
fn format_2_cluster_deleted() -> (Vec<u8>, usize) {
    let (i, event) = samples::all()
        .into_iter()
        .enumerate()
        .find(|(_, e)| matches!(e, Event::ClusterDeleted {}))
        .unwrap();
    let bytes = codec::encode_as(&sample_commit(i, event), FORMAT_2).unwrap();
    let at = bytes.len() - 64 - 3;
    assert_eq!(
        &bytes[at..at + 3],
        &[1, 1, tag_of(&Event::ClusterDeleted {}) as u8]
    );
    (bytes, at)
}

/// Given a format-2 commit whose event claims a layout this build does not know, when
/// decoded, then the refusal is typed, names the event, and says a newer build wrote it.
#[test]
fn an_event_at_an_unknown_layout_is_refused_by_name() {
    let (mut bytes, at) = format_2_cluster_deleted();
    bytes[at] = 2;
    let err = codec::decode(&bytes, 1).unwrap_err();
    assert_eq!(
        err,
        DecodeError::UnknownEventVersion {
            index: 0,
            tag: 7,
            version: 2,
            newest: 1
        }
    );
    assert!(err.written_by_newer_build());
    // Given a layout 0 (no event ever had it), then it is refused but not blamed on a newer
    // build.
    bytes[at] = 0;
    let err = codec::decode(&bytes, 1).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::UnknownEventVersion { version: 0, .. }
    ));
    assert!(!err.written_by_newer_build());
}

/// Given a format-2 event whose length covers more than its fields, when decoded, then it
/// is malformed (each event must be exactly its bytes, or the stored form would carry
/// bytes nobody checked).
#[test]
fn a_format_2_event_longer_than_its_fields_is_malformed() {
    let (bytes, at) = format_2_cluster_deleted();
    let mut longer = bytes[..at].to_vec();
    longer.extend_from_slice(&[1, 2, bytes[at + 2], 0]);
    longer.extend_from_slice(&bytes[at + 3..]);
    assert!(
        matches!(codec::decode(&longer, 1), Err(DecodeError::Malformed(m)) if m.contains("1 bytes left")),
    );
}

/// Given a decoded format-2 commit (kept in its stored form, since a writer would pick
/// format 1), when its header or its event is edited, then its hash no longer verifies;
/// and when it is not, then it re-encodes in format 2.
#[test]
fn editing_a_commit_kept_in_its_stored_form_breaks_its_hash() {
    let (bytes, _) = format_2_cluster_deleted();
    let decoded = codec::decode(&bytes, 1).unwrap();
    assert!(decoded.hash_is_valid());
    assert_eq!(decoded.event_versions(), vec![1]);
    let mut forged = decoded.clone();
    forged.actor = "mallory".into();
    assert!(!forged.hash_is_valid(), "an edited header");
    assert_eq!(codec::encode(&forged).unwrap()[0], FORMAT_2);
    let mut forged = decoded.clone();
    forged.events = vec![Event::ClusterDeleteRequested { reason: "x".into() }];
    assert!(!forged.hash_is_valid(), "an edited event");
    assert_eq!(
        forged.format(),
        FORMAT_1,
        "an edited event is written as this build would"
    );
}

fn unhex(text: &str) -> Vec<u8> {
    let text = text.trim();
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("golden files hold hex"))
        .collect()
}

/// Every pinned golden payload, by file name, sorted.
fn golden_payloads() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(golden_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "hex"))
        .filter(|path| {
            path.file_name()
                .is_some_and(|n| n.as_encoded_bytes()[0].is_ascii_digit())
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, unhex(&std::fs::read_to_string(&path).unwrap()))
        })
        .collect()
}

/// Given the pinned golden payloads, when hashed from their raw bytes alone, then the hash
/// is BLAKE3(bincode("provledger.commit.v1") ‖ payload[1 .. len-32]) and equals both the
/// trailing 32 bytes and the decoded commit's hash: what a reader may check without
/// decoding an event.
#[test]
fn the_hash_covers_the_payload_between_format_byte_and_hash() {
    let payloads = golden_payloads();
    assert_eq!(
        payloads.len(),
        samples::all().len(),
        "one golden file per event"
    );
    for (name, bytes) in payloads {
        let (body, stored) = bytes[1..].split_at(bytes.len() - 1 - 32);
        let mut input = vec![20u8]; // the varint length of the domain string
        input.extend_from_slice(b"provledger.commit.v1");
        input.extend_from_slice(body);
        let raw = Hash(*blake3::hash(&input).as_bytes());
        assert_eq!(raw.0.as_slice(), stored, "{name}: hash over the raw bytes");
        assert_eq!(
            codec::envelope::hash_body("provledger.commit.v1", body),
            raw,
            "{name}: the codec's hash of a body"
        );
        assert_eq!(codec::decode(&bytes, 1).unwrap().hash, raw, "{name}");
    }
}

/// The sample list covers every variant: bincode writes the variant index first, so the
/// samples' indices must be exactly 0..n and index n must not decode.
#[test]
fn samples_cover_every_event_variant() {
    let cfg = bincode::config::standard();
    let all = samples::all();
    for (i, event) in all.iter().enumerate() {
        let bytes = bincode::serde::encode_to_vec(event, cfg).unwrap();
        assert_eq!(
            bytes[0] as usize,
            i,
            "sample {i} ({}) is out of catalogue order",
            event.name()
        );
    }
    let beyond = [all.len() as u8, 0, 0, 0, 0, 0, 0, 0];
    let r: Result<(Event, usize), _> = bincode::serde::decode_from_slice(&beyond, cfg);
    assert!(r.is_err(), "variant {} exists but has no sample", all.len());
}

#[test]
fn every_event_round_trips_through_json() {
    for event in samples::all() {
        let json = serde_json::to_string(&event).unwrap();
        let back: Event = serde_json::from_str(&json).unwrap();
        assert_eq!(back, event, "{json}");
    }
}

#[test]
fn decode_refuses_empty_unknown_format_and_trailing_bytes() {
    assert_eq!(codec::decode(&[], 1), Err(DecodeError::Empty));
    let unknown = codec::decode(&[9, 1, 2], 1);
    assert_eq!(unknown, Err(DecodeError::UnknownFormat { found: 9 }));
    assert!(unknown.unwrap_err().written_by_newer_build());
    assert!(!DecodeError::UnknownFormat { found: 0 }.written_by_newer_build());
    let mut bytes = codec::encode(&sample_commit(0, samples::all().remove(0))).unwrap();
    bytes.push(0);
    assert_eq!(
        codec::decode(&bytes, 1),
        Err(DecodeError::TrailingBytes { count: 1 })
    );
}

#[test]
fn the_aggregate_alone_decodes_as_the_whole_commit_does() {
    for (i, event) in samples::all().into_iter().enumerate() {
        let commit = sample_commit(i, event);
        let bytes = codec::encode(&commit).unwrap();
        assert_eq!(codec::decode_aggregate(&bytes), Ok(commit.aggregate));
    }
    assert_eq!(codec::decode_aggregate(&[]), Err(DecodeError::Empty));
    assert_eq!(
        codec::decode_aggregate(&[9, 1, 2]),
        Err(DecodeError::UnknownFormat { found: 9 })
    );
    assert!(matches!(
        codec::decode_aggregate(&[FORMAT_1, 1, 2]),
        Err(DecodeError::Malformed(_))
    ));
}

/// One valid payload per event in each format.
fn valid_encodings() -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    for format in [FORMAT_1, FORMAT_2] {
        for (i, e) in samples::all().into_iter().enumerate() {
            all.push(codec::encode_as(&sample_commit(i, e), format).unwrap());
        }
    }
    all
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = codec::decode(&bytes, 7);
        for format in [FORMAT_1, FORMAT_2] {
            let mut with_version = vec![format];
            with_version.extend_from_slice(&bytes);
            let _ = codec::decode(&with_version, 7);
            let _ = codec::decode_aggregate(&with_version);
        }
    }

    #[test]
    fn decoding_mutated_commits_never_panics(
        which in 0usize..106,
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let all = valid_encodings();
        let mut bytes = all[which % all.len()].clone();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        let original = codec::decode(&all[which % all.len()], 3).expect("valid encoding");
        match codec::decode(&bytes, 3) {
            // A mutation that still decodes to a different commit must be caught by the
            // hash instead (the encoding is canonical: the same commit means no change).
            Ok(commit) if commit != original => prop_assert!(
                !commit.hash_is_valid(),
                "a modified commit kept a valid hash: {:?}",
                commit
            ),
            Ok(_) => {}
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }
}

#[test]
fn every_event_is_documented_in_docs_events_md() {
    let doc = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/events.md"),
    )
    .unwrap();
    for event in samples::all() {
        assert!(
            doc.contains(&format!("### `{}`", event.name())),
            "{} undocumented",
            event.name()
        );
    }
}
