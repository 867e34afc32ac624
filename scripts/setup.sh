#!/usr/bin/env bash
# Prepare a fresh machine for memlab: graphviz's `dot`, a virtual environment in .venv with
# memlab and its lab and test extras, and IPython set to load memlab in every kernel of it.
# Safe to run again: it only installs what changed. Sourced by scripts/lab.sh and scripts/test.sh.
#
#   MEMLAB_TORCH  the torch requirement to install first (default: torch==2.13.0, a CPU build).
#                 On a machine with its own CUDA torch, e.g. MEMLAB_TORCH="torch>=2.4".
#   MEMLAB_VENV   where the environment lives (default: .venv in the checkout).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEMLAB_VENV:-$root/.venv}"
torch_req="${MEMLAB_TORCH:-torch==2.13.0}"

# apt_install PACKAGE WHY: install a Debian package when running as root with apt; otherwise
# fail (status 1) and leave the message to the caller.
apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  echo "memlab: installing $1 ($2)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
}

if ! command -v dot >/dev/null 2>&1; then
  if ! apt_install graphviz "for the dot executable"; then
    echo "memlab setup: graphviz's 'dot' is missing. Install it (apt-get install graphviz," \
         "conda install graphviz or brew install graphviz) and run this again." >&2
    exit 1
  fi
fi

# A C++ compiler builds memlab's native record on first use (CPU regions without Python per op);
# without one, memlab measures with its dispatch mode instead (slower, the same figures).
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
  if ! apt_install g++ "for memlab's native record"; then
    echo "memlab setup: no C++ compiler; CPU regions will use the slower dispatch mode." >&2
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "memlab setup: creating $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"

# Install torch first and on its own: a package that depends on torch (torchviz) installed into
# an environment without it would pull a multi-GB CUDA build.
stamp="$venv/.memlab-installed"
want="$(cat "$root/pyproject.toml"; echo "$torch_req")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "memlab setup: installing $torch_req, then memlab[lab,test] (a minute or two)"
  "$py" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  "$py" -m pip install -q "$torch_req" 2>&1 | grep -v "is ignored" || true
  "$py" -W ignore -c "import torch" || { echo "memlab setup: torch did not install" >&2; exit 1; }
  "$py" -m pip install -q "$torch_req" -e "$root[lab,test]" 2>&1 | grep -v "is ignored" || true
  "$py" -c "import memlab, IPython, jupyterlab, pytest" \
    || { echo "memlab setup: memlab's dependencies did not install" >&2; exit 1; }
  printf '%s' "$want" > "$stamp"
fi

# Every IPython kernel started from this environment loads memlab.
mkdir -p "$venv/etc/ipython"
cp "$root/scripts/ipython_config.py" "$venv/etc/ipython/ipython_config.py"
export MEMLAB_PY="$py"
