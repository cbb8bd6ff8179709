#!/usr/bin/env bash
# Installs Debian's Chromium and ChromeDriver (/usr/bin/chromium, /usr/bin/chromedriver)
# for the console's browser tests (services/cli/tests/suite/console.rs). Idempotent: does
# nothing if both are there, or if CHROMIUM_BIN and CHROMEDRIVER_BIN name others.
set -euo pipefail
chromium="${CHROMIUM_BIN:-/usr/bin/chromium}"
driver="${CHROMEDRIVER_BIN:-/usr/bin/chromedriver}"
if [ -x "$chromium" ] && [ -x "$driver" ]; then
  exit 0
fi
apt=(env DEBIAN_FRONTEND=noninteractive apt-get)
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || {
    echo "install-chromium: not root and no sudo: install the Debian packages chromium and chromium-driver" >&2
    exit 1
  }
  # sudo resets the environment: the frontend setting goes through env.
  apt=(sudo env DEBIAN_FRONTEND=noninteractive apt-get)
fi
echo "installing Debian's chromium and chromium-driver (the console's browser tests)" >&2
# The package lists may be missing or stale on a fresh machine: refresh them once if the
# install cannot find the packages.
"${apt[@]}" install -y -q --no-install-recommends chromium chromium-driver >/dev/null \
  || { "${apt[@]}" update -q >/dev/null && "${apt[@]}" install -y -q --no-install-recommends chromium chromium-driver >/dev/null; }
"$chromium" --version
