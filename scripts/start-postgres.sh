#!/usr/bin/env bash
# Makes sure the PostgreSQL the tests use answers at 127.0.0.1:5432 (trust auth, user root).
# On these machines it runs before the session; if it is down, start the local cluster.
set -euo pipefail

if pg_isready -q -h 127.0.0.1 -p 5432; then
  exit 0
fi
echo "postgres: not answering on 127.0.0.1:5432; starting the local cluster"
version=$(ls /etc/postgresql | sort -V | tail -n 1)
pg_ctlcluster --skip-systemctl-redirect "$version" main start
for _ in $(seq 1 30); do
  pg_isready -q -h 127.0.0.1 -p 5432 && exit 0
  sleep 1
done
echo "postgres: still not answering after 30 s" >&2
exit 1
