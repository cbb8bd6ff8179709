//! The ledger a service writes to: the configured backend (embedded sled, or JetStream when
//! a NATS URL is given) behind one `EventLog`, and reading an aggregate's current state.

use std::path::PathBuf;
use std::time::Duration;

use provledger_events::log::{MissingStream, OpenJetStreamError, OpenSledError};
use provledger_events::{
    AggregateId, AppendError, AppendOutcome, ChainTip, Commit, CommitDraft, CommitStream, EventLog,
    Expectation, HistoryEntry, JetStreamConfig, JetStreamLog, MemLog, ReadError, SledLog,
};

/// Where the ledger lives; mirrors the CLI's global options.
#[derive(Debug, Clone)]
pub struct LedgerOptions {
    pub nats_url: Option<String>,
    pub data_dir: PathBuf,
    pub stream: String,
    pub subject_prefix: String,
    /// The stream's replicas: 1 on one server, 3 or 5 on a JetStream cluster. An existing
    /// stream must have this many.
    pub stream_replicas: usize,
    /// How to authenticate to NATS and verify it (credentials, nkey, TLS).
    pub nats_auth: NatsAuth,
}

/// How a client proves who it is to NATS and checks the server: the CLI's `--creds`,
/// `--nkey`, `--tls-ca`, `--tls-cert` and `--tls-key`. Secrets are always read from files,
/// never given on the command line, where `ps` would show them. A user and password in
/// the `--nats` URL are honoured as well.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsAuth {
    /// A NATS credentials file (`.creds`: a user JWT and its nkey seed; operator mode).
    pub creds: Option<PathBuf>,
    /// A file holding a user nkey seed (`SU...`), for servers that list nkey users.
    pub nkey: Option<PathBuf>,
    /// The CA that signed the server's certificate; setting it requires TLS.
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate, for servers that verify clients (mutual TLS).
    pub tls_cert: Option<PathBuf>,
    /// The key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
}

/// Why the ledger could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenLedgerError {
    #[error("NATS unreachable at {url}: {reason}; start nats-server there, or drop --nats to run embedded")]
    NatsUnreachable { url: String, reason: String },
    #[error("NATS at {url} refused this client: {reason}; check the credentials (--creds, --nkey, or user:password in the URL) and the TLS files (--tls-ca, --tls-cert, --tls-key); see docs/deploying.md")]
    NatsRefused { url: String, reason: String },
    #[error("--nats {given:?}: {reason}; give nats://host:port, or several separated by commas")]
    BadNatsUrl { given: String, reason: String },
    #[error("{option} {path}: {reason}")]
    BadNatsAuth {
        option: &'static str,
        path: String,
        reason: String,
    },
    #[error(transparent)]
    JetStream(#[from] OpenJetStreamError),
    #[error(transparent)]
    Sled(#[from] OpenSledError),
}

/// One event log, embedded or distributed, with the same semantics.
#[derive(Clone)]
pub enum Ledger {
    Embedded(SledLog),
    JetStream(JetStreamLog),
    /// In memory, for the seeded simulation and fast tests; never a service's ledger.
    Memory(MemLog),
}

/// Parses `--nats`: one URL, or a seed list separated by commas. A malformed one is bad
/// input (exit 2), not an unreachable server.
pub fn parse_nats_urls(given: &str) -> Result<Vec<async_nats::ServerAddr>, OpenLedgerError> {
    let bad = |reason: String| OpenLedgerError::BadNatsUrl {
        given: given.to_string(),
        reason,
    };
    let servers: Vec<async_nats::ServerAddr> = given
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<async_nats::ServerAddr>()
                .map_err(|e| bad(format!("{s:?} is not a NATS URL ({e})")))
        })
        .collect::<Result<_, _>>()?;
    if servers.is_empty() {
        return Err(bad("no URL given".into()));
    }
    Ok(servers)
}

/// `--nats` with any password replaced by `***`: what error messages and logs show.
pub fn redacted_nats_url(given: &str) -> String {
    given
        .split(',')
        .map(|s| match s.trim().parse::<async_nats::ServerAddr>() {
            Ok(addr) if addr.password().is_some() => {
                let mut url = addr.into_inner();
                let _ = url.set_password(Some("***"));
                url.to_string()
            }
            _ => s.trim().to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Connects to NATS (one URL or a seed list) under a client `name`, authenticated as
/// `auth` says. A user and password given in a URL are used to authenticate (async-nats
/// does not take them from the URL). A file that cannot be read or parsed is bad input,
/// told before any connection is tried.
pub async fn connect_nats(
    given: &str,
    name: &str,
    auth: &NatsAuth,
) -> Result<async_nats::Client, OpenLedgerError> {
    let servers = parse_nats_urls(given)?;
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5));
    if let Some(addr) = servers.iter().find(|a| a.has_user_pass()) {
        options = options.user_and_password(
            addr.username().unwrap_or_default().to_string(),
            addr.password().unwrap_or_default().to_string(),
        );
    }
    options = auth.apply(options).await?;
    options = options.event_callback(|event| async move {
        match event {
            async_nats::Event::ServerError(e) => {
                let text = e.to_string();
                if crate::denials::record(&text) {
                    tracing::error!(error = %text, "NATS refused this user: see the permissions in deploy/nats/accounts.conf");
                } else {
                    tracing::warn!(error = %text, "NATS server error");
                }
            }
            other => tracing::debug!(event = %other, "NATS connection"),
        }
    });
    options.connect(servers).await.map_err(|e| {
        use async_nats::ConnectErrorKind as Kind;
        let url = redacted_nats_url(given);
        let reason = e.to_string();
        // A TLS alert from the server (no or a wrong client certificate) arrives as IO.
        let refused = matches!(
            e.kind(),
            Kind::AuthorizationViolation | Kind::Authentication | Kind::Tls
        ) || reason.contains("alert")
            || reason.contains("certificate");
        match refused {
            true => OpenLedgerError::NatsRefused { url, reason },
            false => OpenLedgerError::NatsUnreachable { url, reason },
        }
    })
}

impl NatsAuth {
    /// Adds these credentials and TLS settings to `options`, reading and checking each file.
    pub async fn apply(
        &self,
        mut options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, OpenLedgerError> {
        let bad = |option: &'static str, path: &std::path::Path, reason: String| {
            OpenLedgerError::BadNatsAuth {
                option,
                path: path.display().to_string(),
                reason,
            }
        };
        if self.creds.is_some() && self.nkey.is_some() {
            return Err(OpenLedgerError::BadNatsAuth {
                option: "--creds",
                path: "and --nkey".into(),
                reason: "give one of them: a creds file already holds its nkey seed".into(),
            });
        }
        if let Some(path) = &self.creds {
            options = options
                .credentials_file(path)
                .await
                .map_err(|e| bad("--creds", path, format!("not a NATS credentials file: {e}")))?;
        }
        if let Some(path) = &self.nkey {
            let seed = std::fs::read_to_string(path)
                .map_err(|e| bad("--nkey", path, format!("cannot read: {e}")))?;
            // The seed is the file's one non-comment line; `nk -gen user` writes it alone.
            let seed = seed
                .lines()
                .map(str::trim)
                .find(|l| l.starts_with("SU"))
                .ok_or_else(|| {
                    bad(
                        "--nkey",
                        path,
                        "holds no user nkey seed (a line starting SU)".into(),
                    )
                })?;
            options = options.nkey(seed.to_string());
        }
        for (option, file) in [
            ("--tls-ca", &self.tls_ca),
            ("--tls-cert", &self.tls_cert),
            ("--tls-key", &self.tls_key),
        ] {
            if let Some(path) = file {
                std::fs::metadata(path)
                    .map_err(|e| bad(option, path, format!("cannot read: {e}")))?;
            }
        }
        if let Some(ca) = &self.tls_ca {
            options = options.require_tls(true).add_root_certificates(ca.clone());
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                options = options
                    .require_tls(true)
                    .add_client_certificate(cert.clone(), key.clone());
            }
            (Some(cert), None) => {
                return Err(bad(
                    "--tls-cert",
                    cert,
                    "needs --tls-key, the certificate's key".into(),
                ))
            }
            (None, Some(key)) => {
                return Err(bad(
                    "--tls-key",
                    key,
                    "needs --tls-cert, the key's certificate".into(),
                ))
            }
            (None, None) => {}
        }
        Ok(options)
    }
}

/// Connects to NATS under a client `name` and opens (ensuring and verifying) the stream:
/// the one way both the client library and `serve` reach JetStream.
pub async fn open_jetstream(
    url: &str,
    name: &str,
    stream: &str,
    subject_prefix: &str,
    stream_replicas: usize,
    auth: &NatsAuth,
) -> Result<(async_nats::Client, JetStreamLog), OpenLedgerError> {
    let stream = StreamAt {
        stream,
        subject_prefix,
        stream_replicas,
    };
    open_jetstream_with(url, name, stream, auth, MissingStream::Create).await
}

/// The stream a log lives in.
struct StreamAt<'a> {
    stream: &'a str,
    subject_prefix: &'a str,
    stream_replicas: usize,
}

async fn open_jetstream_with(
    url: &str,
    name: &str,
    StreamAt {
        stream,
        subject_prefix,
        stream_replicas,
    }: StreamAt<'_>,
    auth: &NatsAuth,
    missing: MissingStream,
) -> Result<(async_nats::Client, JetStreamLog), OpenLedgerError> {
    let client = connect_nats(url, name, auth).await?;
    let config = JetStreamConfig {
        stream: stream.to_string(),
        subject_prefix: subject_prefix.to_string(),
        replicas: stream_replicas.max(1),
        ..Default::default()
    };
    let log = JetStreamLog::open_with(client.clone(), config, missing).await?;
    Ok((client, log))
}

impl Ledger {
    /// Opens the ledger to write: a missing data dir or stream is created.
    pub async fn open(options: &LedgerOptions) -> Result<Ledger, OpenLedgerError> {
        Self::open_with(options, MissingStream::Create).await
    }

    /// Opens an existing ledger to read: a missing data dir or stream is an error naming
    /// what was looked for, and nothing is created (a mistyped `--stream` or `--data-dir`
    /// would otherwise leave a permanent stream or a stray directory behind).
    pub async fn open_existing(options: &LedgerOptions) -> Result<Ledger, OpenLedgerError> {
        Self::open_with(options, MissingStream::Refuse).await
    }

    async fn open_with(
        options: &LedgerOptions,
        missing: MissingStream,
    ) -> Result<Ledger, OpenLedgerError> {
        match (&options.nats_url, missing) {
            (None, MissingStream::Create) => {
                Ok(Ledger::Embedded(SledLog::open(&options.data_dir)?))
            }
            (None, MissingStream::Refuse) => {
                Ok(Ledger::Embedded(SledLog::open_existing(&options.data_dir)?))
            }
            (Some(url), _) => {
                let stream = StreamAt {
                    stream: &options.stream,
                    subject_prefix: &options.subject_prefix,
                    stream_replicas: options.stream_replicas,
                };
                let (_, log) =
                    open_jetstream_with(url, "provledger", stream, &options.nats_auth, missing)
                        .await?;
                Ok(Ledger::JetStream(log))
            }
        }
    }

    /// Flushes and releases what the ledger holds (the data-dir lock when embedded).
    pub fn close(self) {
        if let Ledger::Embedded(log) = self {
            log.close();
        }
    }
}

impl EventLog for Ledger {
    async fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> Result<AppendOutcome, AppendError> {
        match self {
            Ledger::Embedded(l) => l.append(aggregate, expect, draft).await,
            Ledger::JetStream(l) => l.append(aggregate, expect, draft).await,
            Ledger::Memory(l) => l.append(aggregate, expect, draft).await,
        }
    }

    async fn append_atomic(
        &self,
        items: Vec<provledger_events::AtomicItem>,
    ) -> Result<Vec<AppendOutcome>, AppendError> {
        match self {
            Ledger::Embedded(l) => l.append_atomic(items).await,
            Ledger::JetStream(l) => l.append_atomic(items).await,
            Ledger::Memory(l) => l.append_atomic(items).await,
        }
    }

    async fn read_aggregate(&self, aggregate: AggregateId) -> Result<Vec<Commit>, ReadError> {
        match self {
            Ledger::Embedded(l) => l.read_aggregate(aggregate).await,
            Ledger::JetStream(l) => l.read_aggregate(aggregate).await,
            Ledger::Memory(l) => l.read_aggregate(aggregate).await,
        }
    }

    async fn aggregate_history(
        &self,
        aggregate: AggregateId,
    ) -> Result<Vec<HistoryEntry>, ReadError> {
        match self {
            Ledger::Embedded(l) => l.aggregate_history(aggregate).await,
            Ledger::JetStream(l) => l.aggregate_history(aggregate).await,
            Ledger::Memory(l) => l.aggregate_history(aggregate).await,
        }
    }

    async fn read_aggregate_after(
        &self,
        aggregate: AggregateId,
        after: ChainTip,
    ) -> Result<Vec<Commit>, ReadError> {
        match self {
            Ledger::Embedded(l) => l.read_aggregate_after(aggregate, after).await,
            Ledger::JetStream(l) => l.read_aggregate_after(aggregate, after).await,
            Ledger::Memory(l) => l.read_aggregate_after(aggregate, after).await,
        }
    }

    async fn find_commit(
        &self,
        aggregate: AggregateId,
        commit_id: uuid::Uuid,
    ) -> Result<Option<Commit>, ReadError> {
        match self {
            Ledger::Embedded(l) => l.find_commit(aggregate, commit_id).await,
            Ledger::JetStream(l) => l.find_commit(aggregate, commit_id).await,
            Ledger::Memory(l) => l.find_commit(aggregate, commit_id).await,
        }
    }

    async fn read_position(&self, position: u64) -> Result<Option<Commit>, ReadError> {
        match self {
            Ledger::Embedded(l) => l.read_position(position).await,
            Ledger::JetStream(l) => l.read_position(position).await,
            Ledger::Memory(l) => l.read_position(position).await,
        }
    }

    async fn tip_is_current(
        &self,
        aggregate: AggregateId,
        tip: ChainTip,
    ) -> Result<bool, ReadError> {
        match self {
            Ledger::Embedded(l) => l.tip_is_current(aggregate, tip).await,
            Ledger::JetStream(l) => l.tip_is_current(aggregate, tip).await,
            Ledger::Memory(l) => l.tip_is_current(aggregate, tip).await,
        }
    }

    fn note_head(&self, aggregate: AggregateId, tip: ChainTip) {
        match self {
            Ledger::Embedded(l) => l.note_head(aggregate, tip),
            Ledger::JetStream(l) => l.note_head(aggregate, tip),
            Ledger::Memory(l) => l.note_head(aggregate, tip),
        }
    }

    fn holds_head(&self, aggregate: AggregateId, tip: ChainTip) -> bool {
        match self {
            Ledger::Embedded(l) => l.holds_head(aggregate, tip),
            Ledger::JetStream(l) => l.holds_head(aggregate, tip),
            Ledger::Memory(l) => l.holds_head(aggregate, tip),
        }
    }

    fn recognises_retry_on_append(&self, commit_id: &uuid::Uuid) -> bool {
        match self {
            Ledger::Embedded(l) => l.recognises_retry_on_append(commit_id),
            Ledger::JetStream(l) => l.recognises_retry_on_append(commit_id),
            Ledger::Memory(l) => l.recognises_retry_on_append(commit_id),
        }
    }

    async fn read_all(&self, from: u64) -> Result<CommitStream, ReadError> {
        match self {
            Ledger::Embedded(l) => l.read_all(from).await,
            Ledger::JetStream(l) => l.read_all(from).await,
            Ledger::Memory(l) => l.read_all(from).await,
        }
    }

    async fn subscribe(&self, from: u64) -> Result<CommitStream, ReadError> {
        match self {
            Ledger::Embedded(l) => l.subscribe(from).await,
            Ledger::JetStream(l) => l.subscribe(from).await,
            Ledger::Memory(l) => l.subscribe(from).await,
        }
    }

    async fn last_position(&self) -> Result<u64, ReadError> {
        match self {
            Ledger::Embedded(l) => l.last_position().await,
            Ledger::JetStream(l) => l.last_position().await,
            Ledger::Memory(l) => l.last_position().await,
        }
    }
}

/// A deterministic commit id for a driver or deleter write, so that a retry or a racing
/// replica writing the same fact is recognised as the same commit (UUID v5).
pub fn derived_commit_id(base: uuid::Uuid, what: &str) -> uuid::Uuid {
    uuid::Uuid::new_v5(&base, what.as_bytes())
}
