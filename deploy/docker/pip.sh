#!/bin/sh
# pip inside the image build, trusting one more CA when the build is given one.
#
# A TLS-intercepting proxy between the build and the package index needs its CA: pass a PEM file as the build
# secret `extra_ca` (`docker build --secret id=extra_ca,src=proxy-ca.pem`, the same flag for podman). The secret
# is mounted at /run/secrets/extra_ca for one RUN only, so it never lands in a layer; pip gets its own bundle
# (certifi, vendored in pip) plus that CA in a temporary file removed before the RUN ends.
set -eu
extra=/run/secrets/extra_ca
if [ -s "$extra" ]; then
  bundle=$(mktemp)
  cat "$(python -c 'import pip._vendor.certifi as c; print(c.where())')" "$extra" >"$bundle"
  status=0
  PIP_CERT="$bundle" pip "$@" || status=$?
  rm -f "$bundle"
  exit "$status"
fi
exec pip "$@"
