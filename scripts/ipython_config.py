# Installed by scripts/setup.sh as <venv>/etc/ipython/ipython_config.py: every IPython kernel
# started from that environment loads memlab, as `memlab.autoload` (a notebook's own
# `%load_ext memlab` then does nothing and says nothing, and keeps the notebook working
# elsewhere). MEMLAB_NO_AUTOLOAD=1 turns that off, so
# that notebooks run as a reader's kernel runs them (scripts/run_notebooks.py sets it).
import os

c = get_config()  # noqa: F821
if not os.environ.get("MEMLAB_NO_AUTOLOAD"):
    c.InteractiveShellApp.extensions.append("memlab.autoload")
