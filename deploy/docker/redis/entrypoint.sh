#!/bin/sh
# `redis-server ARGS` runs with --protected-mode no (see the Dockerfile); anything else (redis-cli) as given.
set -eu
if [ "${1:-}" = redis-server ]; then
  shift
  exec redis-server --protected-mode no "$@"
fi
exec "$@"
