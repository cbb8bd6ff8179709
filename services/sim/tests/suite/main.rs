//! provledger-sim's integration tests (the flows and the seeded simulation), one test
//! binary with a module per file.
mod flows;
mod simulation;
