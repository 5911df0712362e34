#!/usr/bin/env bash
# What the deployment tests (tests/deploy/) need besides .venv: Debian's docker-compose
# (1.29: `docker-compose config` validates docker-compose.yml against the compose spec
# without a Docker engine) and Prometheus (the integration test runs the stack's services
# without containers and scrapes them). Idempotent: installs only what is missing, and
# starts no service (Prometheus is run by the test itself, on a port of its own).
set -euo pipefail

missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup-deploy: installing ${missing[*]} (apt)"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  # Where the package starts its own service on :9090, the tests do not use it: they run
  # their own Prometheus on a free port with a generated config.
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      -o DPkg::Lock::Timeout=600 "${missing[@]}"
fi
echo "setup-deploy: $(prometheus --version 2>&1 | head -1); $(docker-compose version --short)"
