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
# memlab compiled to bytecode once: the suite starts well over a hundred Python processes
# (kernels, Binder notebooks, ranks, scripts), and where PYTHONDONTWRITEBYTECODE is set each
# would otherwise compile memlab from source again (about a second each)
"$MEMLAB_PY" -m compileall -q -j 0 memlab > /dev/null
# The suite runs on as many workers as the machine has cores, up to 4 (pytest-xdist; each
# worker holds torch and the models it builds, so more would cost memory for little): a test
# module stays on one worker (its module fixtures, a kernel or a JupyterLab, are made once), and
# the Binder environment is built once, in a process of its own (tests/conftest.py). MEMLAB_TEST_WORKERS=0
# runs it in one process; a later -n given here wins.
cores="$(nproc 2>/dev/null || echo 1)"
workers="${MEMLAB_TEST_WORKERS:-$(( cores > 4 ? 4 : cores ))}"
[ "$workers" -le 1 ] && workers=0
# The slowest tests are listed at the end (what to make lighter when the suite grows).
exec "$MEMLAB_PY" -m pytest -n "$workers" --dist loadfile --durations=30 "$@"
