//! Codec contract tests: golden encodings of one commit per event, and decoding of
//! arbitrary or mutated bytes never panics.

use std::path::PathBuf;

use proptest::prelude::*;
use provledger_events::catalogue::samples;
use provledger_events::codec::{self, DecodeError, FORMAT_VERSION};
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

/// Given one commit per event kind, when encoded, then the bytes equal the pinned golden
/// files. Set PROVLEDGER_BLESS=1 to rewrite them after an intended format change (and bump
/// FORMAT_VERSION).
#[test]
fn golden_encoding_of_one_commit_per_event_kind() {
    let bless = std::env::var("PROVLEDGER_BLESS").is_ok();
    let mut failures = Vec::new();
    for (i, event) in samples::all().into_iter().enumerate() {
        let name = event.name();
        let commit = sample_commit(i, event);
        let bytes = codec::encode(&commit).unwrap();
        assert_eq!(bytes[0], FORMAT_VERSION);
        let path = golden_dir().join(format!("{i:02}_{name}.hex"));
        if bless {
            std::fs::write(&path, hex(&bytes) + "\n").unwrap();
            continue;
        }
        let pinned = std::fs::read_to_string(&path).unwrap_or_else(|_| {
            panic!(
                "missing golden file {}; run with PROVLEDGER_BLESS=1",
                path.display()
            )
        });
        if pinned.trim() != hex(&bytes) {
            failures.push(name.clone());
        }
        let decoded = codec::decode(&bytes, 1).unwrap();
        assert_eq!(decoded, commit, "{name} does not round-trip");
        assert!(decoded.hash_is_valid());
    }
    assert!(failures.is_empty(), "encoding changed for: {failures:?}");
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
    assert_eq!(
        codec::decode(&[9, 1, 2], 1),
        Err(DecodeError::UnknownFormat { found: 9 })
    );
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
        codec::decode_aggregate(&[FORMAT_VERSION, 1, 2]),
        Err(DecodeError::Malformed(_))
    ));
}

fn valid_encodings() -> Vec<Vec<u8>> {
    samples::all()
        .into_iter()
        .enumerate()
        .map(|(i, e)| codec::encode(&sample_commit(i, e)).unwrap())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = codec::decode(&bytes, 7);
        let mut with_version = vec![FORMAT_VERSION];
        with_version.extend_from_slice(&bytes);
        let _ = codec::decode(&with_version, 7);
        let _ = codec::decode_aggregate(&with_version);
    }

    #[test]
    fn decoding_mutated_commits_never_panics(
        which in 0usize..44,
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
