//! `provledger backup --to DIR` and `provledger restore --from DIR [--verify]`: the stream
//! copied at one position into a directory, and put back, at the same positions, into an
//! empty stream; with `--verify`, read back, compared with the backup's manifest and
//! audited. The work is `provledger_client::backup`'s; this parses, shows progress and
//! prints.

use std::path::Path;
use std::time::Instant;

use provledger_client::backup::{self, BackupError, BackupSummary, RestoreError};
use provledger_client::{connect_nats, Ledger, LedgerOptions, OpenLedgerError};
use provledger_events::backup::Manifest;
use provledger_events::log::OpenSledError;
use provledger_events::log::{JetStreamConfig, RestoreStreamError};
use provledger_events::SledLog;
use provledger_events::Timestamp;
use provledger_projections::audit::AuditReport;
use provledger_serve::copy_backup::{self, CopyBackupError};
use provledger_serve::{audit_log, OnChainViolation};

use super::state::progress_bar;
use super::{print_json, CommandError};

impl From<BackupError> for CommandError {
    fn from(e: BackupError) -> Self {
        match e {
            BackupError::DirNotEmpty { .. } | BackupError::NotADirectory { .. } => {
                CommandError::BadInput(e.to_string())
            }
            BackupError::Io { .. } => CommandError::Infrastructure(e.to_string()),
            BackupError::Read(r) => r.into(),
            BackupError::Fold(_) => CommandError::Problem(e.to_string()),
        }
    }
}

impl From<RestoreError> for CommandError {
    fn from(e: RestoreError) -> Self {
        match e {
            RestoreError::NotABackup { .. } | RestoreError::PrefixMismatch { .. } => {
                CommandError::BadInput(e.to_string())
            }
            RestoreError::Io { .. } => CommandError::Infrastructure(e.to_string()),
            RestoreError::Stream(
                RestoreStreamError::Unavailable { .. } | RestoreStreamError::ServerTooOld { .. },
            ) => CommandError::Infrastructure(e.to_string()),
            RestoreError::Open(o) => OpenLedgerError::JetStream(o).into(),
            RestoreError::Read(r) => r.into(),
            // A backup that does not match its manifest, a stream that is not empty, a
            // restored stream that differs: the command ran and found a problem.
            RestoreError::Refused { .. }
            | RestoreError::Stream(_)
            | RestoreError::RestoredDiffers(_) => CommandError::Problem(e.to_string()),
        }
    }
}

fn needs_nats(options: &LedgerOptions, command: &str) -> Result<String, CommandError> {
    options.nats_url.clone().ok_or_else(|| {
        CommandError::BadInput(format!(
            "{command} needs --nats URL (or PROVLEDGER_NATS_URL): it works on the JetStream stream"
        ))
    })
}

/// `provledger backup --to DIR`.
pub async fn run_backup(
    options: &LedgerOptions,
    to: &Path,
    json: bool,
) -> Result<(), CommandError> {
    needs_nats(options, "backup")?;
    let started = Instant::now();
    let ledger = Ledger::open_existing(options).await?;
    let Ledger::JetStream(log) = &ledger else {
        ledger.close();
        return Err(CommandError::BadInput("backup needs --nats URL".into()));
    };
    let bar = progress_bar(0, "backing up");
    let result = backup::backup(log, to, Timestamp::now(), |done, end| {
        bar.set_length(end);
        bar.set_position(done);
    })
    .await;
    bar.finish_and_clear();
    ledger.close();
    let summary = result?;
    print_backup(&summary, to, started.elapsed().as_secs_f64(), json);
    Ok(())
}

impl From<CopyBackupError> for CommandError {
    fn from(e: CopyBackupError) -> Self {
        match e {
            CopyBackupError::NoCopy { .. }
            | CopyBackupError::NotAReplica { .. }
            | CopyBackupError::CopyStartsLate { .. } => CommandError::BadInput(e.to_string()),
            // A damaged copy, an empty one: the command ran and found a problem.
            CopyBackupError::Damaged { .. } | CopyBackupError::Empty { .. } => {
                CommandError::Problem(e.to_string())
            }
            CopyBackupError::Store { .. } => CommandError::Infrastructure(e.to_string()),
            CopyBackupError::Backup(b) => b.into(),
        }
    }
}

/// `provledger backup --from-copy DATA_DIR --to DIR`: offline, from a stopped replica's
/// data dir, which is locked while it is read (a running serve's is refused).
pub fn run_backup_from_copy(
    options: &LedgerOptions,
    from: &Path,
    to: &Path,
    json: bool,
) -> Result<(), CommandError> {
    let started = Instant::now();
    let data_dir = match SledLog::open_existing(from) {
        Ok(d) => d,
        Err(OpenSledError::Locked { dir, holder }) => {
            return Err(CommandError::Infrastructure(format!(
                "data dir {} is locked by another process ({holder}), as a running `provledger serve` holds it: a replica's copy is backed up only once that replica is stopped, never while it writes the copy. Back up the stream itself instead (`provledger --nats URL backup --to DIR`), or run this again on that data dir once its replica has stopped (or on a copy of the data dir made while it was stopped)",
                dir.display()
            )))
        }
        Err(e) => return Err(OpenLedgerError::Sled(e).into()),
    };
    let bar = progress_bar(0, "backing up the copy");
    let result = copy_backup::backup_from_copy(
        data_dir.db(),
        from,
        &options.subject_prefix,
        to,
        Timestamp::now(),
        |done, end| {
            bar.set_length(end);
            bar.set_position(done);
        },
    );
    bar.finish_and_clear();
    data_dir.close();
    let done = result?;
    print_backup(&done.summary, to, started.elapsed().as_secs_f64(), json);
    if !json {
        let m = &done.summary.manifest;
        let e = done.extent;
        println!(
            "from the copy in {}: it covers positions {}..={} (the stream may have gone on past {}); {} position(s) the replica had quarantined are held by placeholders, and the {} hole(s) are positions the stream itself had lost",
            from.display(),
            e.from,
            e.through,
            e.through,
            m.from_copy.as_ref().map_or(0, |o| o.placeholders),
            m.content.holes.len()
        );
    }
    Ok(())
}

/// The manifest without its tips (one line per aggregate), as printed.
fn manifest_summary(manifest: &Manifest) -> serde_json::Value {
    let mut value = serde_json::to_value(manifest)
        .expect("a manifest: plain serde data (string keys, no fallible impls) encodes as JSON");
    if let Some(fields) = value.as_object_mut() {
        fields.remove("tips");
    }
    value
}

fn print_backup(summary: &BackupSummary, to: &Path, seconds: f64, json: bool) {
    let m = &summary.manifest;
    let c = &m.content;
    let repeated = summary.repeated_id.as_ref().map(|r| {
        format!(
            "message id {:?} is at positions {} and {}: `provledger restore` will refuse this backup (JetStream would drop the second as a duplicate)",
            r.msg_id, r.first, r.again
        )
    });
    if json {
        let mut value = manifest_summary(m);
        value["dir"] = to.display().to_string().into();
        value["seconds"] = seconds.into();
        value["warning"] = repeated.into();
        print_json(&value);
        return;
    }
    println!(
        "backed up stream {} at positions {}..={} into {}: {} messages ({} commits in the chains of {} aggregates, {} quarantined, {} hole(s)), {} bytes, blake3 {}, in {seconds:.2} s",
        m.stream,
        c.first_position,
        c.last_position,
        to.display(),
        c.messages,
        c.commits,
        c.aggregates,
        c.quarantined,
        c.holes.len(),
        c.content_bytes,
        c.content_blake3
    );
    if let Some(text) = repeated {
        println!("warning: {text}");
    }
}

/// Reads the manifest in `from` and checks every byte of the backup against it.
fn read_and_check(from: &Path) -> Result<Manifest, CommandError> {
    let manifest = backup::read_manifest(from)?;
    let bar = progress_bar(manifest.content.last_position, "checking the backup");
    let checked = backup::check(from, &manifest, |p| bar.set_position(p));
    bar.finish_and_clear();
    checked?;
    tracing::info!(dir = %from.display(), "backup checked against its manifest");
    Ok(manifest)
}

/// `provledger restore --from DIR --check-only`: the backup checked, nothing published.
pub fn run_check(from: &Path, json: bool) -> Result<(), CommandError> {
    let started = Instant::now();
    let manifest = read_and_check(from)?;
    let seconds = started.elapsed().as_secs_f64();
    let c = &manifest.content;
    if json {
        let mut value = manifest_summary(&manifest);
        value["checked"] = true.into();
        value["seconds"] = seconds.into();
        print_json(&value);
        return Ok(());
    }
    println!(
        "backup {} checked: stream {} positions {}..={}, {} messages, {} commits, {} tips, blake3 {} as its manifest says, in {seconds:.2} s; nothing published",
        from.display(),
        manifest.stream,
        c.first_position,
        c.last_position,
        c.messages,
        c.commits,
        c.tips.len(),
        c.content_blake3
    );
    Ok(())
}

/// `provledger restore --from DIR [--verify]`.
pub async fn run_restore(
    options: &LedgerOptions,
    from: &Path,
    verify: bool,
    json: bool,
) -> Result<(), CommandError> {
    let url = needs_nats(options, "restore")?;
    let started = Instant::now();
    // Everything is checked before anything is published.
    let manifest = read_and_check(from)?;
    let client = connect_nats(&url, "provledger", &options.nats_auth).await?;
    let config = JetStreamConfig {
        stream: options.stream.clone(),
        subject_prefix: options.subject_prefix.clone(),
        replicas: options.stream_replicas.max(1),
        ..Default::default()
    };
    let bar = progress_bar(manifest.content.last_position, "restoring");
    let restored = backup::restore(client.clone(), config.clone(), from, &manifest, |p, end| {
        bar.set_length(end);
        bar.set_position(p);
    })
    .await;
    bar.finish_and_clear();
    let last = restored?;
    let restore_seconds = started.elapsed().as_secs_f64();
    let verified = if verify {
        Some(verify_restored(client, config, &manifest).await?)
    } else {
        None
    };
    print_restore(
        &manifest,
        from,
        last,
        restore_seconds,
        verified.as_ref(),
        json,
    );
    match verified {
        Some((report, _)) if !report.violations.is_empty() => Err(CommandError::Problem(format!(
            "the restored stream's audit found {} violation(s) (listed above); the source's audit at the backup's position would have found them as well",
            report.violations.len()
        ))),
        _ => Ok(()),
    }
}

/// Reads the restored stream back (its facts must be the manifest's), then audits it.
async fn verify_restored(
    client: async_nats::Client,
    config: JetStreamConfig,
    manifest: &Manifest,
) -> Result<(AuditReport, f64), CommandError> {
    let started = Instant::now();
    let bar = progress_bar(manifest.content.last_position, "reading back");
    let read = backup::read_back(client, config, manifest, |p, end| {
        bar.set_length(end);
        bar.set_position(p);
    })
    .await;
    bar.finish_and_clear();
    let (log, _) = read?;
    let bar = progress_bar(0, "auditing");
    let report = audit_log(
        &log,
        OnChainViolation::Quarantine,
        None,
        Timestamp::now(),
        |done, end| {
            bar.set_length(end);
            bar.set_position(done);
        },
    )
    .await;
    bar.finish_and_clear();
    Ok((report?, started.elapsed().as_secs_f64()))
}

fn print_restore(
    manifest: &Manifest,
    from: &Path,
    last: u64,
    seconds: f64,
    verified: Option<&(AuditReport, f64)>,
    json: bool,
) {
    let c = &manifest.content;
    if json {
        let mut value = serde_json::json!({
            "restored": manifest_summary(manifest),
            "from": from.display().to_string(),
            "last_position": last,
            "restore_seconds": seconds,
        });
        if let Some((report, verify_seconds)) = verified {
            value["verify_seconds"] = (*verify_seconds).into();
            value["verified"] = serde_json::json!({
                "commits": report.commits,
                "aggregates": report.aggregates,
                "tips": c.tips.len(),
                "content_blake3": c.content_blake3,
            });
            value["audit"] = serde_json::to_value(report).expect(
                "an audit report: plain serde data (string keys, no fallible impls) encodes as JSON",
            );
            value["audit"]["ok"] = report.violations.is_empty().into();
        }
        print_json(&value);
        return;
    }
    println!(
        "restored {} messages from {} into stream {} at positions {}..={} ({} hole(s) kept), in {seconds:.2} s",
        c.messages,
        from.display(),
        manifest.stream,
        c.first_position,
        last,
        c.holes.len()
    );
    if let Some(origin) = &manifest.from_copy {
        println!(
            "the backup was written from a replica's copy through position {}: what the stream held after that is not in it; {} quarantined position(s) hold placeholders",
            origin.copied_through,
            origin.placeholders
        );
    }
    let Some((report, verify_seconds)) = verified else {
        println!("not read back (no --verify): `provledger audit` audits the restored stream");
        return;
    };
    println!(
        "read back: the same {} bytes (blake3 {}) at the same positions; {} tips equal to the manifest's",
        c.content_bytes,
        c.content_blake3,
        c.tips.len()
    );
    super::audit::print_report(report, &[], *verify_seconds, false);
    println!(
        "verified: {} commits, {} aggregates, {} tips",
        report.commits,
        report.aggregates,
        c.tips.len()
    );
}
