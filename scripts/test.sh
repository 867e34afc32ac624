#!/usr/bin/env bash
# The whole test suite: lint (ruff), types (mypy), unit tests, the magics in a real IPython shell,
# and every notebook executed. Tests marked `cuda` run where a GPU is present and are reported as
# skipped elsewhere. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec "$MEMLAB_PY" -m pytest "$@"
