//! Reading the marked examples of `docs/`: the tests that replay or validate them share
//! the marker syntax, an HTML comment on a line of its own.

/// The text after `prefix` of an HTML comment line `<!-- PREFIX rest -->`, if the line is
/// one (`comment("<!-- schema: event -->", "schema:") == Some("event")`).
pub fn comment<'a>(line: &'a str, prefix: &str) -> Option<&'a str> {
    let inner = line
        .trim()
        .strip_prefix("<!--")?
        .strip_suffix("-->")?
        .trim();
    inner.strip_prefix(prefix).map(str::trim)
}

/// The text of a fenced block whose opening fence was just read, up to its closing fence;
/// `place` names the opening fence when the block is never closed.
pub fn fenced_block<'a>(lines: &mut impl Iterator<Item = (usize, &'a str)>, place: &str) -> String {
    let mut text = String::new();
    for (_, line) in lines.by_ref() {
        if line.trim() == "```" {
            return text;
        }
        text.push_str(line);
        text.push('\n');
    }
    panic!("{place}: unclosed code block")
}
