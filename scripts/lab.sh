#!/usr/bin/env bash
# The main job: JupyterLab on notebooks/, bound to this machine only, with memlab loaded in every
# kernel. Open the URL it prints (it carries the access token): it opens the quickstart.
#   PORT (default 8888); MEMLAB_TOKEN (default: a new random token)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)
port="${PORT:-8888}"
token="${MEMLAB_TOKEN:-$("$MEMLAB_PY" -c 'import secrets; print(secrets.token_hex(16))')}"
first="00-quickstart.ipynb"
cat <<BANNER

  memlab: JupyterLab is starting on notebooks/. Open this in your browser:

      http://127.0.0.1:$port/lab/tree/$first?token=$token

  Start with $first, then the course: 01-anatomy-of-a-training-step.ipynb onwards.
  Stop with Ctrl-C.

BANNER
exec "$MEMLAB_PY" -m jupyter lab --ip=127.0.0.1 --port="$port" --no-browser \
  --ServerApp.root_dir="$root/notebooks" --IdentityProvider.token="$token" \
  --ServerApp.port_retries=0 "${extra[@]}" "$@"
