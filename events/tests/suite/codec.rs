//! Codec contract tests: golden encodings of one commit per event, and decoding of
//! arbitrary or mutated bytes never panics.

use std::path::PathBuf;

use proptest::prelude::*;
use provledger_events::catalogue::samples;
use provledger_events::catalogue::versions::REGISTRY;
use provledger_events::codec::{self, DecodeError, EncodeError, FORMAT_1, FORMAT_2, FORMAT_3};
use provledger_events::{Commit, CommitDraft, Event, Hash, Timestamp, TraceContext};
use uuid::Uuid;

fn sample_commit(index: usize, event: Event) -> Commit {
    let aggregate = samples::aggregate_for(&event);
    let draft = CommitDraft {
        trace: None,
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
/// it re-encodes to the pinned bytes (what copies and the audit rely on), forever. And the
/// sample at today's layout encodes to the pin of its current version: `NN_name.hex`, in
/// format 1, while the event is at version 1; `NN_name.vK.hex`, in format 2, once it is at
/// version K. A changed layout without a version bump fails here, naming the event. Set
/// PROVLEDGER_BLESS=1 to write missing files; an existing file is never rewritten.
#[test]
fn golden_encoding_of_one_commit_per_event_kind() {
    let bless = std::env::var("PROVLEDGER_BLESS").is_ok();
    let mut failures = Vec::new();
    for (i, event) in samples::all().into_iter().enumerate() {
        let name = event.name();
        let version = REGISTRY.current_version(tag_of(&event));
        let commit = sample_commit(i, event);
        let path = golden_dir().join(format!("{i:02}_{name}.hex"));
        if bless && !path.exists() {
            let bytes = codec::encode(&commit).unwrap();
            assert_eq!(bytes[0], FORMAT_1, "{name}: a new event starts at layout 1");
            std::fs::write(&path, hex(&bytes) + "\n").unwrap();
        }
        let pinned = read_pin(&path);
        // Given the pinned layout-1 bytes, when decoded, then they verify and re-encode
        // exactly, whatever the event's version is today.
        let decoded = codec::decode(&pinned, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(decoded.hash_is_valid(), "{name}: hash");
        assert_eq!(decoded.format(), FORMAT_1, "{name}");
        assert_eq!(
            codec::encode(&decoded).unwrap(),
            pinned,
            "{name}: re-encoding"
        );
        // Given the sample at today's layout, then it encodes to the pin of its version.
        let current = if version == 1 {
            pinned
        } else {
            let path = golden_dir().join(format!("{i:02}_{name}.v{version}.hex"));
            if bless && !path.exists() {
                std::fs::write(&path, hex(&codec::encode(&commit).unwrap()) + "\n").unwrap();
            }
            read_pin(&path)
        };
        if codec::encode(&commit).unwrap() != current {
            failures.push(format!("{name} (at version {version})"));
            continue;
        }
        let decoded = codec::decode(&current, 1).unwrap();
        assert_eq!(decoded, commit, "{name} does not round-trip");
        assert_eq!(decoded.event_versions(), vec![version], "{name}");
        assert!(decoded.hash_is_valid(), "{name}: hash of today's layout");
    }
    assert!(
        failures.is_empty(),
        "the layout of {failures:?} changed: give each the next version in \
         catalogue/versions.rs with an upcaster for the old layout (docs/events.md, \
         \"How to change an event\")"
    );
}

fn read_pin(path: &std::path::Path) -> Vec<u8> {
    unhex(&std::fs::read_to_string(path).unwrap_or_else(|_| {
        panic!(
            "missing golden file {}; run with PROVLEDGER_BLESS=1",
            path.display()
        )
    }))
}

/// Given one commit per event kind, when encoded in format 2, then the bytes equal the
/// pinned lines of format2.hex, they decode with a valid (format-2) hash and re-encode to
/// themselves. While an event is at version 1, its line is also today's encoding and
/// decodes to its sample. PROVLEDGER_BLESS=1 appends the lines of new events; a written
/// line is never rewritten.
#[test]
fn golden_format_2_of_one_commit_per_event_kind() {
    let path = golden_dir().join("format2.hex");
    let encoded: Vec<Vec<u8>> = samples::all()
        .into_iter()
        .enumerate()
        .map(|(i, event)| codec::encode_as(&sample_commit(i, event), FORMAT_2).unwrap())
        .collect();
    let written = std::fs::read_to_string(&path).unwrap_or_default();
    if std::env::var("PROVLEDGER_BLESS").is_ok() && written.lines().count() < encoded.len() {
        let new = encoded[written.lines().count()..].iter();
        let text: String = new.map(|b| hex(b) + "\n").collect();
        std::fs::write(&path, written + &text).unwrap();
    }
    let pinned = std::fs::read_to_string(&path).expect("format2.hex: PROVLEDGER_BLESS=1");
    let pinned: Vec<Vec<u8>> = pinned.lines().map(unhex).collect();
    assert_eq!(pinned.len(), encoded.len(), "one format-2 line per event");
    for (i, (bytes, event)) in pinned.iter().zip(samples::all()).enumerate() {
        let name = event.name();
        let unchanged = REGISTRY.current_version(tag_of(&event)) == 1;
        if unchanged {
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
        if unchanged {
            assert_eq!(decoded.events, vec![event], "{name}");
        }
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

/// The W3C specification's example context, as a caller's `traceparent` would carry it.
fn trace() -> TraceContext {
    TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .expect("the specification's example")
}

/// Sample `index` sealed with a trace context: what a traced writer records.
fn traced_commit(index: usize, event: Event) -> Commit {
    let plain = sample_commit(index, event);
    let draft = CommitDraft {
        trace: Some(trace()),
        commit_id: plain.commit_id,
        operation_id: plain.operation_id,
        causation_id: plain.causation_id,
        actor: plain.actor,
        recorded_at: plain.recorded_at,
        events: plain.events,
    };
    let mut c = Commit::seal(plain.aggregate, 1, Hash::ZERO, draft);
    c.position = 1;
    c
}

/// Given the first sample commit recorded with a trace context, when encoded, then it is
/// format 3 and equals the pinned format3.hex; it decodes to the same commit (trace
/// included) with a valid hash, re-encodes to itself, and the hash rule holds on the raw
/// bytes under format 3's own domain. PROVLEDGER_BLESS=1 writes a missing pin; a written
/// pin is never rewritten.
#[test]
fn golden_format_3_of_a_traced_commit() {
    let path = golden_dir().join("format3.hex");
    let commit = traced_commit(0, samples::all().remove(0));
    let bytes = codec::encode(&commit).unwrap();
    if std::env::var("PROVLEDGER_BLESS").is_ok() && !path.exists() {
        std::fs::write(&path, hex(&bytes) + "\n").unwrap();
    }
    let pinned = read_pin(&path);
    assert_eq!(hex(&pinned), hex(&bytes), "format-3 encoding changed");
    assert_eq!(pinned[0], FORMAT_3);
    let decoded = codec::decode(&pinned, 1).unwrap();
    assert_eq!(decoded, commit);
    assert_eq!(decoded.trace, Some(trace()));
    assert_eq!(decoded.format(), FORMAT_3);
    assert!(decoded.hash_is_valid());
    assert_eq!(codec::encode(&decoded).unwrap(), pinned);
    let (body, stored) = pinned[1..].split_at(pinned.len() - 1 - 32);
    let raw = codec::envelope::hash_body("provledger.commit.v3", body);
    assert_eq!(raw.0.as_slice(), stored, "format-3 hash over the raw bytes");
    // The 25 bytes after the header are the trace id, the span id and the flags.
    let at = hex(body)
        .find(&trace().trace_id_hex())
        .expect("the trace id in the body");
    assert_eq!(
        &hex(body)[at..at + 50],
        format!("{}{}01", trace().trace_id_hex(), trace().span_id_hex())
    );
}

/// Given a commit without a trace context, then it stays in format 1 (its bytes as before
/// format 3 existed); given the same commit with one, then its hash differs, and taking
/// the trace off a decoded traced commit no longer matches its hash: the hash covers it.
#[test]
fn the_trace_context_is_written_only_in_format_3_and_covered_by_the_hash() {
    for (i, event) in samples::all().into_iter().enumerate() {
        let plain = sample_commit(i, event.clone());
        let traced = traced_commit(i, event);
        assert_eq!(codec::encode(&plain).unwrap()[0], FORMAT_1);
        assert_eq!(codec::encode(&traced).unwrap()[0], FORMAT_3);
        assert_ne!(plain.hash, traced.hash, "sample {i}");
        let mut stripped = codec::decode(&codec::encode(&traced).unwrap(), 1).unwrap();
        stripped.trace = None;
        assert!(
            !stripped.hash_is_valid(),
            "sample {i}: trace removed unnoticed"
        );
        let mut swapped = codec::decode(&codec::encode(&traced).unwrap(), 1).unwrap();
        swapped.trace = trace().with_span([9; 8]);
        assert!(
            !swapped.hash_is_valid(),
            "sample {i}: trace changed unnoticed"
        );
    }
    // Format 3 goes with a trace context, and only with one.
    let plain = sample_commit(0, samples::all().remove(0));
    let traced = traced_commit(0, samples::all().remove(0));
    assert!(matches!(
        codec::encode_as(&plain, FORMAT_3),
        Err(EncodeError::TraceNeedsFormat3 { traced: false, .. })
    ));
    assert!(matches!(
        codec::encode_as(&traced, FORMAT_2),
        Err(EncodeError::TraceNeedsFormat3 { traced: true, .. })
    ));
}

/// Given a format-3 payload whose trace id was zeroed (W3C: invalid), when decoded, then
/// it is refused as malformed rather than read as a trace.
#[test]
fn a_format_3_payload_with_an_all_zero_trace_id_is_malformed() {
    let bytes = codec::encode(&traced_commit(0, samples::all().remove(0))).unwrap();
    let text = hex(&bytes).replacen(&trace().trace_id_hex(), &"0".repeat(32), 1);
    assert!(matches!(
        codec::decode(&unhex(&text), 1),
        Err(DecodeError::Malformed(m)) if m.contains("trace context")
    ));
}

/// The format-2 payload of the first sample whose event is the single byte of its tag (a
/// fieldless event such as `cluster_deleted`) and still at layout 1, the index of that
/// event's version byte (version, length, tag, then the two hashes), and its tag.
fn format_2_of_a_fieldless_event() -> (Vec<u8>, usize, u32) {
    let (i, event) = samples::all()
        .into_iter()
        .enumerate()
        .find(|(_, e)| {
            let bytes = bincode::serde::encode_to_vec(e, bincode::config::standard()).unwrap();
            bytes.len() == 1 && REGISTRY.current_version(tag_of(e)) == 1
        })
        .expect("a fieldless event at layout 1");
    let tag = tag_of(&event);
    let bytes = codec::encode_as(&sample_commit(i, event), FORMAT_2).unwrap();
    let at = bytes.len() - 64 - 3;
    assert_eq!(&bytes[at..at + 3], &[1, 1, tag as u8]);
    (bytes, at, tag)
}

/// Given a format-2 commit whose event claims a layout this build does not know, when
/// decoded, then the refusal is typed, names the event, and says a newer build wrote it.
#[test]
fn an_event_at_an_unknown_layout_is_refused_by_name() {
    let (mut bytes, at, tag) = format_2_of_a_fieldless_event();
    bytes[at] = 2;
    let err = codec::decode(&bytes, 1).unwrap_err();
    assert_eq!(
        err,
        DecodeError::UnknownEventVersion {
            index: 0,
            tag,
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
    let (bytes, at, _) = format_2_of_a_fieldless_event();
    let mut longer = bytes[..at].to_vec();
    longer.extend_from_slice(&[1, 2, bytes[at + 2], 0]);
    longer.extend_from_slice(&bytes[at + 3..]);
    assert!(
        matches!(codec::decode(&longer, 1), Err(DecodeError::Malformed(m)) if m.contains("1 bytes")),
    );
}

/// Given a decoded format-2 commit (kept in its stored form, since a writer would pick
/// format 1), when its header or its event is edited, then its hash no longer verifies;
/// and when it is not, then it re-encodes in format 2.
#[test]
fn editing_a_commit_kept_in_its_stored_form_breaks_its_hash() {
    let (bytes, _, _) = format_2_of_a_fieldless_event();
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
        // The format-1 pins only: `NN_name.hex`, not `format2.hex` nor the `.vK.hex` pins.
        .filter(|path| {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            name.is_some_and(|n| n.as_bytes()[0].is_ascii_digit() && !n.contains(".v"))
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

/// One valid payload per event in each format: as a writer writes it (format 1 while the
/// event is at version 1), and in format 2.
fn valid_encodings() -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    for (i, e) in samples::all().into_iter().enumerate() {
        let commit = sample_commit(i, e);
        all.push(codec::encode(&commit).unwrap());
        all.push(codec::encode_as(&commit, FORMAT_2).unwrap());
        all.push(codec::encode(&traced_commit(i, commit.events[0].clone())).unwrap());
    }
    all
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = codec::decode(&bytes, 7);
        for format in [FORMAT_1, FORMAT_2, FORMAT_3] {
            let mut with_version = vec![format];
            with_version.extend_from_slice(&bytes);
            let _ = codec::decode(&with_version, 7);
            let _ = codec::decode_aggregate(&with_version);
        }
    }

    #[test]
    fn decoding_mutated_commits_never_panics(
        which in 0usize..159,
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
