"""Container health probe: exit 0 when the server's ``GET /health/ready`` answers 200, 1 otherwise.

Used by the Dockerfile's ``HEALTHCHECK`` and the compose ``healthcheck`` (the image has no curl). Standard
library only, so it starts in well under a second. The port comes from ``DLLM_PORT`` (the server's own
setting, default 8000); ``DLLM_HEALTHCHECK_URL`` overrides the whole URL.
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    """Probe readiness once; print why it failed so ``docker inspect`` shows it."""
    url = os.environ.get("DLLM_HEALTHCHECK_URL") or (
        f"http://127.0.0.1:{os.environ.get('DLLM_PORT', '8000')}/health/ready"
    )
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            status = response.status
    except urllib.error.HTTPError as exc:  # 503: loaded but not ready, or a fatal worker fault
        print(f"not ready: {url} answered {exc.code}", file=sys.stderr)
        return 1
    except OSError as exc:  # refused, timed out: not up yet
        print(f"not ready: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"not ready: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
