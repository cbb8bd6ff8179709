//! `store-memory`: serve's projection store write pattern on a bare sled db, to see what
//! bounds its resident memory. Each "commit" writes what a projector batch writes for it
//! (`c` + position with a ~300-byte commit, `h` + aggregate + version, the touched entity
//! `e` + aggregate re-written, over 1,000 aggregates); a batch of `--batch` commits ends
//! with the checkpoint key, as `ProjectionStore::write_batch` does. Prints RSS (from
//! /proc/self/statm) every `--every` commits, and the write rate per step.
//!
//! What it showed on sled 0.34.7: RSS grows by about 2 KB per commit, linearly, mostly
//! garbage waiting for crossbeam-epoch (one `apply_batch` pins once for thousands of
//! replaced pages and iobufs); `--epoch-flush N` (N collecting flushes after each batch,
//! what `ProjectionStore::write_batch` now does) removes it, after which `--cache` bounds
//! the rest up to about 50 bytes per commit of paged-out page metadata. A smaller cache
//! without the flushes makes it worse: eviction defers more pages.
//!
//! Usage: `store-memory [--commits N] [--every N] [--batch N] [--cache BYTES]
//! [--high-throughput] [--segment BYTES] [--flush-every BATCHES] [--split]
//! [--split-tx] [--random] [--value BYTES] [--entity BYTES] [--no-h] [--insert]
//! [--reopen-every N] [--aggregates N] [--epoch-flush N]`

use std::time::Instant;

struct Options {
    commits: u64,
    every: u64,
    batch: u64,
    cache: Option<u64>,
    high_throughput: bool,
    segment: Option<usize>,
    flush_every: u64,
    split: bool,
    split_tx: bool,
    random: bool,
    value: usize,
    entity: usize,
    no_h: bool,
    insert: bool,
    reopen_every: u64,
    aggregates: u64,
    epoch_flush: u64,
}

fn parse() -> Options {
    let mut o = Options {
        commits: 2_000_000,
        every: 100_000,
        batch: 800,
        cache: None,
        high_throughput: false,
        segment: None,
        flush_every: 0,
        split: false,
        split_tx: false,
        random: false,
        value: 300,
        entity: 400,
        no_h: false,
        insert: false,
        reopen_every: 0,
        aggregates: 1000,
        epoch_flush: 0,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = || -> u64 {
            args.next()
                .and_then(|v| v.replace('_', "").parse().ok())
                .unwrap_or_else(|| panic!("{a} takes a number"))
        };
        match a.as_str() {
            "--commits" => o.commits = num(),
            "--every" => o.every = num(),
            "--batch" => o.batch = num(),
            "--cache" => o.cache = Some(num()),
            "--segment" => o.segment = Some(num() as usize),
            "--flush-every" => o.flush_every = num(),
            "--value" => o.value = num() as usize,
            "--entity" => o.entity = num() as usize,
            "--reopen-every" => o.reopen_every = num(),
            "--aggregates" => o.aggregates = num(),
            "--epoch-flush" => o.epoch_flush = num(),
            "--high-throughput" => o.high_throughput = true,
            "--split" => o.split = true,
            "--split-tx" => o.split_tx = true,
            "--random" => o.random = true,
            "--no-h" => o.no_h = true,
            "--insert" => o.insert = true,
            other => panic!("unknown argument {other}"),
        }
    }
    o
}

fn rss_mb() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / 1e6
}

/// A cheap deterministic scramble, for the random-key variant.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Store {
    db: sled::Db,
    main: sled::Tree,
    copy: sled::Tree,
}

fn open(dir: &std::path::Path, o: &Options) -> Store {
    let mut config =
        sled::Config::new()
            .path(dir)
            .flush_every_ms(None)
            .mode(if o.high_throughput {
                sled::Mode::HighThroughput
            } else {
                sled::Mode::LowSpace
            });
    if let Some(c) = o.cache {
        config = config.cache_capacity(c);
    }
    if let Some(s) = o.segment {
        config = config.segment_size(s);
    }
    let db = config.open().expect("open sled");
    let main = db.open_tree("projection").expect("tree");
    let copy = if o.split || o.split_tx {
        db.open_tree("copy").expect("tree")
    } else {
        main.clone()
    };
    Store { db, main, copy }
}

fn main() {
    let o = parse();
    let dir = tempfile::tempdir_in(std::env::var("STORE_MEMORY_DIR").unwrap_or("/tmp".into()))
        .expect("tempdir");
    let mut store = open(dir.path(), &o);
    let value = vec![0xABu8; o.value];
    let mut versions = vec![0u64; o.aggregates as usize];
    let started = Instant::now();
    let mut step_started = Instant::now();
    let mut position = 0u64;
    let mut batches = 0u64;
    println!("commits\trss_mb\tcommits_per_s\tdisk_mb");
    while position < o.commits {
        // One batch: commits, then each touched entity once, then the checkpoint.
        let mut main_ops: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut copy_ops: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut touched = std::collections::BTreeSet::new();
        for _ in 0..o.batch {
            position += 1;
            let aggregate = mix(position) % o.aggregates;
            versions[aggregate as usize] += 1;
            let mut agg = [0u8; 17];
            agg[0] = 2;
            agg[1..9].copy_from_slice(&mix(aggregate ^ 0xFEED).to_be_bytes());
            agg[9..].copy_from_slice(&aggregate.to_be_bytes());
            let pos = if o.random {
                mix(position).to_be_bytes()
            } else {
                position.to_be_bytes()
            };
            let mut c = vec![b'c'];
            c.extend_from_slice(&pos);
            copy_ops.push((c, value.clone()));
            if !o.no_h {
                let mut h = vec![b'h'];
                h.extend_from_slice(&agg);
                h.extend_from_slice(&versions[aggregate as usize].to_be_bytes());
                copy_ops.push((h, position.to_be_bytes().to_vec()));
            }
            touched.insert(agg);
        }
        for agg in touched {
            let mut e = vec![b'e'];
            e.extend_from_slice(&agg);
            let mut v = vec![6u8; o.entity];
            v[1..9].copy_from_slice(&position.to_be_bytes());
            main_ops.push((e, v));
        }
        main_ops.push((b"mcheckpoint".to_vec(), position.to_be_bytes().to_vec()));

        if o.insert {
            for (k, v) in copy_ops.into_iter() {
                store.copy.insert(k, v).expect("insert");
            }
            for (k, v) in main_ops {
                store.main.insert(k, v).expect("insert");
            }
        } else if o.split_tx {
            use sled::Transactional;
            let mut cb = sled::Batch::default();
            for (k, v) in copy_ops {
                cb.insert(k, v);
            }
            let mut mb = sled::Batch::default();
            for (k, v) in main_ops {
                mb.insert(k, v);
            }
            (&store.copy, &store.main)
                .transaction(|(copy, main)| {
                    copy.apply_batch(&cb)?;
                    main.apply_batch(&mb)?;
                    Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
                })
                .expect("transaction");
        } else if o.split {
            let mut cb = sled::Batch::default();
            for (k, v) in copy_ops {
                cb.insert(k, v);
            }
            store.copy.apply_batch(cb).expect("batch");
            let mut mb = sled::Batch::default();
            for (k, v) in main_ops {
                mb.insert(k, v);
            }
            store.main.apply_batch(mb).expect("batch");
        } else {
            let mut b = sled::Batch::default();
            for (k, v) in copy_ops.into_iter().chain(main_ops) {
                b.insert(k, v);
            }
            store.main.apply_batch(b).expect("batch");
        }
        batches += 1;
        for _ in 0..o.epoch_flush {
            crossbeam_epoch::pin().flush();
        }
        if o.flush_every > 0 && batches.is_multiple_of(o.flush_every) {
            store.db.flush().expect("flush");
        }
        if o.reopen_every > 0 && position % o.reopen_every < o.batch {
            store.db.flush().expect("flush");
            drop(store);
            store = open(dir.path(), &o);
        }
        if position % o.every < o.batch {
            let rate = o.every as f64 / step_started.elapsed().as_secs_f64();
            step_started = Instant::now();
            let disk = store.db.size_on_disk().unwrap_or(0) as f64 / 1e6;
            println!("{position}\t{:.0}\t{rate:.0}\t{disk:.0}", rss_mb());
        }
    }
    let total = started.elapsed().as_secs_f64();
    println!(
        "# total {position} commits in {total:.1} s = {:.0}/s, rss {:.0} MB",
        position as f64 / total,
        rss_mb()
    );
}
