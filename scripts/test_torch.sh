#!/usr/bin/env bash
# The test suite (browser, Binder and lint aside) against another torch release, in an
# environment of its own, kept for the next run in .venv-torch-VERSION:
#
#   bash scripts/test_torch.sh 2.4.1        # the oldest torch memlab supports
#
# PyPI's Linux wheels of torch are CUDA builds: a few GB with their CUDA libraries, a couple of
# minutes to install; they run on a machine without a GPU.
set -euo pipefail
version="${1:?usage: bash scripts/test_torch.sh TORCH_VERSION, e.g. 2.4.1}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-torch-$version"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# torch first and pinned in the same command: memlab's needs must not pull another release
"$venv/bin/python" -m pip install -q "torch==$version" 2>&1 | grep -v "is ignored" || true
# transformers 5 turns PyTorch off below 2.6 (and the tests' models with it): the 4.x line there
older=()
case "$version" in 2.[0-5]|2.[0-5].*) older=("transformers<5" "peft<0.18") ;; esac
"$venv/bin/python" -m pip install -q "torch==$version" numpy "${older[@]}" -e "$root[lab,test]" \
  2>&1 | grep -v "is ignored" || true
cd "$root"
# the 00-* notebooks run in a kernel of this environment too (tests/test_notebooks.py): the
# Binder test, left out here, runs them on the Binder environment's torch only
export MEMLAB_NOTEBOOKS_HERE=1
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not browser" tests \
  --ignore=tests/test_binder.py --ignore=tests/test_packaging.py
