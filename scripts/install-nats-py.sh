#!/usr/bin/env bash
# Installs the pinned nats-py (pure Python, no dependencies) into .tools/python (git-ignored)
# from PyPI, for docs/examples/follow.py and its test: PYTHONPATH=.tools/python python3 ...
# Idempotent: does nothing if that version is already there. The install goes to a fresh
# directory that is then renamed into place, so a run that dies half-way leaves nothing
# that looks installed.
set -euo pipefail
NATS_PY_VERSION="${NATS_PY_VERSION:-2.16.0}"
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.tools/python"
installed() { [ -f "$dest/nats_py-${NATS_PY_VERSION}.dist-info/METADATA" ] && [ -d "$dest/nats" ]; }
if installed; then
  exit 0
fi
mkdir -p "$root/.tools"
tmp=$(mktemp -d "$root/.tools/python.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "installing nats-py ${NATS_PY_VERSION} from PyPI into .tools/python" >&2
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  --no-deps --only-binary=:all: --target "$tmp" "nats-py==${NATS_PY_VERSION}"
PYTHONPATH="$tmp" python3 -c 'import nats'
rm -rf "$dest"
# Another run may have renamed its own copy into place meanwhile: that one is as good.
mv -T "$tmp" "$dest" 2>/dev/null || installed
echo "nats-py ${NATS_PY_VERSION} in .tools/python" >&2
