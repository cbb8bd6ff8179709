//! ARCHITECTURE.md's "pure core, effectful shell", as a check on the source: the client
//! library, serve and the CLI compose no event literally. An event chosen from state comes from a
//! pure decision in `projections/`; a record of what a caller did from the catalogue's
//! constructors (`Event::step_done(...)`). A pattern (`Event::X { .. }` in a `match`,
//! `matches!` or `if let`) is reading, not composing, and is allowed.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Lines that build an `Event` variant with a struct literal, outside tests.
fn composed_events(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).expect("source file");
    // Unit tests at the end of a file, or in a module file of their own (`tests.rs`,
    // declared `#[cfg(test)] mod tests;`), may compose what they feed the code under test.
    if file.file_name().is_some_and(|n| n == "tests.rs") {
        return Vec::new();
    }
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        let Some(at) = code.find("Event::") else {
            continue;
        };
        let rest = &code[at + "Event::".len()..];
        let variant: String = rest.chars().take_while(|c| c.is_alphanumeric()).collect();
        let after = rest[variant.len()..].trim_start();
        let literal =
            variant.starts_with(|c: char| c.is_ascii_uppercase()) && after.starts_with('{');
        let reading = code.contains("matches!")
            || code.contains("if let")
            || code.contains("=>")
            || code.trim_start().starts_with('|')
            || after.contains("..");
        if literal && !reading {
            found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
        }
    }
    found
}

#[test]
fn the_client_serve_and_the_cli_compose_no_event_literally() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("../cli/src"), &mut files);
    rust_files(&root.join("../serve/src"), &mut files);
    assert!(
        files.len() > 10,
        "no sources found under {}",
        root.display()
    );
    let found: Vec<String> = files.iter().flat_map(|f| composed_events(f)).collect();
    assert!(
        found.is_empty(),
        "events composed outside projections/ and the catalogue's constructors:\n{}",
        found.join("\n")
    );
}
