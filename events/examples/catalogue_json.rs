//! Prints one example of every event in the catalogue's JSON form (used for docs/events.md).
fn main() {
    for event in provledger_events::catalogue::samples::all() {
        match serde_json::to_string(&event) {
            Ok(json) => println!("{json}"),
            Err(e) => eprintln!("{}: {e}", event.name()),
        }
    }
}
