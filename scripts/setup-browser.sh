#!/usr/bin/env bash
# What the scorecard page's tests (tests/gateway/test_admin_ui.py) need besides .venv:
# Debian's headless Chromium, which loads /admin/ui from a running gateway, dumps its DOM
# and takes a screenshot. Nothing is downloaded at test time (no browser build of a pip
# package): the Debian package is the browser. Idempotent: installs only what is missing.
set -euo pipefail

if ! command -v chromium >/dev/null; then
  echo "setup-browser: installing chromium (apt; fonts-liberation for legible screenshots)"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      -o DPkg::Lock::Timeout=600 chromium fonts-liberation
fi
echo "setup-browser: $(chromium --version 2>/dev/null | head -1)"
