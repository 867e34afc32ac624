#!/usr/bin/env bash
# The main job: JupyterLab on notebooks/, bound to this machine only, with memlab loaded in every
# kernel. Open the URL it prints (it carries the access token).
#   PORT (default 8888)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)
exec "$MEMLAB_PY" -m jupyter lab --ip=127.0.0.1 --port="${PORT:-8888}" --no-browser \
  --ServerApp.root_dir="$root/notebooks" "${extra[@]}" "$@"
