//! A check on the source: the console's markup is made only by its `html` module. Pages
//! build `Html` values with `html!` (each argument rendered by its type: text escaped) and
//! the module's builders; anything that writes a string into a page by hand (`write!`,
//! `push_str`, the tuple constructor, axum's `Html`) would skip the escaping, so it is
//! refused here. `html!` itself refuses an inline `{name}` when it compiles.

use std::path::{Path, PathBuf};

/// What only `console/html.rs` may write, and why each is refused elsewhere.
const REFUSED: [(&str, &str); 8] = [
    ("write!(", "writes a string into markup unescaped"),
    ("writeln!(", "writes a string into markup unescaped"),
    ("push_str(", "appends a string to markup unescaped"),
    ("format_args!(", "formats past Render"),
    ("from_checked_args", "is html!'s own way in"),
    ("axum::response::Html", "is a body made from any string"),
    ("Render for", "decides how a type is escaped"),
    ("Html(", "wraps a string as markup"),
];

/// Each refused use in `text`, as `line: what (why)`; comments are not code.
fn refused_uses(text: &str) -> Vec<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let line = line.split("//").next().unwrap_or_default();
        for (what, why) in REFUSED {
            let mut at = 0;
            while let Some(offset) = line[at..].find(what) {
                let start = at + offset;
                at = start + what.len();
                // `Html(` only as a whole word: `some_html(` is another function.
                let whole = line[..start]
                    .chars()
                    .last()
                    .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
                if what != "Html(" || whole {
                    found.push(format!("{}: {what} ({why})", n + 1));
                }
            }
        }
    }
    found
}

#[test]
fn the_detector_sees_markup_written_by_hand() {
    for bad in [
        "    let _ = write!(out, \"<td>{}</td>\", name);",
        "    out.push_str(&name);",
        "    Html(format!(\"<b>{name}</b>\"))",
        "impl Render for Name {",
    ] {
        assert_eq!(refused_uses(bad).len(), 1, "{bad}");
    }
    for good in [
        "    out.push(html!(\"<td>{}</td>\", name));",
        "    let page = inner_html(x); // write!( in a comment",
        "fn f() -> Html {",
    ] {
        assert!(refused_uses(good).is_empty(), "{good}");
    }
}

#[test]
fn the_console_makes_markup_only_through_its_html_module() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../services/serve/src/console");
    let mut checked = 0;
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir)
        .expect("the console's sources")
        .flatten()
    {
        let path: &Path = &entry.path();
        let name = entry.file_name();
        if name == "html.rs" || name == "tests.rs" || path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(path).expect("a source file");
        checked += 1;
        found.extend(
            refused_uses(&text)
                .into_iter()
                .map(|f| format!("{}:{f}", path.display())),
        );
    }
    assert!(checked >= 4, "only {checked} console sources found");
    assert!(
        found.is_empty(),
        "markup made by hand in the console (use html! or the html module's builders):\n{}",
        found.join("\n")
    );
}
