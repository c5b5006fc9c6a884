#!/bin/sh
# The image's entrypoint: one image, three jobs.
#   serve [flags]        python -m service serve      (the default; flags override DLLM_* settings)
#   calibrate STEP ...   python -m calibration STEP ...
#   evaluate CMD ...     python -m evaluation CMD ...
#   policies CMD ...     python -m service policies CMD ...  (export/import between a directory and Redis)
#   anything else        run as given (a shell, python, ...)
# `exec` so the Python process receives SIGTERM directly and the server can drain.
set -eu
if [ "$#" -eq 0 ]; then
  set -- serve
fi
cmd="$1"
shift
case "$cmd" in
  serve) exec python -m service serve "$@" ;;
  calibrate) exec python -m calibration "$@" ;;
  evaluate) exec python -m evaluation "$@" ;;
  policies) exec python -m service policies "$@" ;;
  *) exec "$cmd" "$@" ;;
esac
