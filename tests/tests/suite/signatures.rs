//! A check on the source: no public signature of the product carries its errors as a
//! `String` (`Result<_, String>`, `type Err = String`). A caller must be able to match an
//! error's kind (an executor unreachable or refusing, a loss or a conflict), so errors are
//! typed, per operation (STYLE: "Errors typed per operation with their source").

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source dir").flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            // Integration tests and benches are not the product's signatures.
            if name != "tests" && name != "benches" {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// A public item's signature: from `pub fn` / `pub async fn` / `pub type` to its body or
/// its end (`{` or `;`), on one line however many it spans. `pub(crate)` items are not
/// public.
fn public_signatures(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(offset) = text[at..].find("pub ") {
        let start = at + offset;
        at = start + 4;
        let rest = text[at..].trim_start();
        let rest = rest.strip_prefix("async ").unwrap_or(rest).trim_start();
        if !(rest.starts_with("fn ") || rest.starts_with("type ")) {
            continue;
        }
        let end = text[start..]
            .find(['{', ';'])
            .map_or(text.len(), |e| start + e);
        let signature: String = text[start..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let line = text[..start].lines().count() + 1;
        found.push((line, signature));
    }
    found
}

/// `Result<T, String>` with the error type a bare `String`, however `T` is nested.
fn has_string_error(signature: &str) -> bool {
    let compact: String = signature.chars().filter(|c| !c.is_whitespace()).collect();
    let mut at = 0;
    while let Some(offset) = compact[at..].find("Result<") {
        let open = at + offset + "Result<".len();
        // The matching `>` of this Result, and the last top-level comma before it.
        let mut depth = 1;
        let mut last_comma = None;
        for (i, c) in compact[open..].char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' | ')' | ']' => {
                    depth -= 1;
                    if depth == 0 {
                        if let Some(comma) = last_comma {
                            if &compact[comma + 1..open + i] == "String" {
                                return true;
                            }
                        }
                        break;
                    }
                }
                ',' if depth == 1 => last_comma = Some(open + i),
                _ => {}
            }
        }
        at = open;
    }
    false
}

fn string_errors(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).expect("source file");
    // Unit tests at the end of a file are not the product's signatures.
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut found: Vec<String> = public_signatures(text)
        .into_iter()
        .filter(|(_, s)| has_string_error(s))
        .map(|(line, s)| format!("{}:{line}: {s}", file.display()))
        .collect();
    for (n, line) in text.lines().enumerate() {
        if line
            .split("//")
            .next()
            .unwrap_or_default()
            .contains("type Err = String")
        {
            found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
        }
    }
    found
}

#[test]
fn the_detector_sees_a_string_error_however_it_is_written() {
    for bad in [
        "pub fn f() -> Result<(), String>",
        "pub fn f( a: u8, ) -> Result< BTreeMap<String, u64> , String >",
        "pub type F<'a> = Pin<Box<dyn Future<Output = Result<T, String>> + Send + 'a>>",
    ] {
        assert!(has_string_error(bad), "{bad}");
    }
    for good in [
        "pub fn f() -> Result<String, Error>",
        "pub fn f() -> Result<BTreeMap<String, String>, Error>",
        "pub fn f(s: String) -> Option<String>",
    ] {
        assert!(!has_string_error(good), "{good}");
    }
    let text = "pub(crate) fn a() -> Result<(), String> {}\npub async fn b(\n  x: u8,\n) -> Result<u8, String> {}";
    let found: Vec<_> = public_signatures(text)
        .into_iter()
        .filter(|(_, s)| has_string_error(s))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, 2);
}

#[test]
fn no_public_signature_carries_its_error_as_a_string() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in [
        "events/src",
        "projections/src",
        "services/client/src",
        "services/serve/src",
        "services/cli/src",
        "services/sim/src",
    ] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 50, "only {} sources found", files.len());
    let found: Vec<String> = files.iter().flat_map(|f| string_errors(f)).collect();
    assert!(
        found.is_empty(),
        "public signatures with a String error (type it: thiserror, per operation):\n{}",
        found.join("\n")
    );
}
