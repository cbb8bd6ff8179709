//! `provledger serve`: the projection service. It ensures the stream, runs the projector
//! on a JetStream subscription, and answers the contract's queries as the NATS micro
//! service `provledger` (queue group `provledger`, so replicas share the load and
//! `$SRV.PING/INFO/STATS` work). On shutdown it stops taking requests, lets the ones in
//! hand finish, lets the projector finish its batch, flushes sled and returns. Beside the
//! queries it runs the rollback and deletion worker (`rollback`).

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::service::ServiceExt;
use futures::StreamExt;
use provledger_events::{JetStreamLog, SledLog};
use tokio::sync::{watch, Semaphore};

use crate::bootstrap::{BootstrapError, PublishedSnapshot};
use crate::endpoints::caller::Caller;
use crate::endpoints::error::{bounded, ErrorCode, QueryError};
use crate::endpoints::{Answer, Endpoint};
use crate::metrics::Metrics;
use crate::projector::{OnChainViolation, Projector, ProjectorError};
use crate::replica::{
    QueryContext, CHANGES_IN_FLIGHT_MAX, HEALTH_IN_FLIGHT_MAX, REQUESTS_IN_FLIGHT_MAX,
};
use crate::rollback_worker::RollbackWorker;
use crate::scrape::serve_metrics;
use crate::store::{ProjectionStore, StoreError};
use provledger_client::recovery::NatsReissuer;
use provledger_client::{
    open_jetstream, CancelNotices, Ledger, NatsExecutors, OpenLedgerError, RollbackDriver, Stamper,
    Writer,
};
use provledger_projections::recovery::ReissuePolicy;
use provledger_projections::rollback::RetryPolicy;
use tracing::Instrument;

/// The micro service's name and queue group, fixed by the contract.
pub const SERVICE_NAME: &str = "provledger";
pub const QUEUE_GROUP: &str = "provledger";
/// How long shutdown waits for requests in hand.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Room left in a reply for its headers and framing below the server's max payload.
const REPLY_HEADROOM_BYTES: usize = 8 * 1024;

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub nats_url: String,
    pub data_dir: PathBuf,
    pub stream: String,
    pub subject_prefix: String,
    /// The stream's replicas (see `LedgerOptions::stream_replicas`).
    pub stream_replicas: usize,
    /// How to authenticate to NATS (see `LedgerOptions::nats_auth`).
    pub nats_auth: provledger_client::NatsAuth,
    /// Upper bound on a `min_position` wait before answering `stale`.
    pub min_position_wait: Duration,
    pub snapshot_every: u64,
    /// Retry bounds of the compensations this replica drives.
    pub retry: RetryPolicy,
    /// How long one executor request waits for its reply.
    pub executor_reply_wait: Duration,
    /// The stuck-state recovery sweep runs on start and then this often (`None`: never).
    pub recovery_interval: Option<Duration>,
    /// How long a running operation's runner may go without a commit on it before the
    /// recovery sweep fails it (`--runner-lease`; clamped to `RUNNER_LEASE_MS_MIN` ..=
    /// `RUNNER_LEASE_MS_MAX`, default `RUNNER_LEASE_MS_DEFAULT`).
    pub runner_lease: Duration,
    /// The drift sweep runs once caught up and then this often (`None`: never).
    pub drift_interval: Option<Duration>,
    /// Created once this replica has caught up and joined the queue group, removed when it
    /// stops or loses NATS (and written again once NATS is back): a per-replica readiness
    /// probe for compose or Kubernetes.
    pub ready_file: Option<PathBuf>,
    /// Where to answer Prometheus scrapes (`/metrics`) and `/health` over HTTP (`None`: no
    /// HTTP listener).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Where to serve the read-only operator's console (`None`: no console).
    pub http_addr: Option<std::net::SocketAddr>,
    /// This replica audits the whole log on start (once caught up) and then this often,
    /// for the console's health page and the log (`None`: never).
    pub audit_interval: Option<Duration>,
    /// The JetStream object store bucket where this replica publishes each projection
    /// snapshot it takes, and from which it bootstraps when its data dir is new (`None`:
    /// neither).
    pub snapshot_bucket: Option<String>,
    /// This replica keeps a copy of the stream's commits in its data dir
    /// (`crate::log_copy`; default). `false` (`--no-log-copy`): it keeps none, and removes
    /// one it kept before.
    pub log_copy: bool,
    /// Export spans over OTLP/HTTP (`--otlp-endpoint`; `None`: off, the default).
    pub otlp: Option<crate::otlp::OtlpOptions>,
    /// `cmd.append` records the caller's trace in its commits (format 3; default). `false`
    /// (`--no-trace-record`): while a reader older than format 3 still reads the stream
    /// (docs/events.md, "Deploy readers before writers").
    pub record_traces: bool,
}

impl ServeOptions {
    /// A replica of the stream `PROVLEDGER` (prefix `provledger`, one stream replica, no
    /// NATS credentials) with `provledger serve`'s defaults: what a bench or a test starts
    /// from, overriding only the fields it is about.
    pub fn new(nats_url: String, data_dir: PathBuf) -> Self {
        ServeOptions {
            nats_url,
            data_dir,
            stream: "PROVLEDGER".into(),
            subject_prefix: "provledger".into(),
            stream_replicas: 1,
            nats_auth: Default::default(),
            min_position_wait: Duration::from_secs(2),
            snapshot_every: crate::projector::SNAPSHOT_EVERY_POSITIONS_DEFAULT,
            retry: RetryPolicy::default(),
            executor_reply_wait: Duration::from_secs(30),
            recovery_interval: Some(Duration::from_secs(60)),
            runner_lease: Duration::from_millis(
                provledger_projections::recovery::RUNNER_LEASE_MS_DEFAULT as u64,
            ),
            drift_interval: None,
            ready_file: None,
            metrics_addr: None,
            http_addr: None,
            audit_interval: None,
            snapshot_bucket: None,
            log_copy: true,
            otlp: None,
            record_traces: true,
        }
    }
}

/// Why the service could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Open(#[from] OpenLedgerError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Projector(#[from] ProjectorError),
    #[error("cannot start the NATS micro service: {0}")]
    Service(String),
    #[error(transparent)]
    Otlp(#[from] crate::otlp::OtlpError),
    #[error("cannot read the end of the stream to catch up to: {0}")]
    StreamEnd(provledger_events::ReadError),
}

/// A new replica's bootstrap (`--snapshot-bucket`): only a data dir that holds nothing
/// (or an import a crash cut short) is bootstrapped; a snapshot that is missing, cannot be
/// read or is refused leaves it so, and the replica catches up from position 1.
async fn bootstrap_if_new(
    log: &JetStreamLog,
    bucket: &str,
    store: &ProjectionStore,
) -> Result<(), ServeError> {
    if !store.is_fresh()? && !store.import_incomplete()? {
        return Ok(());
    }
    let started = std::time::Instant::now();
    match crate::bootstrap::bootstrap(log, bucket, store).await {
        Ok(done) => tracing::info!(
            bucket,
            position = done.position,
            entities = done.entities,
            keys = done.keys,
            bytes = done.bytes,
            ms = started.elapsed().as_millis() as u64,
            fetch_ms = done.fetch_ms,
            check_ms = done.check_ms,
            verify_ms = done.verify_ms,
            import_ms = done.import_ms,
            "bootstrapped from a published snapshot; following the stream from the next position"
        ),
        Err(BootstrapError::Store(e)) => return Err(e.into()),
        Err(e @ BootstrapError::NoSnapshot { .. }) => {
            tracing::info!(error = %e, "no snapshot to bootstrap from: catching up from position 1")
        }
        Err(e) => {
            tracing::warn!(error = %e, "snapshot not used: catching up from position 1")
        }
    }
    Ok(())
}

/// Opens the data dir for a JetStream-fed store: the lock, the sled database and the
/// store, which must copy this very stream.
/// `keep_copy` false: a copy of the stream kept in the data dir (`crate::log_copy`) is
/// removed first.
pub fn open_service_store(
    data_dir: &std::path::Path,
    stream: &str,
    keep_copy: bool,
) -> Result<(SledLog, ProjectionStore), ServeError> {
    let dir = SledLog::open(data_dir).map_err(OpenLedgerError::from)?;
    // Before the store opens its handle on the copy's tree.
    if !keep_copy && crate::log_copy::remove(dir.db())? {
        tracing::warn!(data_dir = %data_dir.display(), "--no-log-copy: the copy of the stream this data dir kept is removed");
    }
    let store = match ProjectionStore::open(dir.db()) {
        // A service's store is derived from the stream: one of an older format (a new
        // build folds differently) is emptied and caught up again, not refused.
        Err(StoreError::OlderFormat { what }) => {
            tracing::warn!(data_dir = %data_dir.display(), %what, "the projection in the data dir is of an older format: rebuilding it from the stream");
            ProjectionStore::reset(dir.db())?;
            ProjectionStore::open(dir.db())?
        }
        opened => opened?,
    };
    store.claim_source(&format!("jetstream:{stream}"))?;
    // The projection's own tree keeps no copy: serve's copy, if kept, is in a tree of its
    // own, written off the request path (`crate::log_copy`).
    store.keep_no_copy()?;
    Ok((dir, store))
}

/// Runs one replica until `shutdown`: opens its data dir (bootstrapping it when new),
/// starts the projector and the HTTP listeners, catches up, starts the workers and
/// sweeps, joins the queue group, takes requests, then drains in the reverse order.
pub async fn run(
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let metrics = Arc::new(Metrics::new());
    // Checked first: a bad endpoint is a usage error, said before anything is opened.
    let export = options
        .otlp
        .as_ref()
        .map(|o| crate::otlp::Export::start(o, metrics.spans.clone()))
        .transpose()?;
    let spans = export.as_ref().map(|e| e.spans.clone());
    let (client, log) = open_jetstream(
        &options.nats_url,
        "provledger-serve",
        &options.stream,
        &options.subject_prefix,
        options.stream_replicas,
        &options.nats_auth,
    )
    .await?;
    remove_stale_ready_file(options.ready_file.as_deref());
    // Polled from here on, so that a SIGINT/SIGTERM during a bootstrap stops serve (the
    // signal handlers exist once it is first polled) instead of killing it.
    tokio::pin!(shutdown);
    let Some((data_dir, store)) = open_replica_store(&options, &log, shutdown.as_mut()).await?
    else {
        return Ok(());
    };
    // The publisher is stopped with serve, wherever it returns.
    let (projector, _publisher) = new_projector(&options, &log, &store, &metrics)?;
    let (feed_batches, feed) = crate::feed::queue();
    let projector = projector.with_feed(feed_batches);
    let (projector, copier) = with_copier(&options, &log, &data_dir, projector)?;
    let ctx = query_context(&options, &client, &log, store, &projector, metrics, spans);
    let projector = projector.with_folded_versions(ctx.writer.folded_versions());
    let (stop_feed, feed_stop) = watch::channel(false);
    let feed = {
        let ready_ctx = Arc::clone(&ctx);
        tokio::spawn(crate::feed::run(
            client.clone(),
            options.subject_prefix.clone(),
            feed,
            // Ready once it joined the queue group, which names it.
            move || ready_ctx.served_by.get().cloned(),
            ctx.metrics.fold.clone(),
            feed_stop,
        ))
    };
    let listeners = Listeners::start(&options, &ctx).await?;
    let worker = rollback_worker(&options, &client, &ctx, &projector);
    let applied = projector.applied();
    let reissues_news = projector.reissues();
    // A replica joins the queue group only once it has applied everything the stream held
    // when it started: before that it would answer from state that is behind, without
    // saying so. The rollback worker and the recovery sweep wait too. The projector defers
    // its snapshots until then.
    let end = provledger_events::EventLog::last_position(&log)
        .await
        .map_err(ServeError::StreamEnd)?;
    let mut projector = ProjectorThread::spawn(projector.catching_up_to(end), log.clone())?;
    let mut shutdown_asked = false;
    let caught_up = tokio::select! {
        caught_up = catch_up(applied, end) => caught_up,
        _ = &mut shutdown => {
            shutdown_asked = true;
            false
        }
        joined = &mut projector.task => {
            projector.ended = Some(joined);
            false
        }
    };
    if !caught_up {
        return stop_before_ready(projector, copier, data_dir, shutdown_asked).await;
    }
    if let Some(copier) = &copier {
        copier.start();
    }
    let workers = Workers::start(&options, &client, &ctx, worker, reissues_news);
    let _ = ctx.caught_up_to.set(end);
    let (service, mut requests) = join_queue_group(&options, &client, &log, &ctx, end).await?;
    let slots = Arc::new(Semaphore::new(REQUESTS_IN_FLIGHT_MAX));
    let health_slots = Arc::new(Semaphore::new(HEALTH_IN_FLIGHT_MAX));
    let changes_slots = Arc::new(Semaphore::new(CHANGES_IN_FLIGHT_MAX));
    let connection_task = tokio::spawn(watch_connection(
        ctx.clone(),
        options.ready_file.clone(),
        listeners.stopped.clone(),
    ));

    // Requests are taken on one of the runtime's workers, never on the thread that polls
    // `run` (`block_on`'s own thread, in `provledger serve` and in every embedding): there,
    // each request crossed threads twice, from the connection's reader to this loop and
    // from it to the request's task, 39 µs of a 434 µs `cmd.append` at one client.
    let (stop_taking, taking_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut taking = AbortOnDrop(tokio::spawn({
        let (ctx, slots) = (Arc::clone(&ctx), Arc::clone(&slots));
        let (health_slots, changes_slots) = (Arc::clone(&health_slots), Arc::clone(&changes_slots));
        async move {
            take_requests(
                &ctx,
                &mut requests,
                &slots,
                &health_slots,
                &changes_slots,
                taking_stopped,
            )
            .await;
            requests
        }
    }));
    // The projector only returns before shutdown when it failed (an error or a panic):
    // this replica would then answer from a frozen state, so it says so and exits.
    let taken = tokio::select! {
        () = shutdown.as_mut() => None,
        joined = &mut projector.task => {
            let reason = match &joined {
                Ok((_, Err(e))) => e.to_string(),
                Ok((_, Ok(()))) => "it returned without being asked to".to_string(),
                Err(e) => format!("its task ended: {e}"),
            };
            tracing::error!(%reason, "the projector stopped; serve answers unavailable and exits");
            let _ = ctx.projector_failed.set(reason);
            ctx.projector_stopped.notify_waiters();
            projector.ended = Some(joined);
            None
        }
        // The requests ended (the service stopped).
        taken = &mut taking.0 => Some(taken),
    };
    let taken = match taken {
        Some(taken) => taken,
        None => {
            let _ = stop_taking.send(());
            (&mut taking.0).await
        }
    };
    let requests = match taken {
        Ok(requests) => Some(requests),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Cancelled: only by dropping `taking` (still here) or by the runtime's shutdown.
        Err(_) => None,
    };

    tracing::info!("shutting down: draining requests in hand");
    notify_systemd("STOPPING=1");
    listeners.stop(connection_task).await;
    if let Some(path) = &options.ready_file {
        let _ = std::fs::remove_file(path);
    }
    drop(requests);
    drain_requests(service, &slots).await;
    workers.stop().await;
    // The feed only publishes: stopped where it is (its followers catch up by q.changes).
    let _ = stop_feed.send(true);
    feed.abort();
    let closed = close_replica(projector, copier, &ctx, data_dir, &client).await;
    if let Some(export) = export {
        export.stop().await;
    }
    closed
}

/// The copier of the stream into the data dir, fed by `projector` (`--no-log-copy`: none).
fn with_copier(
    options: &ServeOptions,
    log: &JetStreamLog,
    data_dir: &SledLog,
    projector: Projector,
) -> Result<(Projector, Option<crate::log_copy::Copier>), ServeError> {
    // A data dir from before serve stopped copying keeps its copy in the projection's
    // batches (`copies_log`): whole already, it needs no second one.
    if !options.log_copy || projector.store().copies_log()? {
        return Ok((projector, None));
    }
    let copy = crate::log_copy::LogCopy::open(data_dir.db(), 1)?;
    tracing::info!(
        from = copy.extent().from,
        through = copy.extent().through,
        "keeping a copy of the stream in the data dir"
    );
    let (batches, received) = crate::log_copy::queue();
    let projector = projector.with_copy(batches);
    let copier = crate::log_copy::Copier::spawn(copy, log.clone(), received, projector.applied())
        .map_err(|e| ServeError::Service(format!("the copier's thread: {e}")))?;
    Ok((projector, Some(copier)))
}

/// Stops the copier after the projector: it copies through what the projector applied.
/// Its failure is logged, never serve's: the copy is a second copy of the stream.
async fn stop_copier(copier: Option<crate::log_copy::Copier>) {
    if let Some(copier) = copier {
        if let Err(e) = copier.stop().await {
            tracing::error!(error = %e, "the copy of the stream did not catch up before the stop");
        }
    }
}

/// The projector over `store`, with its snapshot publisher when there is a bucket.
fn new_projector(
    options: &ServeOptions,
    log: &JetStreamLog,
    store: &ProjectionStore,
    metrics: &Metrics,
) -> Result<(Projector, Option<AbortOnDrop>), ServeError> {
    let projector = Projector::new(store.clone(), options.snapshot_every)?
        .on_chain_violation(OnChainViolation::Quarantine)
        .with_metrics(metrics.fold.clone());
    let (projector, publisher) = match &options.snapshot_bucket {
        Some(bucket) => {
            let (projector, publisher) =
                with_snapshot_publisher(projector, log, bucket, &options.stream);
            (projector, Some(publisher))
        }
        None => (projector, None),
    };
    tracing::info!(
        checkpoint = projector.checkpoint(),
        stream = %options.stream,
        server = log.server_version(),
        "provledger serve starting"
    );
    Ok((projector, publisher))
}

/// Stops the projector, flushes what it applied and closes the data dir; an error when
/// the projector had failed while serving.
async fn close_replica(
    projector: ProjectorThread,
    copier: Option<crate::log_copy::Copier>,
    ctx: &QueryContext,
    data_dir: SledLog,
    client: &async_nats::Client,
) -> Result<(), ServeError> {
    let (projector, result) = projector.stop().await?;
    stop_copier(copier).await;
    if result.is_ok() {
        if let Some(reason) = ctx.projector_failed.get() {
            data_dir.close();
            return Err(ServeError::Service(format!(
                "the projector stopped: {reason}"
            )));
        }
    }
    projector.store().flush()?;
    let _ = client.flush().await;
    tracing::info!(
        checkpoint = projector.checkpoint(),
        "provledger serve stopped"
    );
    data_dir.close();
    result.map_err(ServeError::from)
}

/// Stopped before it was ready: nothing was served, nothing to drain. Unless a shutdown
/// was asked for, the projector ended on its own: a failure.
async fn stop_before_ready(
    projector: ProjectorThread,
    copier: Option<crate::log_copy::Copier>,
    data_dir: SledLog,
    shutdown_asked: bool,
) -> Result<(), ServeError> {
    let (projector, result) = projector.stop().await?;
    stop_copier(copier).await;
    result?;
    projector.store().flush()?;
    data_dir.close();
    match shutdown_asked {
        true => Ok(()),
        false => Err(ServeError::Service(
            "the projector stopped before catching up with the stream".into(),
        )),
    }
}

/// A ready file left by a replica that was killed would say "ready" while this one
/// catches up: it goes before anything else.
fn remove_stale_ready_file(path: Option<&std::path::Path>) {
    let Some(path) = path else { return };
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed a stale ready file"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(error = %e, path = %path.display(), "cannot remove the ready file")
        }
    }
}

/// The data dir and its store, bootstrapped from the snapshot bucket when new; `None`
/// when `shutdown` came during the bootstrap.
async fn open_replica_store(
    options: &ServeOptions,
    log: &JetStreamLog,
    shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<Option<(SledLog, ProjectionStore)>, ServeError> {
    let (data_dir, store) =
        open_service_store(&options.data_dir, &options.stream, options.log_copy)?;
    if let Some(bucket) = &options.snapshot_bucket {
        tokio::select! {
            bootstrapped = bootstrap_if_new(log, bucket, &store) => bootstrapped?,
            _ = shutdown => {
                // An import in hand is left marked unfinished: the next start abandons it.
                tracing::info!("provledger serve stopped during its bootstrap");
                return Ok(None);
            }
        }
    }
    // What an import a crash cut short left (a bootstrap abandons its own refusals) is
    // never folded upon, with the bucket or without: the catch-up from position 1 starts
    // on a fresh store.
    if store.import_incomplete()? {
        tracing::warn!("abandoning an import a crash cut short: catching up from position 1");
        store.abandon_import()?;
    }
    Ok(Some((data_dir, store)))
}

/// Publishes each snapshot the projector takes to `bucket`, on a task stopped when the
/// task is dropped (a snapshot half published is replaced by the next; the bucket's
/// previous one stays whole until then).
fn with_snapshot_publisher(
    projector: Projector,
    log: &JetStreamLog,
    bucket: &str,
    stream: &str,
) -> (Projector, AbortOnDrop) {
    // Room for one: a snapshot taken while the previous one is still being published is
    // not prepared at all.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<PublishedSnapshot>(1);
    let projector = projector.with_publisher(tx, stream);
    let (js, bucket) = (log.context().clone(), bucket.to_string());
    let task = AbortOnDrop(tokio::spawn(async move {
        while let Some(snapshot) = rx.recv().await {
            let started = std::time::Instant::now();
            match crate::bootstrap::publish(&js, &bucket, &snapshot).await {
                Ok(()) => tracing::info!(
                    bucket = %bucket,
                    position = snapshot.header.position,
                    entities = snapshot.header.entities,
                    bytes = snapshot.len(),
                    ms = started.elapsed().as_millis() as u64,
                    "projection snapshot published"
                ),
                Err(e) => {
                    tracing::warn!(bucket = %bucket, error = %e, "cannot publish a projection snapshot")
                }
            }
        }
    }));
    (projector, task)
}

/// The replica's shared state, as the endpoints, the console, metrics and the sweeps read it.
fn query_context(
    options: &ServeOptions,
    client: &async_nats::Client,
    log: &JetStreamLog,
    store: ProjectionStore,
    projector: &Projector,
    metrics: Arc<Metrics>,
    spans: Option<crate::otlp::Spans>,
) -> Arc<QueryContext> {
    Arc::new(QueryContext {
        store,
        applied: projector.applied(),
        log: log.clone(),
        writer: Writer::new(Ledger::JetStream(log.clone())),
        stream: options.stream.clone(),
        served_by: std::sync::OnceLock::new(),
        min_position_wait: options.min_position_wait,
        projector_failed: std::sync::OnceLock::new(),
        projector_stopped: tokio::sync::Notify::new(),
        caught_up_to: std::sync::OnceLock::new(),
        // What a reply may carry: the server's max payload, less room for headers.
        reply_bytes_max: client
            .server_info()
            .max_payload
            .saturating_sub(REPLY_HEADROOM_BYTES),
        min_position_waits: Default::default(),
        workers_ready: Default::default(),
        metrics,
        client: client.clone(),
        drift: crate::replica::DriftSweeps::new(options.drift_interval),
        audits: crate::replica::LastAudits::new(options.audit_interval),
        spans,
        record_traces: options.record_traces,
    })
}

/// The HTTP listeners (metrics with health, and the console), stopped together.
struct Listeners {
    stop: watch::Sender<bool>,
    stopped: watch::Receiver<bool>,
    metrics: Option<tokio::task::JoinHandle<()>>,
    console: Option<tokio::task::JoinHandle<()>>,
}

impl Listeners {
    async fn start(options: &ServeOptions, ctx: &Arc<QueryContext>) -> Result<Self, ServeError> {
        let (stop, stopped) = watch::channel(false);
        let metrics = match options.metrics_addr {
            Some(addr) => {
                let mut stopped = stopped.clone();
                let task = serve_metrics(addr, ctx.clone(), async move {
                    let _ = stopped.changed().await;
                })
                .await
                .map_err(|e| ServeError::Service(format!("--metrics-addr {addr}: {e}")))?;
                Some(task)
            }
            None => None,
        };
        let console = match options.http_addr {
            Some(addr) => Some(
                crate::console::serve_console(addr, ctx.clone(), stopped.clone())
                    .await
                    .map_err(|e| ServeError::Service(format!("--http {addr}: {e}")))?,
            ),
            None => None,
        };
        Ok(Listeners {
            stop,
            stopped,
            metrics,
            console,
        })
    }

    /// Stops the listeners and the connection watch that shares their signal.
    async fn stop(self, connection_task: tokio::task::JoinHandle<()>) {
        let _ = self.stop.send(true);
        let _ = connection_task.await;
        if let Some(task) = self.metrics {
            let _ = task.await;
        }
        // A console connection that never finishes its request must not hold serve's exit.
        if let Some(mut task) = self.console {
            if tokio::time::timeout(DRAIN_TIMEOUT, &mut task)
                .await
                .is_err()
            {
                tracing::warn!(
                    "console connections still open after the drain timeout; closing them"
                );
                task.abort();
            }
        }
    }
}

/// The rollback and deletion worker, driving compensations at the executors over NATS.
fn rollback_worker(
    options: &ServeOptions,
    client: &async_nats::Client,
    ctx: &QueryContext,
    projector: &Projector,
) -> RollbackWorker {
    let ledger = ctx.writer.clone();
    let nats = NatsExecutors {
        client: client.clone(),
        subject_prefix: options.subject_prefix.clone(),
        reply_wait: options.executor_reply_wait,
    };
    let executors: Arc<dyn provledger_client::CompensationExecutor> = match &ctx.spans {
        Some(spans) => Arc::new(crate::otlp::TracedExecutors {
            inner: nats,
            spans: spans.clone(),
        }),
        None => Arc::new(nats),
    };
    RollbackWorker {
        store: ctx.store.clone(),
        ledger: ledger.clone(),
        driver: Arc::new(RollbackDriver::new(
            ledger,
            executors,
            options.retry,
            "provledger-serve",
        )),
        notices: CancelNotices::nats(client.clone(), &options.subject_prefix),
        applied: projector.applied(),
        touched: projector.touched(),
        stamper: Stamper::system(),
    }
}

/// What runs beside the requests once caught up: the rollback worker, the recovery
/// round, the drift sweep and the audit.
struct Workers {
    stop: watch::Sender<bool>,
    worker: tokio::task::JoinHandle<()>,
    recovery: Option<tokio::task::JoinHandle<()>>,
    drift: tokio::task::JoinHandle<()>,
    audit: Option<tokio::task::JoinHandle<()>>,
}

impl Workers {
    fn start(
        options: &ServeOptions,
        client: &async_nats::Client,
        ctx: &Arc<QueryContext>,
        worker: RollbackWorker,
        reissues_news: Arc<tokio::sync::Notify>,
    ) -> Self {
        let (stop, shutdown) = watch::channel(false);
        let recovery = options.recovery_interval.map(|interval| {
            let nats = NatsReissuer {
                client: client.clone(),
                subject_prefix: options.subject_prefix.clone(),
                reply_wait: options.executor_reply_wait,
            };
            let reissuer: Arc<dyn provledger_client::recovery::Reissuer> = match &ctx.spans {
                Some(spans) => Arc::new(crate::otlp::TracedReissuer {
                    inner: nats,
                    spans: spans.clone(),
                }),
                None => Arc::new(nats),
            };
            let policy = ReissuePolicy::new(
                i64::try_from(options.executor_reply_wait.as_millis()).unwrap_or(i64::MAX),
            );
            ctx.workers_ready.enable();
            tokio::spawn(crate::recovery_loop::run(
                ctx.clone(),
                interval,
                reissuer,
                policy,
                options.runner_lease,
                reissues_news,
                shutdown.clone(),
            ))
        });
        let drift = tokio::spawn(crate::drift_sweep::run(
            ctx.clone(),
            options.subject_prefix.clone(),
            options.executor_reply_wait,
            shutdown.clone(),
        ));
        let audit = options.audit_interval.map(|interval| {
            tokio::spawn(crate::audit::audit_sweeps(
                ctx.clone(),
                interval,
                shutdown.clone(),
            ))
        });
        let worker = tokio::spawn(worker.run(shutdown));
        Workers {
            stop,
            worker,
            recovery,
            drift,
            audit,
        }
    }

    /// Lets the writers finish what they hold; stops the readers where they are.
    async fn stop(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.worker.await {
            tracing::warn!(error = %e, "rollback worker task");
        }
        if let Some(task) = self.recovery {
            if let Err(e) = task.await {
                tracing::warn!(error = %e, "recovery sweep task");
            }
        }
        // The drift sweep writes nothing: stopped where it is, even mid-inventory.
        self.drift.abort();
        // So does the audit: it only reads.
        if let Some(task) = self.audit {
            task.abort();
        }
    }
}

/// The queue group's requests, one stream over every endpoint.
type Requests = futures::stream::SelectAll<
    futures::stream::BoxStream<'static, (Endpoint, async_nats::service::Request)>,
>;

/// Starts the micro service, adds every endpoint, and announces the replica ready.
async fn join_queue_group(
    options: &ServeOptions,
    client: &async_nats::Client,
    log: &JetStreamLog,
    ctx: &QueryContext,
    end: u64,
) -> Result<(async_nats::service::Service, Requests), ServeError> {
    let service = client
        .service_builder()
        .description("provledger projection queries and cmd.append")
        .queue_group(QUEUE_GROUP)
        .metadata(service_metadata(options, log, end))
        .start(SERVICE_NAME, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| ServeError::Service(e.to_string()))?;
    // The replica's id is the micro service's (async-nats mints it at start and has no
    // setter), so `served_by` in replies names the same replica `$SRV.PING/INFO/STATS` do.
    let served_by = service.info().await.id;
    let _ = ctx.served_by.set(served_by.clone());
    let mut endpoints = Vec::new();
    for endpoint in Endpoint::ALL {
        let subject = format!("{}.{}", options.subject_prefix, endpoint.suffix());
        let stream = service
            .endpoint_builder()
            .name(endpoint.name())
            .add(subject)
            .await
            .map_err(|e| ServeError::Service(e.to_string()))?;
        endpoints.push(stream.map(move |request| (endpoint, request)).boxed());
    }
    tracing::info!(%served_by, caught_up_to = end, "provledger serve ready: caught up, in the queue group");
    notify_systemd("READY=1\nSTATUS=caught up; answering queries");
    write_ready_file(options.ready_file.as_deref(), &served_by);
    Ok((service, futures::stream::select_all(endpoints)))
}

/// Leaves the queue group and waits (bounded) for the requests in hand.
async fn drain_requests(service: async_nats::service::Service, slots: &Semaphore) {
    if let Err(e) = service.stop().await {
        tracing::warn!(error = %e, "stopping the micro service");
    }
    let all = u32::try_from(REQUESTS_IN_FLIGHT_MAX).unwrap_or(u32::MAX);
    if tokio::time::timeout(DRAIN_TIMEOUT, slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!("requests still in hand after the drain timeout");
    }
}

/// A task stopped when this is dropped.
struct AbortOnDrop<T = ()>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The projector handed back when its thread ends, with why it ended.
type ProjectorEnded = (Projector, Result<(), ProjectorError>);

/// Takes requests, each on a task of its own within its slots, until `stop` says so (or its
/// sender is dropped: `run` is gone) or the requests end.
async fn take_requests(
    ctx: &Arc<QueryContext>,
    requests: &mut (impl futures::Stream<Item = (Endpoint, async_nats::service::Request)> + Unpin),
    slots: &Arc<Semaphore>,
    health_slots: &Arc<Semaphore>,
    changes_slots: &Arc<Semaphore>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    loop {
        let next = tokio::select! {
            next = requests.next() => next,
            _ = &mut stop => return,
        };
        // The requests ended (the service stopped).
        let Some((endpoint, request)) = next else {
            return;
        };
        // Health has slots of its own: a replica whose request slots are all taken by
        // slow requests still says how it is, at once.
        // And so have followers' catch-ups: however many, they never take the others'.
        let slots = match endpoint {
            Endpoint::Health => health_slots,
            Endpoint::Changes => changes_slots,
            _ => slots,
        };
        // Never wait for a slot here: this loop also takes health checks and the
        // shutdown; a replica with every slot taken answers `unavailable` at once.
        let permit = match Arc::clone(slots).try_acquire_owned() {
            Ok(permit) => permit,
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                ctx.metrics.answered(
                    endpoint.suffix(),
                    Duration::ZERO,
                    Some(("unavailable", Some("busy"))),
                    None,
                );
                tokio::spawn(respond_busy(
                    endpoint,
                    request,
                    ctx.served_by.get().cloned(),
                ));
                continue;
            }
            Err(tokio::sync::TryAcquireError::Closed) => return,
        };
        let ctx = Arc::clone(ctx);
        // Boxed: the request's future is moved as a pointer, not as its 4.5 KB.
        tokio::spawn(Box::pin(async move {
            respond(&ctx, endpoint, request).await;
            drop(permit);
        }));
    }
}

/// The projector on a thread of its own, with a single-threaded runtime: its sled
/// batches block that thread only, never one of the runtime's workers that answer
/// requests. (Blocking in place on a worker hands the worker's queue to another thread on
/// every batch: at live rates, thousands of hand-offs a second.)
struct ProjectorThread {
    stop: watch::Sender<bool>,
    /// Yields the projector back when it stops.
    task: tokio::sync::oneshot::Receiver<ProjectorEnded>,
    /// How it ended, when it ended before it was asked to stop (a failure).
    ended: Option<Result<ProjectorEnded, tokio::sync::oneshot::error::RecvError>>,
}

impl ProjectorThread {
    fn spawn(mut projector: Projector, log: JetStreamLog) -> Result<Self, ServeError> {
        let (stop, shutdown) = watch::channel(false);
        let (done, task) = tokio::sync::oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ServeError::Service(format!("the projector's runtime: {e}")))?;
        std::thread::Builder::new()
            .name("projector".into())
            .spawn(move || {
                let result = runtime.block_on(projector.run(&log, shutdown));
                // The receiver is dropped only when serve itself is gone: nobody to tell.
                let _ = done.send((projector, result));
            })
            .map_err(|e| ServeError::Service(format!("the projector's thread: {e}")))?;
        Ok(ProjectorThread {
            stop,
            task,
            ended: None,
        })
    }

    /// Asks the projector to stop (it finishes its batch) and takes it back.
    async fn stop(self) -> Result<ProjectorEnded, ServeError> {
        let _ = self.stop.send(true);
        let joined = match self.ended {
            Some(joined) => joined,
            None => self.task.await,
        };
        joined.map_err(|e| ServeError::Service(format!("projector task: {e}")))
    }
}

/// Waits until the projector has applied `end`, logging progress every few seconds; true
/// once it has (false only if the projector's channel closed).
async fn catch_up(mut applied: watch::Receiver<u64>, end: u64) -> bool {
    const PROGRESS_EVERY: Duration = Duration::from_secs(2);
    let start = *applied.borrow();
    if start >= end {
        return true;
    }
    tracing::info!(
        from = start,
        to = end,
        "catching up before joining the queue group"
    );
    loop {
        let waited = tokio::time::timeout(PROGRESS_EVERY, applied.wait_for(|p| *p >= end))
            .await
            .map(|r| r.is_ok());
        match waited {
            Ok(true) => return true,
            Ok(false) => return false,
            Err(_) => {
                let at = *applied.borrow();
                tracing::info!(position = at, to = end, "catching up");
                notify_systemd(&format!("STATUS=catching up: position {at} of {end}"));
            }
        }
    }
}

/// Tells systemd (a `Type=notify` unit) about readiness and progress; nothing happens
/// outside systemd. Best effort: a lost notification only delays what systemd reports.
fn notify_systemd(state: &str) {
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    let address = match path.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name.as_bytes())
        }
        None => SocketAddr::from_pathname(&path),
    };
    let sent = address.and_then(|address| {
        let socket = UnixDatagram::unbound()?;
        socket.send_to_addr(state.as_bytes(), &address)
    });
    if let Err(e) = sent {
        tracing::debug!(error = %e, "cannot notify systemd");
    }
}

/// A refusal as a reply: the contract's body (with `served_by`, the replica's id, as every
/// reply) and the micro-service error headers, both bounded (a message may echo a huge
/// request).
fn refusal(e: &QueryError, served_by: Option<&str>) -> (async_nats::HeaderMap, Vec<u8>) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        async_nats::service::NATS_SERVICE_ERROR,
        format!("{}: {}", e.code.as_str(), bounded(&e.message)).as_str(),
    );
    headers.insert(
        async_nats::service::NATS_SERVICE_ERROR_CODE,
        e.code.numeric().to_string().as_str(),
    );
    let mut body = e.body();
    if let (Some(object), Some(id)) = (body.as_object_mut(), served_by) {
        object.insert("served_by".into(), id.into());
    }
    (
        headers,
        serde_json::to_vec(&body).expect(
            "an error reply: plain serde data (string keys, no fallible impls) encodes as JSON",
        ),
    )
}

/// The answer of a replica whose request slots are all taken.
async fn respond_busy(
    endpoint: Endpoint,
    request: async_nats::service::Request,
    served_by: Option<String>,
) {
    let message = match endpoint {
        Endpoint::Changes => format!(
            "this replica has {CHANGES_IN_FLIGHT_MAX} catch-ups in hand (CHANGES_IN_FLIGHT_MAX); retry, or ask another replica"
        ),
        Endpoint::Health => format!(
            "this replica has {HEALTH_IN_FLIGHT_MAX} health checks in hand (HEALTH_IN_FLIGHT_MAX); retry"
        ),
        _ => format!(
            "this replica has {REQUESTS_IN_FLIGHT_MAX} requests in hand (REQUESTS_IN_FLIGHT_MAX); retry, or ask another replica"
        ),
    };
    let (headers, bytes) = refusal(
        &QueryError::new(ErrorCode::Unavailable, message),
        served_by.as_deref(),
    );
    send_reply(endpoint, request, headers, bytes).await;
}

async fn send_reply(
    endpoint: Endpoint,
    request: async_nats::service::Request,
    headers: async_nats::HeaderMap,
    bytes: Vec<u8>,
) {
    if let Err(e) = request
        .respond_with_headers(Ok(bytes.into()), headers)
        .await
    {
        tracing::warn!(error = %e, endpoint = endpoint.suffix(), "cannot send a reply");
    }
}

/// What `$SRV.INFO` says about this replica besides its id: the provledger version, the
/// stream and subjects it serves, where it keeps its copy, and what it had caught up to
/// when it joined the queue group.
fn service_metadata(
    options: &ServeOptions,
    log: &JetStreamLog,
    caught_up_to: u64,
) -> std::collections::HashMap<String, String> {
    [
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("stream", options.stream.clone()),
        ("subject_prefix", options.subject_prefix.clone()),
        ("data_dir", options.data_dir.display().to_string()),
        ("nats_server_version", log.server_version().to_string()),
        ("caught_up_to", caught_up_to.to_string()),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_string(), value))
    .collect()
}

async fn respond(ctx: &QueryContext, endpoint: Endpoint, request: async_nats::service::Request) {
    // A caller's W3C trace goes on the span of its request: every line logged while it is
    // handled (the append's decisions, its commits) carries the caller's trace id.
    let trace = crate::trace::of(request.message.headers.as_ref());
    let span = tracing::info_span!(
        "request",
        endpoint = endpoint.suffix(),
        trace_id = tracing::field::Empty,
        parent_span_id = tracing::field::Empty,
    );
    if let Some(t) = &trace {
        span.record("trace_id", t.trace_id_hex().as_str());
        span.record("parent_span_id", t.span_id_hex().as_str());
    }
    // With span export on, a cmd.append is a span of its own (the caller's child), and
    // its commits record that span; otherwise they record the caller's context as sent.
    let exported = match (&ctx.spans, endpoint) {
        (Some(spans), Endpoint::CmdAppend) => Some(spans.start_span(
            "cmd.append",
            opentelemetry::trace::SpanKind::Server,
            trace,
            vec![opentelemetry::KeyValue::new("messaging.system", "nats")],
        )),
        _ => None,
    };
    let recorded = match &exported {
        Some(span) => span.context(),
        None => trace,
    };
    respond_in_span(ctx, endpoint, request, recorded, exported)
        .instrument(span)
        .await
}

async fn respond_in_span(
    ctx: &QueryContext,
    endpoint: Endpoint,
    request: async_nats::service::Request,
    trace: Option<provledger_events::TraceContext>,
    mut exported: Option<crate::otlp::ActiveSpan>,
) {
    let traced = trace.is_some();
    let started = std::time::Instant::now();
    let recorded = trace.filter(|_| ctx.record_traces);
    let caller = Caller::from_headers(request.message.headers.as_ref()).in_trace(recorded);
    let result = ctx
        .handle(endpoint, &request.message.payload, &caller)
        .await;
    // What the metrics count: the refusal's code and reason, or an append's outcome.
    let outcome: Result<Option<&'static str>, (&'static str, Option<String>)> = match &result {
        Ok(data) => Ok(data.value().and_then(append_outcome)),
        Err(e) => Err((
            e.code.as_str(),
            e.extra
                .get("reason")
                .and_then(|r| r.as_str())
                .map(str::to_string),
        )),
    };
    if traced && endpoint == Endpoint::CmdAppend {
        if let Some(data) = result.as_ref().ok().and_then(Answer::value) {
            // The commits this traced request produced, logged under its trace id.
            let commits = appended_positions(data);
            tracing::info!(commits = %commits, "commits appended");
            if let Some(span) = &mut exported {
                span.set(opentelemetry::KeyValue::new("provledger.commits", commits));
            }
        }
    }
    if let Some(span) = &mut exported {
        match &outcome {
            Ok(word) => span.set(opentelemetry::KeyValue::new(
                "provledger.outcome",
                word.unwrap_or("answered"),
            )),
            Err((code, _)) => {
                span.set(opentelemetry::KeyValue::new("provledger.outcome", *code));
                span.fail(format!("refused: {code}"));
            }
        }
    }
    // The span ends here, once the answer is decided (sending the reply is not in it).
    drop(exported);
    let (headers, bytes) = match result {
        Ok(data) => {
            let body = ReplyBody {
                data: &data,
                position: ctx.position(),
                served_by: ctx.served_by.get(),
            };
            let bytes = serde_json::to_vec(&body).expect(
                "a reply: plain serde data (string keys, no fallible impls) encodes as JSON",
            );
            if bytes.len() <= ctx.reply_bytes_max {
                (async_nats::HeaderMap::new(), bytes)
            } else {
                // Silence would leave the caller waiting for its timeout: say what to do.
                refusal(&QueryError::new(
                    ErrorCode::TooLarge,
                    format!(
                        "the answer is {} bytes, over the {} bytes a reply may carry; ask for less: a smaller `limit` and `after` for lists, `from_version` and `limit` for history, `steps_from`, `compensations_from` and `parts_limit` for an operation, `allocations_after` and `parts_limit` for a provider",
                        bytes.len(),
                        ctx.reply_bytes_max
                    ),
                    ),
                    ctx.served_by.get().map(String::as_str),
                )
            }
        }
        Err(e) => {
            tracing::debug!(endpoint = endpoint.suffix(), code = e.code.as_str(), message = %bounded(&e.message), "request refused");
            refusal(&e, ctx.served_by.get().map(String::as_str))
        }
    };
    send_reply(endpoint, request, headers, bytes).await;
    ctx.metrics.answered(
        endpoint.suffix(),
        started.elapsed(),
        outcome
            .as_ref()
            .err()
            .map(|(code, reason)| (*code, reason.as_deref())),
        outcome.as_ref().ok().copied().flatten(),
    );
}

/// A reply's body: its data, the position the replica had applied, and which replica.
/// Fields in the order a `serde_json::Map` (sorted keys) always wrote them.
#[derive(serde::Serialize)]
struct ReplyBody<'a> {
    data: &'a Answer,
    position: u64,
    served_by: Option<&'a String>,
}

/// `v<version>@<position>` of each commit a `cmd.append` reply names.
fn appended_positions(data: &serde_json::Value) -> String {
    let one = |c: &serde_json::Value| {
        format!(
            "v{}@{}",
            c.get("version").and_then(|v| v.as_u64()).unwrap_or(0),
            c.get("position").and_then(|v| v.as_u64()).unwrap_or(0)
        )
    };
    match data.get("commits").and_then(|c| c.as_array()) {
        Some(commits) => commits.iter().map(one).collect::<Vec<_>>().join(","),
        None => one(data),
    }
}

/// The outcome a `cmd.append` reply names (`appended`, `already_appended`, ...), for the
/// metrics; `None` for other replies.
fn append_outcome(data: &serde_json::Value) -> Option<&'static str> {
    let outcome = data
        .get("outcome")
        .or_else(|| data.get("commits")?.get(0)?.get("outcome"))?
        .as_str()?;
    // Label values come from a closed set, never from a reply's text.
    [
        "appended",
        "already_appended",
        "already_done",
        "done",
        "failed",
    ]
    .into_iter()
    .find(|known| *known == outcome)
    .or(Some("other"))
}

/// The ready file says "ready" only while this replica is: written once it has caught up,
/// removed while NATS is lost and written again when it is back.
fn write_ready_file(path: Option<&std::path::Path>, served_by: &str) {
    if let Some(path) = path {
        if let Err(e) = std::fs::write(path, format!("{served_by}\n")) {
            tracing::warn!(error = %e, path = %path.display(), "cannot write the ready file");
        }
    }
}

/// How often the NATS connection's state is looked at.
const CONNECTION_CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// Follows the NATS connection: when it is lost, this replica is not ready (the ready
/// file goes, `/health` and the metrics say why, a WARN is logged) until it is back.
async fn watch_connection(
    ctx: Arc<QueryContext>,
    ready_file: Option<PathBuf>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut connected = true;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(CONNECTION_CHECK_INTERVAL) => {}
            _ = stopped.changed() => return,
        }
        let now = ctx.nats_connected();
        if now == connected {
            continue;
        }
        connected = now;
        match now {
            false => {
                tracing::warn!("lost the NATS connection: not ready until it is back");
                notify_systemd("STATUS=NATS connection lost; reconnecting");
                if let Some(path) = &ready_file {
                    let _ = std::fs::remove_file(path);
                }
            }
            true => {
                tracing::info!("the NATS connection is back: ready again");
                notify_systemd("STATUS=caught up; answering queries");
                write_ready_file(
                    ready_file.as_deref(),
                    ctx.served_by.get().map_or("", String::as_str),
                );
            }
        }
    }
}
