"""A real JupyterLab server and a headless Chromium page that drives it, for the browser tests.

`LabServer` starts ``jupyter lab`` from this environment on 127.0.0.1 with its own config, runtime,
settings and workspace folders, so nothing of the user's setup leaks in and nothing is left
behind. `Notebook` wraps a Playwright page showing one notebook: run all cells or one cell, wait
for the kernel, read outputs, click widgets. Selectors are JupyterLab 4's and ipywidgets 8's
stable class names.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from binder_env import python as venv_python

TOKEN = "memlab-browser-tests"
CHROMIUM = "/usr/bin/chromium"
#: Keep Chromium off the network (this machine's is closed) and quiet.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: A code cell is finished when its prompt carries its execution count.
DONE_PROMPT = re.compile(r"^\[\d+\]:$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.25) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


class LabServer:
    """``jupyter lab`` serving ``root``, with every Jupyter folder under ``home``."""

    def __init__(self, root: Path, home: Path, environment: dict[str, str] | None = None) -> None:
        """``environment``: the variables of another Python environment to serve from (its
        ``VIRTUAL_ENV``, ``PATH`` and ``HOME``: the Binder one); by default this one's."""
        self.root, self.home = root, home
        self.environment = environment
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / "jupyterlab.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90) -> None:
        settings = self.home / "settings"
        # No "get Jupyter news?" toast over the page; every cell in the DOM (no virtual scrolling),
        # so a test can read any cell without scrolling to it first.
        for plugin, values in {
            "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"},
            "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        }.items():
            package, name = plugin.rsplit("/", 1)
            folder = settings / package
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
        env = {
            **(self.environment or os.environ),
            "JUPYTER_CONFIG_DIR": str(self.home / "config"),
            "JUPYTER_RUNTIME_DIR": str(self.home / "runtime"),
            "JUPYTER_DATA_DIR": str(self.home / "data"),
            "JUPYTERLAB_SETTINGS_DIR": str(settings),
            "JUPYTERLAB_WORKSPACES_DIR": str(self.home / "workspaces"),
            "IPYTHONDIR": str(self.home / "ipython"),
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            # a kernel's torch on one thread: kernels run side by side (the course, three
            # notebooks at once) beside the other test worker, and threads that outnumber the
            # cores spin while they wait (a notebook took 3x as long in the course)
            "OMP_NUM_THREADS": "1",
        }
        python = venv_python(self.environment) if self.environment else sys.executable
        cmd = [
            python, "-m", "jupyter", "lab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            f"--ServerApp.token={TOKEN}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]  # fmt: skip
        if os.getuid() == 0:
            cmd.append("--allow-root")
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for("JupyterLab to answer", self._answers, timeout, poll=0.5)

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited early:\n{self.log()}")
        try:
            with urllib.request.urlopen(f"{self.url}/api/status?token={TOKEN}", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def log(self, tail: int = 8000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down first
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def shutdown_kernels(self) -> None:
        """Stop every kernel, so the next notebook starts on a quiet machine."""
        req = urllib.request.Request(f"{self.url}/api/kernels?token={TOKEN}")
        with urllib.request.urlopen(req, timeout=5) as r:
            kernels = json.load(r)
        for k in kernels:
            url = f"{self.url}/api/kernels/{k['id']}?token={TOKEN}"
            urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=10)


class Notebook:
    """One notebook open in JupyterLab, in a Playwright page."""

    def __init__(self, page: Any, server: LabServer, name: str) -> None:
        self.page, self.server, self.name = page, server, name
        #: The notebook on show (other documents' panels are hidden, not removed).
        self.root = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")

    def open(self, timeout: float = 90) -> Notebook:
        self.navigate()
        self.root.locator(".jp-Cell").first.wait_for(timeout=timeout * 1000)
        wait_for("the kernel to start", self.ready, timeout)
        return self

    def navigate(self) -> None:
        """Load the notebook's page, without waiting for JupyterLab to show it (see `ready`)."""
        # ?reset: a fresh workspace, so notebooks opened by earlier pages do not come back as tabs
        self.page.goto(
            f"{self.server.url}/lab/tree/{self.name}?reset&token={TOKEN}", wait_until="commit"
        )

    def ready(self) -> bool:
        """The notebook shows its cells and its kernel is idle."""
        # The toolbar says idle before the kernel exists: the status bar names it once it does.
        return self.root.locator(".jp-Cell").count() > 0 and self.kernel_status() == "Idle"

    def kernel_status(self) -> str:
        text = self.page.inner_text("#jp-main-statusbar")
        found = re.search(r"\|\s*(Idle|Busy|Starting|Restarting|Unknown|Connecting)", text)
        return found.group(1) if found else ""

    # -- running ----------------------------------------------------------------------------------
    def prompts(self) -> list[str]:
        return [
            p.strip() for p in self.root.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
        ]

    def run_all(self, timeout: float = 120) -> None:
        self.start_run_all()
        self.wait_until_done(timeout)

    def start_run_all(self) -> None:
        """Run > Run All Cells, without waiting (see `finished`)."""
        self.page.locator(".lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
        self.page.locator('[data-command="runmenu:run-all"]').click()

    def run_cell(self, index: int, timeout: float = 120) -> None:
        """Run the code cell at ``index`` (0-based among code cells) with Shift+Enter."""
        cell = self.cell(index)
        before = self.prompts()[index]
        cell.locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Shift+Enter")
        wait_for(
            f"code cell {index} to run",
            lambda: self.prompts()[index] != before and DONE_PROMPT.match(self.prompts()[index]),
            timeout,
        )
        wait_for("the kernel to go idle", lambda: self.kernel_status() == "Idle", timeout)

    def wait_until_done(self, timeout: float) -> None:
        """Until every code cell has run, or the run stopped at an error; the kernel idle."""

        wait_for(f"{self.name} to finish running", self.finished, timeout)
        # Outputs can land just after the prompt changes: read them once the page is still.
        time.sleep(0.3)

    def finished(self) -> bool:
        """Every code cell has run, or the run stopped at an error, and the kernel is idle."""
        prompts = self.prompts()
        if any("*" in p for p in prompts) or self.kernel_status() != "Idle":
            return False
        return all(DONE_PROMPT.match(p) for p in prompts) or bool(self.errors())

    # -- reading ----------------------------------------------------------------------------------
    def cell(self, index: int) -> Any:
        return self.root.locator(".jp-CodeCell").nth(index)

    def output_text(self, index: int) -> str:
        return str(self.cell(index).locator(".jp-OutputArea").inner_text())

    def errors(self) -> list[str]:
        """Tracebacks shown in any output area (JupyterLab renders errors as stderr text)."""
        error = re.compile(r"Traceback|^\w+(Error|Exception)\b", re.M)
        return [t for t in self.stderr() if error.search(t)]

    def stderr(self) -> list[str]:
        """Everything shown as stderr: errors, warnings and anything printed to sys.stderr."""
        return list(
            self.root.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
            ).all_inner_texts()
        )


# -- settings and colours (appended for tests/test_browser_product.py) -----------------------------
THEMES = "@jupyterlab/apputils-extension/themes"


def write_setting(server: LabServer, plugin: str, values: dict[str, Any]) -> None:
    """Override ``plugin``'s settings (``"@scope/package/name"``) in ``server``'s settings folder,
    the way `LabServer.start` sets its own. JupyterLab reads the file when a page loads, so it
    applies to pages opened afterwards; a running server needs no restart."""
    package, name = plugin.rsplit("/", 1)
    folder = server.home / "settings" / package
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jupyterlab-settings").write_text(json.dumps(values))


#: Given a root element, every visible piece of text under it with its colour and the colour it
#: is drawn on, both as opaque [r, g, b] (translucent colours composited over what lies below;
#: CSS colours of any syntax normalised through a canvas). SVG text (graphviz) is drawn on its
#: node's fill, else on the graph's background polygon.
TEXT_COLOURS_JS = """
root => {
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = 1;
  const ctx = canvas.getContext("2d", {willReadFrequently: true});
  const rgba = css => {
    if (!css || css === "none" || css === "transparent") return [0, 0, 0, 0];
    ctx.clearRect(0, 0, 1, 1);
    ctx.fillStyle = "rgba(0, 0, 0, 0)";
    ctx.fillStyle = css;
    ctx.fillRect(0, 0, 1, 1);
    const d = ctx.getImageData(0, 0, 1, 1).data;
    return [d[0], d[1], d[2], d[3] / 255];
  };
  const over = (top, below) =>
    [0, 1, 2].map(i => top[i] * top[3] + below[i] * (1 - top[3])).concat([1]);
  const htmlBackground = el => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = rgba(getComputedStyle(e).backgroundColor);
      if (c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    let bg = [255, 255, 255, 1];
    for (let i = layers.length - 1; i >= 0; i--) bg = over(layers[i], bg);
    return bg;
  };
  const svgBackground = t => {
    const node = t.closest("g.node");
    const shape = node && node.querySelector("polygon, path, ellipse");
    if (shape && rgba(getComputedStyle(shape).fill)[3] > 0)
      return over(rgba(getComputedStyle(shape).fill), svgBackground(node.parentElement));
    const svg = t.closest("svg");
    const page = htmlBackground(svg.parentElement);
    const poly = svg.querySelector("g.graph > polygon");
    return poly ? over(rgba(getComputedStyle(poly).fill), page) : page;
  };
  const out = [];
  for (const el of [root, ...root.querySelectorAll("*")]) {
    const own = [...el.childNodes]
      .filter(n => n.nodeType === Node.TEXT_NODE).map(n => n.textContent).join("").trim();
    if (!own || !el.getClientRects().length) continue;
    const style = getComputedStyle(el);
    if (style.visibility === "hidden" || style.display === "none") continue;
    const svgText = el instanceof SVGElement;
    const bg = svgText ? svgBackground(el) : htmlBackground(el);
    const fg = over(rgba(svgText ? style.fill : style.color), bg);
    out.push({
      text: own.slice(0, 80), tag: el.tagName.toLowerCase(),
      cell: !!el.closest("td"), fg: fg.slice(0, 3), bg: bg.slice(0, 3),
      weight: style.fontWeight, size: style.fontSize,
    });
  }
  return out;
}
"""


def contrast(a: list[float], b: list[float]) -> float:
    """WCAG's contrast ratio of two opaque sRGB colours (1 to 21)."""

    def luminance(c: list[float]) -> float:
        lin = [(v / 255) / 12.92 if v / 255 <= 0.04045 else ((v / 255 + 0.055) / 1.055) ** 2.4
               for v in c]  # fmt: skip
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


# -- the browser, and what a failed test leaves -----------------------------------------------
def chromium(profile: Path) -> Iterator[Any]:
    """A headless Chromium context (Playwright) on a fresh profile; for a module fixture."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError(
            f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium); "
            "scripts/test.sh does this when run as root"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000},
        )
        context.set_default_timeout(30_000)
        yield context
        context.close()


def watched_page(
    browser: Any, lab: LabServer, node: Any, artifacts: Path, prefix: str = ""
) -> Iterator[Any]:
    """A new page; if the test (``node``) failed, its screenshot, the server log and the browser
    console go to ``artifacts`` (names start with ``prefix``). For a test fixture."""
    page = browser.new_page()
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"page error: {e}"))
    yield page
    report = getattr(node, "rep_call", None)
    if report is not None and report.failed:
        name = prefix + re.sub(r"[^\w.-]+", "_", node.name)
        artifacts.mkdir(parents=True, exist_ok=True)
        shot = artifacts / f"{name}.png"
        page.screenshot(path=str(shot), full_page=True)
        (artifacts / f"{name}.server.log").write_text(lab.log(tail=200_000))
        (artifacts / f"{name}.console.log").write_text("\n".join(console))
        print(f"screenshot: {shot}\nserver log ({lab.log_path}), last lines:\n{lab.log(3000)}")
        print("browser console, last lines:\n" + "\n".join(console[-30:]))
    page.close()
    lab.shutdown_kernels()


def notebook(path: Path, *cells: str) -> None:
    """Write a notebook of code ``cells`` (no outputs) for a test to open."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    spec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["kernelspec"] = spec
    nbformat.write(nb, path)
