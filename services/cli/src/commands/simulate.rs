//! `provledger simulate [--seeds N] [--seed S]`: the seeded simulation
//! (`provledger_sim::simulation`), plus the check that needs the projector: the state the
//! projector builds batch by batch in a sled store equals a rebuild from position 1.
//! A failing seed is printed with the command that replays it; exit 1.

use std::time::Instant;

use provledger_events::{Commit, ReadError};
use provledger_projections::Projection;
use provledger_serve::{ProjectionStore, Projector};
use provledger_sim::simulation::{run_seed_blocking, SeedReport, SimulationConfig};

use super::state::progress_bar;
use super::{print_json, CommandError};

/// Folds the seed's log into a temporary sled store in batches whose sizes the seed
/// picks, some delivered twice, and compares every entity with a rebuild.
fn projector_matches_rebuild(seed: u64, commits: &[Commit]) -> Result<(), String> {
    let db = sled::Config::new()
        .temporary(true)
        .open()
        .map_err(|e| format!("temporary sled: {e}"))?;
    let store = ProjectionStore::open(&db).map_err(|e| e.to_string())?;
    let mut projector = Projector::new(store.clone(), 7).map_err(|e| e.to_string())?;
    let mut rest = commits;
    let mut previous: &[Commit] = &[];
    let mut n = seed;
    while !rest.is_empty() {
        n = n
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let take = 1 + (n >> 33) as usize % 17;
        let (batch, tail) = rest.split_at(take.min(rest.len()));
        // A resubscription delivers entries again: a third of the batches arrive with the
        // previous batch in front of them, which the projector must skip.
        let redeliver = (n >> 20).is_multiple_of(3);
        let entries: Vec<Result<Commit, ReadError>> = previous
            .iter()
            .filter(|_| redeliver)
            .chain(batch)
            .cloned()
            .map(Ok)
            .collect();
        projector
            .apply_batch(entries)
            .map_err(|e| format!("projector: {e}"))?;
        previous = batch;
        rest = tail;
    }
    let rebuilt = Projection::rebuild(commits);
    for (id, expected) in &rebuilt.entities {
        let stored = store.entity(id).map_err(|e| e.to_string())?;
        if stored.as_ref() != Some(expected) {
            return Err(format!(
                "{id}: the projector's state differs from a rebuild from position 1"
            ));
        }
    }
    Ok(())
}

pub fn run(seeds: u64, first: u64, operations: usize, json: bool) -> Result<(), CommandError> {
    let config = SimulationConfig {
        operations,
        ..SimulationConfig::default()
    };
    let started = Instant::now();
    let bar = progress_bar(seeds, "simulating");
    let mut reports: Vec<SeedReport> = Vec::new();
    let mut failures: Vec<(u64, Vec<String>)> = Vec::new();
    for seed in first..first.saturating_add(seeds) {
        let outcome = run_seed_blocking(seed, &config);
        let mut violations = outcome.violations;
        if let Err(e) = projector_matches_rebuild(seed, &outcome.commits) {
            violations.push(e);
        }
        if !violations.is_empty() {
            tracing::error!(seed, ?violations, "simulation seed failed");
            failures.push((seed, violations));
        }
        reports.push(outcome.report);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let commits: usize = reports.iter().map(|r| r.commits).sum();
    let mut outcomes = std::collections::BTreeMap::new();
    for r in &reports {
        for (status, n) in &r.outcomes {
            *outcomes.entry(status.clone()).or_insert(0usize) += n;
        }
    }
    let crashes: usize = reports.iter().map(|r| r.crashes).sum();
    let after_action: usize = reports.iter().map(|r| r.crashes_after_action).sum();
    let faults: (u64, u64, u64) = reports.iter().fold((0, 0, 0), |acc, r| {
        (
            acc.0 + r.unavailable,
            acc.1 + r.lost_acks,
            acc.2 + r.read_unavailable,
        )
    });
    if json {
        print_json(&serde_json::json!({
            "seeds": seeds,
            "first_seed": first,
            "seconds": seconds,
            "seeds_per_second": seeds as f64 / seconds.max(1e-9),
            "commits": commits,
            "outcomes": outcomes,
            "faults": {"unavailable": faults.0, "lost_acks": faults.1, "read_unavailable": faults.2, "runner_crashes": crashes, "runner_crashes_after_an_action": after_action},
            "failures": failures.iter().map(|(s, v)| serde_json::json!({"seed": s, "violations": v})).collect::<Vec<_>>(),
        }));
    } else {
        println!(
            "{seeds} seed(s) from {first} in {seconds:.2} s ({:.0} seeds/s): {commits} commits; operations {outcomes:?}; injected {} unavailable appends, {} lost acks, {} unavailable reads, {crashes} runner crashes ({after_action} right after an executor acted; an operator cancels each crashed operation at the end, and its rollback undoes by idempotency key what the runner never recorded)",
            seeds as f64 / seconds.max(1e-9),
            faults.0,
            faults.1,
            faults.2
        );
        for (seed, violations) in &failures {
            println!("seed {seed} FAILED; replay it with: provledger simulate --seed {seed}");
            for v in violations {
                println!("    {v}");
            }
        }
        if failures.is_empty() {
            println!("every invariant held");
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(CommandError::Problem(format!(
            "{} seed(s) broke an invariant",
            failures.len()
        )))
    }
}
