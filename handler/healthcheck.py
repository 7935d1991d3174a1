"""`python -m handler.healthcheck`: the image's Docker HEALTHCHECK. On a load-balancing worker (Settings.endpoint_mode)
it asks the worker's own health route: exit 0 when it answers 200 (ready) or 204 (still starting: a large model
loads for minutes, and the worker is alive), 1 otherwise (503: failed, faulted or shutting down; no answer). A
queue worker has no HTTP server: exit 0 (runpod's own heartbeat reports it)."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

from handler.settings import SettingsError, load_settings


def main() -> int:
    try:
        s = load_settings()
    except SettingsError as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    mode, why = s.endpoint_mode()
    if mode != "lb":
        return 0
    url = f"http://127.0.0.1:{s.PORT_HEALTH or s.PORT or 80}{s.HEALTH_CHECK_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=4) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1
    if status in (200, 204):
        return 0
    print(f"unhealthy: {url} answered {status}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
