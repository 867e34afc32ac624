# Installed by scripts/setup.sh as <venv>/etc/ipython/ipython_config.py: every IPython kernel
# started from that environment loads memlab (a notebook's own `%load_ext memlab` then does
# nothing, and keeps the notebook working elsewhere).
c = get_config()  # noqa: F821
c.InteractiveShellApp.extensions.append("memlab")
