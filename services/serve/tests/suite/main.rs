//! provledger-serve's integration tests, one test binary with a module per file (one link
//! instead of one per file). Run one file's tests with
//! `cargo test -p provledger-serve --test suite <module>::`.
mod projector;
mod schemas;
mod stored_form;
mod time_travel;
