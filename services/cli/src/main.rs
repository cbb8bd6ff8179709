//! The `provledger` command. Exit codes: 0 success, 1 the command found a problem,
//! 2 bad usage or input, 3 infrastructure unavailable.
//!
//! It parses, calls a crate and prints; it holds no business rule. `commands/` has one file
//! per subcommand; errors map to the contract's exit codes in `commands/mod.rs`. `demo` and
//! `simulate` are built only with the `demo` feature, so the production binary links no
//! simulator. Its tests run the binary against real sled dirs and private nats-servers.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
mod commands;
mod duration;

use commands::state::LogPoint;
use commands::{append::AppendArgs, CommandError};
use provledger_client::{Ledger, LedgerOptions, Writer};
use provledger_events::{AggregateId, AggregateKind, AggregateRef, Expectation, IdRef};
use provledger_projections::rollback::RetryPolicy;
use provledger_serve::ServeOptions;
use std::time::Duration;

/// jemalloc, not glibc's malloc: `provledger serve`'s projector spent 37% of its catch-up
/// in malloc/free, and jemalloc took a quarter off its time per commit (issue 23;
/// docs/benchmarks.md, "Catch-up").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
use uuid::Uuid;

/// The heading the global options are listed under in every command's help, after the
/// command's own options.
const GLOBAL_OPTIONS: &str = "Global options";

#[derive(Parser)]
#[command(
    name = "provledger",
    version,
    about = "An event-sourced provisioning ledger"
)]
struct Cli {
    /// NATS server URL; without it, commands run embedded on sled alone.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_NATS_URL"
    )]
    nats: Option<String>,
    /// The sled data directory.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_DATA_DIR",
        default_value = "./provledger-data"
    )]
    data_dir: PathBuf,
    /// The JetStream stream name.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_STREAM",
        default_value = "PROVLEDGER"
    )]
    stream: String,
    /// The prefix of every NATS subject.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_PREFIX",
        default_value = "provledger"
    )]
    subject_prefix: String,
    /// The stream's replicas: 1 on one server, 3 or 5 on a JetStream cluster (an existing
    /// stream must have this many).
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_STREAM_REPLICAS",
        default_value_t = 1
    )]
    stream_replicas: usize,
    #[command(flatten)]
    auth: AuthArgs,
    /// Machine-readable output: one JSON document on stdout.
    #[arg(long, global = true, help_heading = GLOBAL_OPTIONS)]
    json: bool,
    /// How logs (stderr) are written: `text` for people, `json` (one object per line,
    /// with the span's fields, `trace_id` included) for log pipelines.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// How to authenticate to NATS and verify it; secrets are read from files, never given
/// on the command line.
#[derive(clap::Args)]
struct AuthArgs {
    /// A NATS credentials file (user JWT and nkey seed), for servers in operator mode.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_NATS_CREDS",
        value_name = "FILE"
    )]
    creds: Option<PathBuf>,
    /// A file holding a user nkey seed (SU...), for servers that list nkey users.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_NATS_NKEY",
        value_name = "FILE"
    )]
    nkey: Option<PathBuf>,
    /// The CA certificate (PEM) that signed the server's certificate; requires TLS.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_NATS_TLS_CA",
        value_name = "FILE"
    )]
    tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), for servers that verify clients.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_NATS_TLS_CERT",
        value_name = "FILE"
    )]
    tls_cert: Option<PathBuf>,
    /// The key (PEM) of --tls-cert.
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL_OPTIONS,
        env = "PROVLEDGER_NATS_TLS_KEY",
        value_name = "FILE"
    )]
    tls_key: Option<PathBuf>,
}

impl AuthArgs {
    fn nats_auth(&self) -> provledger_client::NatsAuth {
        provledger_client::NatsAuth {
            creds: self.creds.clone(),
            nkey: self.nkey.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the built-in end-to-end scenarios: embedded in a fresh data dir, or with --nats
    /// on that server's stream (new aggregates each run, seen by a serve on it).
    Demo {
        /// Print every commit and every plan whole, not a summary per scenario.
        #[arg(long)]
        verbose: bool,
    },
    /// Append events (the catalogue's JSON form) to one aggregate as one commit.
    Append(AppendFlags),
    /// An aggregate's commits, oldest first, decoded, with a hash-chain check.
    History {
        /// The aggregate, as KIND/ID (ID: whole, short or a unique start).
        aggregate: AggregateRef,
    },
    /// The projection service: consume the log, keep sled state, answer queries. Needs --nats.
    Serve(ServeFlags),
    /// An aggregate's projected state, now or at a past position or time.
    State {
        /// The aggregate, as KIND/ID (ID: whole, short or a unique start).
        aggregate: AggregateRef,
        /// A log position, or an RFC 3339 time.
        #[arg(long)]
        at: Option<LogPoint>,
    },
    /// Rebuild all projections up to a point and print counts by status and anomalies.
    Replay {
        /// A log position, or an RFC 3339 time (default: the end of the log).
        #[arg(long)]
        to: Option<LogPoint>,
        /// With --nats: start from the snapshot serve publishes in this JetStream object
        /// store (`serve --snapshot-bucket`), checked as a new replica checks it, and fold
        /// only what follows it; a snapshot that is missing, refused or past --to is not
        /// used (replay then folds from position 1 and says why).
        #[arg(long, value_name = "BUCKET")]
        snapshot_bucket: Option<String>,
    },
    /// Compare what the executors hold (their inventory over NATS) with what the ledger
    /// records. Exit 1 with findings (leaked, missing, mismatched); writes nothing unless
    /// --fix leaked.
    Drift(DriftFlags),
    /// An aggregate whose chain lost commits (the log's server dropped them): acknowledge
    /// the loss so that it is read and written again.
    Integrity {
        #[command(subcommand)]
        action: IntegrityCommand,
    },
    /// Show (dry run) or record and drive the rollback plan of a failed operation.
    Rollback {
        #[command(subcommand)]
        action: RollbackCommand,
    },
    /// Check hash chains, position continuity, quarantined entries, the sled copy against
    /// the stream (with --nats) and the contract's invariants. Exit 1 on any violation.
    Audit {
        /// Release the orphan allocations found (consumer or provider gone), only those,
        /// each with its reason, then audit again.
        #[arg(long)]
        fix_orphans: bool,
    },
    /// Copy the JetStream stream, as it is at one position, into a new or empty directory:
    /// `stream.bin` (every message, framed) and `manifest.json` (positions, holes, counts,
    /// each aggregate's chain tip, the content's blake3). Needs --nats.
    Backup {
        /// The directory to write; it must not exist or be empty.
        #[arg(long, value_name = "DIR")]
        to: PathBuf,
        /// Write the backup from a stopped serve replica's copy of the stream in its data
        /// dir DATA_DIR instead of from the stream (no --nats needed): the commits it
        /// copied, at their positions, with the subjects and message ids their writers
        /// gave them (--subject-prefix as the replica's); what it lacks becomes holes.
        #[arg(long, value_name = "DATA_DIR")]
        from_copy: Option<PathBuf>,
    },
    /// Put a backup back into an empty stream (--stream, created if missing), at the same
    /// positions, after checking every byte of it against its manifest. Needs --nats.
    Restore {
        /// The directory `provledger backup --to` wrote.
        #[arg(long, value_name = "DIR")]
        from: PathBuf,
        /// Then read the restored stream back (the same bytes at the same positions, the
        /// manifest's tips) and audit it. Exit 1 if anything differs or the audit finds a
        /// violation.
        #[arg(long, conflicts_with = "check_only")]
        verify: bool,
        /// Only check the backup against its manifest (every byte, as a restore does before
        /// publishing) and publish nothing; needs no --nats.
        #[arg(long)]
        check_only: bool,
    },
    /// Run the stuck-state recovery sweep once: interrupted tasks (lease expired) are
    /// re-driven, cleared or put in error, each recorded with its reason.
    Recover {
        /// Say what would be recovered; write nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Resource providers (compute nodes).
    Provider {
        #[command(subcommand)]
        action: ProviderCommand,
    },
    /// Claim allocations for instances that have a host, no allocation and no task in
    /// progress. Exit 0 healed, 4 nothing to do, 1 some could not be healed.
    HealAllocations {
        /// Say what would be claimed; write nothing.
        #[arg(long)]
        dry_run: bool,
        /// Only this instance (whole id, short id or a unique start).
        #[arg(long)]
        instance: Option<IdRef>,
    },
    /// Run the seeded simulation: operations of every kind under injected faults, with the
    /// invariants checked after each seed. Exit 1 on a broken invariant, naming the seed.
    Simulate {
        /// How many seeds to run.
        #[arg(long, default_value_t = 200)]
        seeds: u64,
        /// Replay this one seed (or start the run here with --seeds).
        #[arg(long)]
        seed: Option<u64>,
        /// Operations started per seed.
        #[arg(long, default_value_t = 10)]
        operations: usize,
    },
    /// The operator's worklist: operations by status (needs_attention: stopped rollbacks),
    /// kind or target; one operation whole (`show`); cancel a running one.
    Operation {
        #[command(subcommand)]
        action: OperationCommand,
    },
    /// Send one request to a running service and print the reply.
    Query {
        #[arg(help = commands::query::endpoints_help())]
        endpoint: String,
        /// The JSON request (default {}).
        request: Option<String>,
        /// How long to wait for the reply (2s, 500ms, 1m); longer than the service's
        /// min_position wait, so that `stale` arrives as a reply.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Print the ledger's changes as serve applies them, one line per commit (one JSON
    /// object per line with --json), until Ctrl-C or SIGTERM, which name the position to
    /// resume from. Needs --nats (a running `provledger serve`).
    Watch {
        /// Only this aggregate's commits, as KIND/ID (ID: whole, short or a unique start).
        aggregate: Option<AggregateRef>,
        /// Start after this position (0: from the first commit); default: from now (the
        /// end the service has applied).
        #[arg(long, value_name = "P")]
        after: Option<u64>,
        /// Only commits of this kind of aggregate (cluster, instance, provider, operation);
        /// may be repeated.
        #[arg(long, value_name = "K")]
        kind: Vec<AggregateKind>,
        /// Only the commits made for this operation (whole, short or a unique start), on
        /// every aggregate it wrote.
        #[arg(long, value_name = "OP")]
        operation: Option<IdRef>,
        /// Only commits holding an event of this type (the catalogue's names:
        /// vm_state_changed, ...); may be repeated.
        #[arg(long, value_name = "TYPE")]
        event: Vec<String>,
    },
    /// Print the shell completion script for SHELL (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Print the man page provledger(1), or write one page per subcommand into --out-dir.
    Man {
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum ProviderCommand {
    /// Delete a provider: refused while allocations exist (each listed with why and what
    /// to do); --cascade releases them first, with reasons, then deletes.
    // One of the two, told by clap before anything is opened.
    #[command(group(clap::ArgGroup::new("which").required(true).args(["id", "host"])))]
    Delete {
        /// The provider (whole id, short id or a unique start); or --host for every provider
        /// of a compute service.
        id: Option<IdRef>,
        /// Every provider registered on this host, one by one.
        #[arg(long)]
        host: Option<String>,
        #[arg(long)]
        cascade: bool,
    },
}

#[derive(Subcommand)]
enum OperationCommand {
    /// Operations newest first (ids are UUID v7: id order is start order), read through
    /// the store's indexes: a header line, then one line per operation with when it
    /// started, its age and how long since its last commit.
    List {
        /// running, succeeded, failed, rolling_back, rolled_back, held, cancelled or
        /// needs_attention.
        #[arg(long)]
        status: Option<String>,
        /// The operation kind as JSON says it (create_cluster, scale_cluster, ...).
        #[arg(long)]
        kind: Option<String>,
        /// The aggregate it works on, as KIND/ID.
        #[arg(long)]
        target: Option<AggregateRef>,
        /// Only operations started within this long before now (10m, 2h, 1d; a bare
        /// number is seconds).
        #[arg(long, value_parser = duration::seconds_or_humantime)]
        since: Option<Duration>,
        /// At most this many (1 to 1000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Go on after this operation id (the last one of the previous page), to older ones.
        #[arg(long)]
        after: Option<IdRef>,
    },
    /// One operation whole: kind, target, status, times, stages, steps, the rollback plan
    /// with each compensation's full id and state, what remains at which executor, and the
    /// command that moves it on.
    Show {
        /// The operation: its whole id, its short id (the last 12 hex digits shown) or a
        /// unique start.
        operation_id: IdRef,
    },
    /// Cancel a running operation (its writer died, say): records `cancellation_requested`
    /// (refused, with why, on one that already stopped or closed); its runner stops at its
    /// next step, and the rollback follows: with --nats serve's rollback worker carries it
    /// out; embedded this command drives it to the end, as `rollback run` does.
    Cancel {
        /// The operation: whole, short or a unique start.
        operation_id: IdRef,
        /// Why, for the log (a ticket, what was seen).
        #[arg(long)]
        reason: String,
        /// Who cancels: the commit's actor.
        #[arg(long, default_value = "operator")]
        actor: String,
        /// Embedded: NATS server where the executors answer compensation requests
        /// (as `rollback run --executors-url`); defaults to --nats.
        #[arg(long, env = "PROVLEDGER_EXECUTORS_URL")]
        executors_url: Option<String>,
    },
}

#[derive(Subcommand)]
enum IntegrityCommand {
    /// Record, in the log, that versions of an aggregate are lost and its state is trusted
    /// without them (`history` shows the loss). Needs publish rights on the stream (the
    /// `writer` user under deploy/nats/accounts.conf).
    Acknowledge {
        /// The aggregate, as KIND/ID (ID: whole, short or a unique start).
        aggregate: AggregateRef,
        /// The lost versions as `history` and the integrity error name them: N or N-M.
        #[arg(long)]
        lost: commands::integrity::LostRange,
        /// Why the state is trusted without them (what was checked, a ticket).
        #[arg(long)]
        reason: String,
        /// Who acknowledges: the commit's actor.
        #[arg(long, default_value = "operator")]
        actor: String,
    },
}

#[derive(Subcommand)]
enum RollbackCommand {
    /// Print the recorded plan, or the plan the planner would record now (dry run).
    Plan {
        /// The operation: whole, short or a unique start.
        operation_id: IdRef,
    },
    /// Record the plan and drive it to the end.
    Run {
        /// The operation: whole, short or a unique start.
        operation_id: IdRef,
        /// NATS server where the executors (ipam, dhcp, dns, hypervisor, ...) answer
        /// compensation requests; defaults to --nats.
        #[arg(long, env = "PROVLEDGER_EXECUTORS_URL")]
        executors_url: Option<String>,
    },
    /// Record that a stuck compensation of a needs_attention rollback was handled by hand
    /// (the resource removed at its executor); once none is left, the rollback finishes.
    Resolve {
        /// The operation: whole, short or a unique start.
        operation_id: IdRef,
        /// The compensation handled (`operation show`, `rollback plan` and `audit` name it):
        /// its whole id, or digits of it unique within the operation's plan.
        #[arg(long)]
        compensation: IdRef,
        /// What was done by hand, for the log (a ticket, who checked what).
        #[arg(long)]
        reason: String,
        /// Who did it: the commit's actor (over NATS with accounts, record through
        /// `cmd.append` to have your authenticated identity instead).
        #[arg(long, default_value = "operator")]
        actor: String,
    },
}

/// What `drift --fix` acts on: only leaked resources.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum DriftFix {
    Leaked,
}

/// `RUST_LOG` wins; otherwise the service logs at info and one-shot commands at warn.
fn init_tracing(default: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        // One JSON object per line; the current span and its parents are fields, so a
        // request's `trace_id` is on every line logged while it is handled.
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
}

/// `append`'s flags.
#[derive(clap::Args)]
struct AppendFlags {
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
    /// Accept an inventory below current usage (hardware that really shrank); the
    /// provider is then reported as over capacity until it fits again.
    #[arg(long)]
    force: bool,
}

/// `serve`'s flags.
#[derive(clap::Args)]
struct ServeFlags {
    /// Longest wait for a query's min_position before answering `stale` (500ms, 2s;
    /// a bare number is milliseconds).
    #[arg(long, visible_alias = "min-position-wait-ms", default_value = "2s", value_parser = duration::millis_or_humantime)]
    min_position_wait: Duration,
    /// Snapshot the projection each time this many positions are passed (0: never).
    #[arg(long, default_value_t = provledger_serve::SNAPSHOT_EVERY_POSITIONS_DEFAULT)]
    snapshot_every: u64,
    /// Attempts per compensation before the operation needs attention.
    #[arg(long, default_value_t = 5)]
    compensation_attempts_max: u32,
    /// Wait after a failed compensation attempt, doubled per attempt (capped at 30 s);
    /// a bare number is milliseconds.
    #[arg(long, visible_alias = "compensation-backoff-ms", default_value = "500ms", value_parser = duration::millis_or_humantime)]
    compensation_backoff: Duration,
    /// How long a compensation request may go unanswered before it counts as lost; a
    /// bare number is milliseconds.
    #[arg(long, visible_alias = "compensation-reply-wait-ms", default_value = "30s", value_parser = duration::millis_or_humantime)]
    compensation_reply_wait: Duration,
    /// Time between stuck-state recovery sweeps (one runs on start; 0: never); a bare
    /// number is seconds.
    #[arg(long, default_value = "60s", value_parser = duration::seconds_or_humantime)]
    recovery_interval: Duration,
    /// How long a running operation's runner may write nothing on it before the
    /// recovery sweep fails it ("runner silent since …") and its rollback runs (1s to
    /// 15m; runners renew with operation_heartbeat); a bare number is milliseconds.
    #[arg(long, visible_alias = "runner-lease-ms", default_value = "5m", value_parser = duration::millis_or_humantime)]
    runner_lease: Duration,
    /// Time between drift sweeps (the executors' inventories against the store, as
    /// `provledger drift`; findings in q.drift and the metrics; 0: never, the
    /// default); a bare number is seconds.
    #[arg(long, default_value = "0", value_parser = duration::seconds_or_humantime)]
    drift_interval: Duration,
    /// Created once this replica has caught up and joined the queue group, removed
    /// when it stops or loses NATS (a per-replica readiness probe).
    #[arg(long, value_name = "PATH")]
    ready_file: Option<PathBuf>,
    /// Answer Prometheus scrapes on http://ADDR/metrics (and readiness on
    /// http://ADDR/health), e.g. 127.0.0.1:9464. Off by default.
    #[arg(long, env = "PROVLEDGER_METRICS_ADDR", value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// A JetStream object store bucket: each projection snapshot is also published
    /// there, and a replica whose data dir is new bootstraps from the one published
    /// (checked by hash and against the stream's chain tips; refused, it catches up
    /// from position 1). Off by default.
    #[arg(long, env = "PROVLEDGER_SNAPSHOT_BUCKET", value_name = "BUCKET")]
    snapshot_bucket: Option<String>,
    /// Serve the read-only operator's console on http://ADDR/ (operations, rollback
    /// plans, entities with their verified history, health), e.g. 127.0.0.1:8080. Off
    /// by default; it has no authentication: see docs/console.md.
    #[arg(long, env = "PROVLEDGER_HTTP_ADDR", value_name = "ADDR")]
    http: Option<std::net::SocketAddr>,
    /// Audit the whole log once caught up and then this often (as `provledger audit`;
    /// the last result on the console's health page; 0: never, the default); a bare
    /// number is seconds.
    #[arg(long, default_value = "0", value_parser = duration::seconds_or_humantime)]
    audit_interval: Duration,
    /// Keep no copy of the stream's commits in the data dir (by default each replica
    /// keeps the commits it applied, a second copy of the stream that offline
    /// `history`, `state --at` and `audit` read); a copy kept before is removed. See
    /// docs/operating.md, "The replica's copy of the stream".
    #[arg(long)]
    no_log_copy: bool,
    /// Export spans (cmd.append, compensation and re-issue requests) to an
    /// OpenTelemetry collector's OTLP/HTTP receiver at this base URL (spans go to
    /// URL/v1/traces), e.g. http://127.0.0.1:4318. Plain http only. Off by default.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// Do not record callers' traceparent in the commits cmd.append writes (format 3):
    /// for a rolling upgrade, until every reader of the stream runs a build that reads
    /// format 3 (docs/events.md, "Deploy readers before writers").
    #[arg(long, env = "PROVLEDGER_NO_TRACE_RECORD")]
    no_trace_record: bool,
    /// How often spans are sent to the collector; a bare number is milliseconds.
    #[arg(long, default_value = "2s", value_parser = duration::millis_or_humantime)]
    otlp_export_interval: Duration,
}

/// `drift`'s flags.
#[derive(clap::Args)]
struct DriftFlags {
    /// Ask only this executor (default: every executor the ledger names).
    #[arg(long)]
    executor: Option<String>,
    /// NATS server where the executors answer inventory requests; defaults to --nats.
    #[arg(long, env = "PROVLEDGER_EXECUTORS_URL")]
    executors_url: Option<String>,
    /// Remove the leaked resources through the compensation path, recorded in the
    /// ledger as a remove_leaked operation (each adopted as discovered, then
    /// compensated). Only `leaked` is fixable: `missing` is the entity's operator's.
    #[arg(long, value_enum)]
    fix: Option<DriftFix>,
    /// With --fix: print what would be removed and write nothing.
    #[arg(long, requires = "fix")]
    dry_run: bool,
    /// With --fix: why, for the log (a ticket, who checked that nothing uses them).
    #[arg(long, requires = "fix")]
    reason: Option<String>,
    /// With --fix: who asks; the commit's actor.
    #[arg(long, requires = "fix", default_value = "operator")]
    actor: String,
}

/// What every command shares: where the ledger is, and how to print.
struct Globals {
    options: LedgerOptions,
    json: bool,
}

async fn run(cli: Cli) -> Result<(), CommandError> {
    let g = Globals {
        options: LedgerOptions {
            nats_url: cli.nats.clone(),
            data_dir: cli.data_dir.clone(),
            stream: cli.stream.clone(),
            subject_prefix: cli.subject_prefix.clone(),
            stream_replicas: cli.stream_replicas,
            nats_auth: cli.auth.nats_auth(),
        },
        json: cli.json,
    };
    commands::invocation::set(invocation(&g.options));
    let json = g.json;
    match cli.command {
        #[cfg(feature = "demo")]
        Command::Demo { verbose } => commands::demo::run(&g.options, verbose, json).await,
        #[cfg(not(feature = "demo"))]
        Command::Demo { .. } => Err(without_the_simulator("demo")),
        Command::Completions { shell } => commands::completions::completions(shell, Cli::command()),
        Command::Man { out_dir } => commands::completions::man(Cli::command(), out_dir.as_deref()),
        Command::Append(flags) => append(flags, &g).await,
        Command::History { aggregate } => {
            let aggregate = resolve_aggregate(&g, &aggregate).await?;
            with_ledger(&g.options, |ledger| async move {
                let result = commands::history::run(&ledger, aggregate, json).await;
                (ledger, result)
            })
            .await
        }
        Command::Serve(flags) => commands::serve::run(serve_options(flags, &g)?).await,
        Command::State { aggregate, at } => {
            state(resolve_aggregate(&g, &aggregate).await?, at, &g).await
        }
        Command::Audit { fix_orphans } => audit(fix_orphans, &g).await,
        Command::Backup {
            to,
            from_copy: Some(from),
        } => commands::backup::run_backup_from_copy(&g.options, &from, &to, json),
        Command::Backup { to, .. } => commands::backup::run_backup(&g.options, &to, json).await,
        Command::Restore {
            from,
            check_only: true,
            ..
        } => commands::backup::run_check(&from, json),
        Command::Restore { from, verify, .. } => {
            commands::backup::run_restore(&g.options, &from, verify, json).await
        }
        Command::Provider {
            action: ProviderCommand::Delete { id, host, cascade },
        } => {
            let id = resolve_some_id(&g, AggregateKind::Provider, id).await?;
            with_ledger(&g.options, |ledger| async move {
                let writer = Writer::new(ledger.clone());
                let result = commands::placement::delete(&writer, id, host, cascade, json).await;
                (ledger, result)
            })
            .await
        }
        Command::Recover { dry_run } => {
            let opts = g.options.clone();
            with_ledger(&g.options, |ledger| async move {
                let writer = Writer::new(ledger.clone());
                let result = commands::recover::run(&writer, &opts, dry_run, json).await;
                (ledger, result)
            })
            .await
        }
        Command::HealAllocations { dry_run, instance } => {
            let instance = resolve_some_id(&g, AggregateKind::Instance, instance).await?;
            with_ledger(&g.options, |ledger| async move {
                let writer = Writer::new(ledger.clone());
                let result = commands::placement::heal(&writer, instance, dry_run, json).await;
                (ledger, result)
            })
            .await
        }
        #[cfg(not(feature = "demo"))]
        Command::Simulate { .. } => Err(without_the_simulator("simulate")),
        #[cfg(feature = "demo")]
        Command::Simulate {
            seeds,
            seed,
            operations,
        } => simulate(seeds, seed, operations, json).await,
        Command::Replay {
            to,
            snapshot_bucket,
        } => replay(to, snapshot_bucket, &g).await,
        Command::Drift(flags) => drift(flags, &g).await,
        Command::Integrity { action } => integrity(action, &g).await,
        Command::Rollback { action } => rollback(action, &g).await,
        Command::Operation { action } => operation(action, &g).await,
        Command::Query {
            endpoint,
            request,
            timeout,
        } => {
            let nats_url = g.options.nats_url.clone().ok_or_else(|| {
                CommandError::BadInput("query needs --nats URL (or PROVLEDGER_NATS_URL)".into())
            })?;
            let (auth, prefix) = (&g.options.nats_auth, &g.options.subject_prefix);
            commands::query::run(&nats_url, auth, prefix, &endpoint, request, timeout).await
        }
        Command::Watch {
            aggregate,
            after,
            kind,
            operation,
            event,
        } => {
            let nats_url = g.options.nats_url.clone().ok_or_else(|| {
                CommandError::BadInput(
                    "watch needs --nats URL (or PROVLEDGER_NATS_URL): it follows what a running \
                     `provledger serve` applies"
                        .into(),
                )
            })?;
            let event_types = commands::watch::event_types(event)?;
            let aggregate = resolve_some_aggregate(&g, aggregate).await?;
            let operation_id = resolve_some_id(&g, AggregateKind::Operation, operation).await?;
            commands::watch::run(commands::watch::Watch {
                nats_url: &nats_url,
                auth: &g.options.nats_auth,
                prefix: &g.options.subject_prefix,
                filter: provledger_client::follow::ChangeFilter {
                    kinds: kind.into_iter().collect(),
                    aggregate,
                    operation_id,
                    event_types,
                },
                after,
                json,
            })
            .await
        }
    }
}

/// `audit`, after releasing the orphan allocations with --fix-orphans.
async fn audit(fix_orphans: bool, g: &Globals) -> Result<(), CommandError> {
    let json = g.json;
    if fix_orphans {
        with_ledger(&g.options, |ledger| async move {
            let writer = Writer::new(ledger.clone());
            let result = commands::placement::release_orphans(&writer, json)
                .await
                .map(|_| ());
            (ledger, result)
        })
        .await?;
    }
    commands::audit::run(&g.options, json).await
}

/// `integrity acknowledge`.
async fn integrity(action: IntegrityCommand, g: &Globals) -> Result<(), CommandError> {
    let IntegrityCommand::Acknowledge {
        aggregate,
        lost,
        reason,
        actor,
    } = action;
    let aggregate = resolve_aggregate(g, &aggregate).await?;
    let json = g.json;
    with_ledger(&g.options, |ledger| async move {
        let result =
            commands::integrity::acknowledge(&ledger, aggregate, lost, reason, actor, json).await;
        (ledger, result)
    })
    .await
}

/// `append`: the events parsed before the ledger is opened, so bad input never waits on
/// infrastructure.
async fn append(flags: AppendFlags, g: &Globals) -> Result<(), CommandError> {
    let events = commands::append::read_events_source(&flags.events)?;
    let events = commands::append::parse_events(&events)?;
    let ledger = Ledger::open(&g.options).await?;
    let args = AppendArgs {
        aggregate: flags.aggregate,
        expect: flags.expect,
        events,
        commit_id: flags.commit_id,
        operation_id: flags.operation_id,
        causation_id: flags.causation_id,
        actor: flags.actor,
        force: flags.force,
    };
    let result = commands::append::run(&Writer::new(ledger.clone()), args, g.json).await;
    ledger.close();
    result
}

/// `serve`'s options from its flags.
fn serve_options(flags: ServeFlags, g: &Globals) -> Result<ServeOptions, CommandError> {
    let nats_url = g.options.nats_url.clone().ok_or_else(|| {
        CommandError::BadInput(
            "serve needs --nats URL (or PROVLEDGER_NATS_URL): it answers queries over NATS".into(),
        )
    })?;
    let every = |d: Duration| (!d.is_zero()).then_some(d);
    let lease_ms = i64::try_from(flags.runner_lease.as_millis()).unwrap_or(i64::MAX);
    use provledger_projections::recovery::{RUNNER_LEASE_MS_MAX, RUNNER_LEASE_MS_MIN};
    if !(RUNNER_LEASE_MS_MIN..=RUNNER_LEASE_MS_MAX).contains(&lease_ms) {
        return Err(CommandError::BadInput(format!(
            "--runner-lease {lease_ms} ms is outside {RUNNER_LEASE_MS_MIN}..={RUNNER_LEASE_MS_MAX} ms"
        )));
    }
    Ok(ServeOptions {
        nats_url,
        data_dir: g.options.data_dir.clone(),
        stream: g.options.stream.clone(),
        subject_prefix: g.options.subject_prefix.clone(),
        stream_replicas: g.options.stream_replicas,
        nats_auth: g.options.nats_auth.clone(),
        min_position_wait: flags.min_position_wait,
        snapshot_every: flags.snapshot_every,
        retry: RetryPolicy {
            attempts_max: flags.compensation_attempts_max.max(1),
            backoff_base_ms: duration::whole_millis_at_least_one(flags.compensation_backoff),
            reply_wait_ms: duration::whole_millis_at_least_one(flags.compensation_reply_wait),
            ..RetryPolicy::default()
        },
        // An executor that does not answer within the reply wait has failed this attempt;
        // the request itself waits at most that long.
        executor_reply_wait: flags
            .compensation_reply_wait
            .clamp(Duration::from_millis(1), Duration::from_secs(30)),
        recovery_interval: every(flags.recovery_interval),
        runner_lease: flags.runner_lease,
        drift_interval: every(flags.drift_interval),
        ready_file: flags.ready_file,
        metrics_addr: flags.metrics_addr,
        snapshot_bucket: flags.snapshot_bucket,
        http_addr: flags.http,
        audit_interval: every(flags.audit_interval),
        log_copy: !flags.no_log_copy,
        record_traces: !flags.no_trace_record,
        // An empty value (an unset variable exported as "") means off, as OpenTelemetry's
        // own SDKs read it.
        otlp: flags
            .otlp_endpoint
            .filter(|e| !e.trim().is_empty())
            .map(|endpoint| provledger_serve::OtlpOptions {
                endpoint,
                export_interval: flags
                    .otlp_export_interval
                    .clamp(Duration::from_millis(10), Duration::from_secs(60)),
            }),
    })
}

/// `state`: from the data dir, or from the stream with --nats.
async fn state(
    aggregate: AggregateId,
    at: Option<LogPoint>,
    g: &Globals,
) -> Result<(), CommandError> {
    let json = g.json;
    with_ledger(&g.options, |ledger| async move {
        let result = match &ledger {
            Ledger::Embedded(log) => commands::state::state_local(log, aggregate, at, json).await,
            Ledger::Memory(_) => Err(commands::CommandError::BadInput(
                "an in-memory ledger cannot be read from the command line".into(),
            )),
            Ledger::JetStream(log) => commands::state::state_remote(log, aggregate, at, json).await,
        };
        (ledger, result)
    })
    .await
}

/// `simulate`: each seed runs on its own paused runtime, off this one.
#[cfg(feature = "demo")]
async fn simulate(
    seeds: u64,
    seed: Option<u64>,
    operations: usize,
    json: bool,
) -> Result<(), CommandError> {
    let (seeds, first) = match seed {
        Some(s) if seeds == 200 => (1, s),
        Some(s) => (seeds, s),
        None => (seeds, 0),
    };
    tokio::task::spawn_blocking(move || commands::simulate::run(seeds, first, operations, json))
        .await
        .map_err(|e| commands::CommandError::Infrastructure(format!("simulation task: {e}")))?
}

/// `replay`: from the data dir, or from the stream (and a published snapshot) with --nats.
async fn replay(
    to: Option<LogPoint>,
    snapshot_bucket: Option<String>,
    g: &Globals,
) -> Result<(), CommandError> {
    let json = g.json;
    with_ledger(&g.options, |ledger| async move {
        let result = match &ledger {
            Ledger::Embedded(_) if snapshot_bucket.is_some() => {
                Err(commands::CommandError::BadInput(
                    "--snapshot-bucket reads a JetStream object store: give --nats".into(),
                ))
            }
            Ledger::Embedded(log) => commands::replay::replay_local(log, to, json).await,
            Ledger::Memory(_) => Err(commands::CommandError::BadInput(
                "an in-memory ledger cannot be read from the command line".into(),
            )),
            Ledger::JetStream(log) => {
                commands::replay::replay_remote(log, to, snapshot_bucket, json).await
            }
        };
        (ledger, result)
    })
    .await
}

/// `drift`: the executors asked over --executors-url, or --nats.
async fn drift(flags: DriftFlags, g: &Globals) -> Result<(), CommandError> {
    let url = flags.executors_url.or(g.options.nats_url.clone());
    let auth = g.options.nats_auth.clone();
    let (prefix, json) = (g.options.subject_prefix.clone(), g.json);
    with_ledger(&g.options, |ledger| async move {
        let args = commands::drift::DriftArgs {
            executor: flags.executor,
            executors_url: url.as_deref(),
            auth: &auth,
            subject_prefix: &prefix,
            json,
            fix: flags.fix.map(|DriftFix::Leaked| commands::drift::Fix {
                dry_run: flags.dry_run,
                reason: flags.reason.unwrap_or_default(),
                actor: flags.actor,
            }),
        };
        let result = commands::drift::run(&Writer::new(ledger.clone()), args).await;
        (ledger, result)
    })
    .await
}

/// `rollback plan | resolve | run`.
async fn rollback(action: RollbackCommand, g: &Globals) -> Result<(), CommandError> {
    let auth = g.options.nats_auth.clone();
    let (nats, prefix, json) = (
        g.options.nats_url.clone(),
        g.options.subject_prefix.clone(),
        g.json,
    );
    let operation = match &action {
        RollbackCommand::Plan { operation_id }
        | RollbackCommand::Run { operation_id, .. }
        | RollbackCommand::Resolve { operation_id, .. } => operation_id,
    };
    let operation_id = resolve_id(g, AggregateKind::Operation, operation).await?;
    with_ledger(&g.options, |ledger| async move {
        let writer = Writer::new(ledger.clone());
        let result = match action {
            RollbackCommand::Plan { .. } => {
                commands::rollback::plan(&writer, operation_id, json).await
            }
            RollbackCommand::Resolve {
                compensation,
                reason,
                actor,
                ..
            } => {
                commands::rollback::resolve(
                    &writer,
                    operation_id,
                    &compensation,
                    &reason,
                    &actor,
                    json,
                )
                .await
            }
            RollbackCommand::Run { executors_url, .. } => {
                let url = executors_url.or(nats);
                commands::rollback::run(&writer, operation_id, url.as_deref(), &auth, &prefix, json)
                    .await
            }
        };
        (ledger, result)
    })
    .await
}

/// `operation list | show | cancel`: reads from a service with --nats, else from the data
/// dir; `cancel` writes through the write path.
async fn operation(action: OperationCommand, g: &Globals) -> Result<(), CommandError> {
    let json = g.json;
    let (status, kind, target, since, limit, after) = match action {
        OperationCommand::List {
            status,
            kind,
            target,
            since,
            limit,
            after,
        } => (status, kind, target, since, limit, after),
        OperationCommand::Show { operation_id } => {
            let operation_id = resolve_id(g, AggregateKind::Operation, &operation_id).await?;
            let now = provledger_events::Timestamp::now();
            if let Some(url) = &g.options.nats_url {
                let (auth, prefix) = (&g.options.nats_auth, &g.options.subject_prefix);
                return commands::operation::show_remote(
                    url,
                    auth,
                    prefix,
                    operation_id,
                    now,
                    json,
                )
                .await;
            }
            return with_ledger(&g.options, |ledger| async move {
                let result = match &ledger {
                    Ledger::Embedded(log) => {
                        commands::operation::show_local(log, operation_id, now, json).await
                    }
                    _ => Err(CommandError::BadInput(
                        "operation show reads a data dir, or a service with --nats".into(),
                    )),
                };
                (ledger, result)
            })
            .await;
        }
        OperationCommand::Cancel {
            operation_id,
            reason,
            actor,
            executors_url,
        } => {
            let operation_id = resolve_id(g, AggregateKind::Operation, &operation_id).await?;
            let cancel = commands::operation::Cancel {
                id: operation_id,
                reason,
                actor,
                executors_url: executors_url.or(g.options.nats_url.clone()),
                nats_url: g.options.nats_url.clone(),
                auth: g.options.nats_auth.clone(),
                prefix: g.options.subject_prefix.clone(),
            };
            return with_ledger(&g.options, |ledger| async move {
                let writer = Writer::new(ledger.clone());
                let result = commands::operation::cancel(&writer, cancel, json).await;
                (ledger, result)
            })
            .await;
        }
    };
    if !(1..=1000).contains(&limit) {
        return Err(CommandError::BadInput(format!(
            "--limit must be 1 to 1000, not {limit}"
        )));
    }
    let target = resolve_some_aggregate(g, target).await?;
    let after = resolve_some_id(g, AggregateKind::Operation, after).await?;
    // The one read of the clock: what `--since` is counted back from and ages are counted to.
    let now = provledger_events::Timestamp::now();
    let since = since.map(|d| now.plus_ms(-duration::whole_millis_at_least_one(d)));
    let req = commands::operation::ListRequest {
        filter: provledger_serve::OperationFilter {
            status,
            kind,
            target,
            since,
        },
        limit,
        after,
        now,
    };
    if let Some(url) = &g.options.nats_url {
        let (auth, prefix) = (&g.options.nats_auth, &g.options.subject_prefix);
        return commands::operation::list_remote(url, auth, prefix, req, json).await;
    }
    with_ledger(&g.options, |ledger| async move {
        let result = match &ledger {
            Ledger::Embedded(log) => commands::operation::list_local(log, req, json).await,
            _ => Err(CommandError::BadInput(
                "operation list reads a data dir, or a service with --nats".into(),
            )),
        };
        (ledger, result)
    })
    .await
}

/// The one id of `kind` that `r` names (`commands/ids.rs`): a whole UUID as given; a short
/// one looked up at the service with --nats, else in the data dir.
async fn resolve_id(g: &Globals, kind: AggregateKind, r: &IdRef) -> Result<Uuid, CommandError> {
    use commands::ids::{resolve, IdSource};
    if let IdRef::Full(id) = r {
        return Ok(*id);
    }
    if let Some(nats_url) = &g.options.nats_url {
        let source = IdSource::Remote {
            nats_url,
            auth: &g.options.nats_auth,
            prefix: &g.options.subject_prefix,
        };
        return resolve(&source, kind, r).await;
    }
    let r = r.clone();
    with_ledger(&g.options, |ledger| async move {
        let result = match &ledger {
            Ledger::Embedded(log) => resolve(&IdSource::Local(log), kind, &r).await,
            _ => Err(CommandError::BadInput(format!(
                "{r} is a short id, which is looked up in a data dir or with --nats: give the whole id"
            ))),
        };
        (ledger, result)
    })
    .await
}

/// [`resolve_id`] of an optional id (a filter or a flag that may be left out).
async fn resolve_some_id(
    g: &Globals,
    kind: AggregateKind,
    r: Option<IdRef>,
) -> Result<Option<Uuid>, CommandError> {
    match r {
        Some(r) => Ok(Some(resolve_id(g, kind, &r).await?)),
        None => Ok(None),
    }
}

/// [`resolve_aggregate`] of an optional `KIND/ID`.
async fn resolve_some_aggregate(
    g: &Globals,
    r: Option<AggregateRef>,
) -> Result<Option<AggregateId>, CommandError> {
    match r {
        Some(r) => Ok(Some(resolve_aggregate(g, &r).await?)),
        None => Ok(None),
    }
}

/// The aggregate a `KIND/ID` names ([`resolve_id`]).
async fn resolve_aggregate(g: &Globals, r: &AggregateRef) -> Result<AggregateId, CommandError> {
    Ok(AggregateId::new(
        r.kind,
        resolve_id(g, r.kind, &r.id).await?,
    ))
}

/// This process's invocation: the global flags every command it suggests carries, and
/// the command it runs (`commands/invocation.rs`), read from clap's own description of
/// the command line.
fn invocation(options: &LedgerOptions) -> commands::invocation::Invocation {
    let command = Cli::command();
    let valued_globals = command
        .get_arguments()
        .filter(|a| a.is_global_set() && a.get_action().takes_values())
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect();
    let subcommands = command
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    commands::invocation::Invocation::new(options, &args, valued_globals, subcommands)
}

/// Opens the existing ledger, runs `f`, and closes the ledger whatever `f` returned. Every
/// command but `append` (and `serve`, `demo`) works on what is already there, so none of
/// them creates a data dir or a stream: a mistyped `--data-dir` or `--stream` is an error
/// naming what was looked for, never a new empty ledger.
async fn with_ledger<F, Fut, T>(options: &LedgerOptions, f: F) -> Result<T, CommandError>
where
    F: FnOnce(Ledger) -> Fut,
    Fut: std::future::Future<Output = (Ledger, Result<T, CommandError>)>,
{
    let ledger = Ledger::open_existing(options).await?;
    let (ledger, result) = f(ledger).await;
    ledger.close();
    result
}

/// Restores the default action of SIGPIPE, which Rust's runtime ignores: `provledger
/// history X | head` then ends quietly when `head` has read enough, as Unix tools do,
/// instead of panicking on the next write to the closed pipe.
fn exit_quietly_on_a_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in `main`, before any other thread exists; SIG_DFL is a
    // valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// `demo` and `simulate` in a build without the simulator (the production build).
#[cfg(not(feature = "demo"))]
fn without_the_simulator(command: &str) -> CommandError {
    CommandError::BadInput(format!(
        "this provledger is built without the simulator (the production build): `{command}` \
         needs it; run `cargo run --release -p provledger --features demo -- {command}`"
    ))
}

fn main() -> ExitCode {
    exit_quietly_on_a_closed_pipe();
    let cli = Cli::parse();
    init_tracing(
        match cli.command {
            Command::Serve { .. } => "info",
            // The simulation injects faults on purpose: the library's warnings about them
            // are noise here; a broken invariant is reported as an error.
            Command::Simulate { .. } => "error",
            _ => "warn",
        },
        cli.log_format,
    );
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
    let json = cli.json;
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        // Under --json a failure is one JSON object on stderr (stdout keeps the one
        // document a command may already have printed, like audit's report).
        Err(e) if json => {
            eprintln!("{}", e.to_json());
            ExitCode::from(e.exit_code() as u8)
        }
        // Exit 4 says there was nothing to do: an outcome, not an error.
        Err(e @ CommandError::NothingToDo(_)) => {
            eprintln!("{e}");
            ExitCode::from(e.exit_code() as u8)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
