//! The detail and args keys provledger reads are documented where outside services look.

use std::path::PathBuf;

use provledger_events::catalogue::DetailKey;

#[test]
fn every_detail_key_is_in_the_table_outside_services_read() {
    let doc = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/writing-operations.md"),
    )
    .unwrap();
    let start = doc
        .find("## 5. Effect details the ledger reads")
        .expect("section 5");
    let end = doc[start..]
        .find("\n## 6.")
        .map_or(doc.len(), |e| start + e);
    let section = &doc[start..end];
    for key in DetailKey::ALL {
        assert!(
            section.contains(&format!("`{key}`")),
            "detail key {key} is not in docs/writing-operations.md section 5"
        );
    }
}
