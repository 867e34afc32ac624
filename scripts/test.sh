#!/usr/bin/env bash
# The whole test suite: lint (ruff), types (mypy), unit tests, the magics in a real IPython shell,
# every notebook executed, and the browser tests (a real JupyterLab in headless Chromium). Tests
# marked `cuda` run where a GPU is present and are reported as skipped elsewhere. Extra arguments
# go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
# The browser tests drive Debian's Chromium (tests/test_browser.py); as root, install it here.
if [ ! -x /usr/bin/chromium ]; then
  if ! apt_install chromium "for the browser tests"; then
    echo "memlab tests: /usr/bin/chromium is missing, so the browser tests will fail." \
         "Install Debian's chromium package (apt-get install chromium)." >&2
  fi
fi
exec "$MEMLAB_PY" -m pytest "$@"
