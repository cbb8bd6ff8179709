//! The `provledger` command. Exit codes: 0 success, 1 the command found a problem,
//! 2 bad usage or input, 3 infrastructure unavailable.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use provledger::commands::{self, append::AppendArgs, CommandError};
use provledger::{Ledger, LedgerOptions};
use provledger_events::{AggregateId, Expectation};
use uuid::Uuid;

#[derive(Parser)]
#[command(
    name = "provledger",
    version,
    about = "An event-sourced provisioning ledger"
)]
struct Cli {
    /// NATS server URL; without it, commands run embedded on sled alone.
    #[arg(long, global = true, env = "PROVLEDGER_NATS_URL")]
    nats: Option<String>,
    /// The sled data directory.
    #[arg(
        long,
        global = true,
        env = "PROVLEDGER_DATA_DIR",
        default_value = "./provledger-data"
    )]
    data_dir: PathBuf,
    /// The JetStream stream name.
    #[arg(
        long,
        global = true,
        env = "PROVLEDGER_STREAM",
        default_value = "PROVLEDGER"
    )]
    stream: String,
    /// The prefix of every NATS subject.
    #[arg(
        long,
        global = true,
        env = "PROVLEDGER_PREFIX",
        default_value = "provledger"
    )]
    subject_prefix: String,
    /// Machine-readable output: one JSON document on stdout.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the built-in end-to-end scenario embedded, in a fresh data dir.
    Demo,
    /// Append events (the catalogue's JSON form) to one aggregate as one commit.
    Append {
        /// The aggregate, as KIND/ID (KIND is cluster, instance, provider or operation).
        aggregate: AggregateId,
        /// any, none (no commit yet) or the exact current version.
        #[arg(long)]
        expect: Expectation,
        /// A file with a JSON list of events, or - for stdin.
        #[arg(long)]
        events: String,
        /// Reuse a commit id to make a retry idempotent.
        #[arg(long)]
        commit_id: Option<Uuid>,
        #[arg(long)]
        operation_id: Option<Uuid>,
        #[arg(long)]
        causation_id: Option<Uuid>,
        #[arg(long, default_value = "cli")]
        actor: String,
    },
    /// An aggregate's commits, oldest first, decoded, with a hash-chain check.
    History {
        /// The aggregate, as KIND/ID.
        aggregate: AggregateId,
    },
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

async fn run(cli: Cli) -> Result<(), CommandError> {
    let options = LedgerOptions {
        nats_url: cli.nats.clone(),
        data_dir: cli.data_dir.clone(),
        stream: cli.stream.clone(),
        subject_prefix: cli.subject_prefix.clone(),
    };
    match cli.command {
        Command::Demo => commands::demo::run(&cli.data_dir, cli.json).await,
        Command::Append {
            aggregate,
            expect,
            events,
            commit_id,
            operation_id,
            causation_id,
            actor,
        } => {
            let events = commands::append::read_events_source(&events)?;
            // Parse before opening the ledger so bad input never waits on infrastructure.
            let events = commands::append::parse_events(&events)?;
            let ledger = Ledger::open(&options).await?;
            let args = AppendArgs {
                aggregate,
                expect,
                events,
                commit_id,
                operation_id,
                causation_id,
                actor,
            };
            let result = commands::append::run(&ledger, args, cli.json).await;
            ledger.close();
            result
        }
        Command::History { aggregate } => {
            let ledger = Ledger::open(&options).await?;
            let result = commands::history::run(&ledger, aggregate, cli.json).await;
            ledger.close();
            result
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(3);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
