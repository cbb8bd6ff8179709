//! provledger-events' integration tests (the codec's golden files, the golden log, event
//! details), one test binary with a module per file.
mod codec;
mod detail;
mod evolution;
mod golden_log;
