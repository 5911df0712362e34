#!/usr/bin/env bash
# Installs what the benchmarks compare against: nginx (the Debian package), the peer of
# bench/proxy.py. Idempotent: does nothing when an nginx binary is already there. The
# benchmarks run without it too and say so; they start nginx themselves, as a child
# process with a generated config, so nothing system-wide is configured or started here.
set -euo pipefail

if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
  echo "setup-bench: nginx present: $( (command -v nginx || echo /usr/sbin/nginx) )"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-bench: no apt-get here; install nginx by hand (the benchmarks run without it)" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
fi
echo "setup-bench: installing nginx-light"
$SUDO apt-get update -q
# Where systemd runs, the package also starts a system nginx on :80; the benchmarks do
# not use it (they start their own on a free port).
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q nginx-light \
  || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q nginx
echo "setup-bench: $(/usr/sbin/nginx -v 2>&1)"
