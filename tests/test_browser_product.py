"""memlab as a product, in a real JupyterLab in headless Chromium: what a person sees and can do.

The what-if panel in the light and the dark theme (its table, chart and timeline drawn, no
broken image, its status line and every memlab header and note readable); long work that shows
progress, keeps the kernel free and stops on Cancel; the budget a simulated GPU fills in, and the
budget a person typed that it leaves alone; a loss that needs targets, through
``memlab.whatif.run`` and the panel; the ``%%gpumem`` report and the graph of a real model in the
dark theme. "Readable" is measured: WCAG's contrast ratio between each piece of text's colour and
the colour it is drawn on, at least `READABLE`.

One JupyterLab server for the module; each test opens its notebook in a fresh page. Screenshots of
the elements land in tests/artifacts/browser/ (CI keeps them); ``--update-screenshots`` copies
them to docs/screenshots/ as ``product-*.png``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyterlab_driver import (
    TEXT_COLOURS_JS,
    THEMES,
    LabServer,
    Notebook,
    contrast,
    notebook,
    wait_for,
    watched_page,
    write_setting,
)

ROOT = Path(__file__).parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts" / "browser"
SCREENSHOTS = ROOT / "docs" / "screenshots"
LIGHT, DARK = "JupyterLab Light", "JupyterLab Dark"
#: The least contrast ratio we call readable (WCAG's minimum for large or bold text; body text
#: should reach 4.5).
READABLE = 3.0

pytestmark = [pytest.mark.browser, pytest.mark.slow]

#: What the drawing tests measured, judged by the tests at the end of the file (each problem
#: found by looking once has its own test). Keys: "overflow", "faint figures", "graph text px".
MEASURED: dict[str, list[Any]] = {}


# -- the notebooks the tests drive ---------------------------------------------------------------
PANEL = (
    """import torch
from torch import nn
import memlab

def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))

ex = memlab.Explorer(model_fn, lambda n: torch.randn(n, 256),
                     config={"device": "cpu", "batch_size": 32})
ex""",
)

#: A model_fn that sleeps, so that a search of a dozen or more tries takes several seconds.
SLOW = (
    """import time
import torch
from torch import nn
import memlab

def model_fn():
    time.sleep(0.6)  # (each try long enough to see, its steps short: Cancel acts within a try)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))

slow = memlab.Explorer(model_fn, lambda n: torch.randn(n, 256),
                       config={"device": "cpu", "batch_size": 8})
slow.budget.value = 64  # MiB
slow""",
    "1 + 1",
)

BUDGET = (
    """import torch
from torch import nn
import memlab

ex = memlab.Explorer(lambda: nn.Linear(64, 64), lambda n: torch.randn(n, 64),
                     config={"device": "cpu"})
ex""",
)

TARGETS = (
    """import torch
import torch.nn.functional as F
from torch import nn
import memlab
import memlab.whatif  # `import memlab` alone does not make memlab.whatif an attribute: see below

def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

def batch_fn(n):
    return torch.randn(n, 32), torch.randint(0, 10, (n,))

memlab.whatif.run(model_fn, batch_fn, step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                  device="cpu", batch_size=16)""",
    """ex = memlab.Explorer(model_fn, batch_fn, step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                     config={"device": "cpu", "batch_size": 16})
ex""",
)

REAL = (
    """%load_ext memlab
import torch
import memlab
from memlab.examples.language import Encoder

torch.manual_seed(0)
model = Encoder(vocab=1000, ctx=32, width=96, layers=2)
opt = torch.optim.Adam(model.parameters())
ids = torch.randint(0, 1000, (8, 32))""",
    """%%gpumem -b -t a training step of a small encoder
loss = model(ids).square().mean()
loss.backward()
opt.step()
opt.zero_grad()""",
    "g = memlab.graph(model, ids[:4])\ng",
    "g.view(depth=1)",
)

#: Pre-flight on a small simulated GPU: a training step that would not fit, explained.
PREFLIGHT = (
    """%load_ext memlab
import torch""",
    """%%gpumem --gpu 0.75GiB
net = torch.nn.Sequential(*[torch.nn.Linear(16, 16), torch.nn.ReLU()] * 2)
x = torch.randn(2**20, 16)
net(x).sum().backward()""",
)

#: A pre-flight whose accounting failed on an op (a bug of memlab's own, simulated by a replay
#: that raises once): no verdict.
PREFLIGHT_LOST = (
    """%load_ext memlab
import torch
from memlab.estimate.preflight import Flight
_told, _calls = Flight.on_alloc, []
def _fails_once(self, serial, delta, when):
    _calls.append(delta)
    if len(_calls) == 1:
        raise RuntimeError("the replay's own bug")
    _told(self, serial, delta, when)
Flight.on_alloc = _fails_once""",
    """%%gpumem --gpu 1GiB
big = torch.empty(900 * 2**20 // 4)
d = 1""",
)


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    root = tmp_path_factory.mktemp("lab-root")
    for name, cells in {
        "panel": PANEL,
        "slow": SLOW,
        "budget": BUDGET,
        "targets": TARGETS,
        "real": REAL,
        "preflight": PREFLIGHT,
        "preflight-lost": PREFLIGHT_LOST,
    }.items():
        notebook(root / f"{name}.ipynb", *cells)
    server = LabServer(root, tmp_path_factory.mktemp("lab-home"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module", autouse=True)
def measurements() -> Iterator[None]:
    """Leaves what the tests measured in tests/artifacts/browser/product-measured.json."""
    yield
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "product-measured.json").write_text(json.dumps(MEASURED, indent=1))


@pytest.fixture
def page(browser: Any, lab: LabServer, request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from watched_page(browser, lab, request.node, ARTIFACTS, "product-failed-")


def open_in(page: Any, lab: LabServer, name: str, theme: str = LIGHT) -> Notebook:
    """Open ``name`` in ``theme`` (the settings override, read when the page loads)."""
    write_setting(lab, THEMES, {"theme": theme})
    try:
        nb = Notebook(page, lab, name).open()
        themed = page.locator(f'body[data-jp-theme-name="{theme}"]')
        themed.wait_for(state="attached", timeout=30_000)
    finally:
        write_setting(lab, THEMES, {"theme": LIGHT})  # the next page opens in the default
    return nb


def keep(element: Any, name: str, request: pytest.FixtureRequest) -> None:
    """A screenshot of ``element`` as a CI artefact (--update-screenshots: for the docs too)."""
    assert name.startswith("product-")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = element.page
    page.mouse.move(0, 0)  # no hover highlight in the picture
    # JupyterLab scrolls inside its panel, so an element taller than the window is cut off
    # (the timeline's axis, under the status bar): a window tall enough for it, while it is taken
    size, box = page.viewport_size, element.bounding_box()
    if size and box and box["height"] + 200 > size["height"]:
        page.set_viewport_size({"width": size["width"], "height": int(box["height"]) + 300})
    element.scroll_into_view_if_needed()
    element.screenshot(path=str(ARTIFACTS / name))
    if size:
        page.set_viewport_size(size)
    if request.config.getoption("--update-screenshots"):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(ARTIFACTS / name, SCREENSHOTS / name)


def slug(theme: str) -> str:
    return theme.split()[-1].lower()


# -- reading the page -----------------------------------------------------------------------------
def texts(element: Any) -> list[dict[str, Any]]:
    """Every visible piece of text under ``element``, with its colour and background."""
    element.page.mouse.move(0, 0)  # a hovered table row changes its background
    return list(element.evaluate(TEXT_COLOURS_JS))


def least_contrast(what: str, items: list[dict[str, Any]]) -> None:
    """Records the faintest of ``items`` under ``what`` (for product-measured.json)."""
    worst = min(items, key=lambda t: contrast(t["fg"], t["bg"]))
    MEASURED.setdefault("least contrast", []).append(
        f"{what}: {contrast(worst['fg'], worst['bg']):.2f} ({worst['text']!r})"
    )


def unreadable(items: list[dict[str, Any]]) -> list[str]:
    return [
        f"{t['text']!r} <{t['tag']}> rgb{tuple(round(v) for v in t['fg'])} on "
        f"rgb{tuple(round(v) for v in t['bg'])}: {contrast(t['fg'], t['bg']):.2f}"
        for t in items
        if contrast(t["fg"], t["bg"]) < READABLE
    ]


#: A memlab frame's own words: its text without the code set in <code> (the user's cell lines,
#: which have whatever brackets the user wrote).
PROSE_JS = """
frames => frames.map(f => {
  const copy = f.cloneNode(true);
  copy.querySelectorAll("code").forEach(c => c.replaceWith("…"));
  document.body.appendChild(copy);
  const text = copy.innerText;
  copy.remove();
  return text;
})
"""


def check_frames_readable(root: Any) -> list[str]:
    """Fails on a header or note of a memlab frame drawn too faint to read; returns what fell
    short among the table's figures (reported, not failed: some are coloured on purpose)."""
    frames = root.locator(".memlab")
    assert frames.count() > 0
    headers_notes: list[dict[str, Any]] = []
    figures: list[dict[str, Any]] = []
    for i in range(frames.count()):
        for t in texts(frames.nth(i)):
            (figures if t["cell"] else headers_notes).append(t)
    assert headers_notes
    nested = re.compile(r"\([^()]*\(")  # "(a (b))": brackets inside brackets
    MEASURED.setdefault("nested brackets", []).extend(
        line
        for text in frames.evaluate_all(PROSE_JS)
        for line in text.splitlines()
        if nested.search(line)
    )
    least_contrast(
        f"{root.page.locator('body').get_attribute('data-jp-theme-name')}: the headers "
        "and notes of memlab's frames",
        headers_notes,
    )
    assert not unreadable(headers_notes), unreadable(headers_notes)
    return unreadable(figures)


#: The smallest text a person reads without zooming, in CSS pixels.
MIN_TEXT_PX = 8.0
#: An SVG's text as drawn: the smallest and the median font size in CSS pixels (graphviz sets
#: font-size in the SVG's own units, which the page scales to fit the output area).
SVG_TEXT_PX_JS = """
svg => {
  const px = [...svg.querySelectorAll("text")].map(t =>
    parseFloat(getComputedStyle(t).fontSize) * t.getScreenCTM().a).sort((a, b) => a - b);
  return {min: px[0], median: px[Math.floor(px.length / 2)], count: px.length};
}
"""


#: Given the panel, what a person would see wrong with its controls: a label above its control
#: instead of beside it, a label cut short ("optimizer step in back…"), a control running past
#: the panel's right edge or over the next column.
LAYOUT_JS = """
panel => {
  const out = [], edge = panel.getBoundingClientRect().right;
  const visible = e => e.getClientRects().length && getComputedStyle(e).display !== "none";
  for (const row of panel.querySelectorAll(".widget-inline-hbox")) {
    if (!visible(row)) continue;
    const label = row.querySelector(":scope > .widget-label");
    const control = row.lastElementChild.getBoundingClientRect();
    if (label && visible(label) && label.textContent.trim()) {
      const l = label.getBoundingClientRect();
      const name = label.textContent.trim();
      if (l.bottom <= control.top + 2) out.push(`${name}: its label sits above its control`);
      if (label.scrollWidth > label.clientWidth + 1) out.push(`${name}: its label is cut short`);
    }
    if (control.right > edge + 1) out.push(`${row.textContent.trim()}: past the panel's edge`);
  }
  for (const label of panel.querySelectorAll(".widget-checkbox .widget-label")) {
    if (visible(label) && label.scrollWidth > label.clientWidth + 1)
      out.push(`${label.textContent.trim()}: its label is cut short`);
  }
  return out;
}
"""


def images_drawn(element: Any) -> int:
    """The visible images under ``element``, each checked to have loaded (no broken icon)."""
    shown = element.locator("img:visible")
    for i in range(shown.count()):
        img = shown.nth(i)
        wait_for("an image to load", lambda img=img: img.evaluate("i => i.naturalWidth") > 0, 10)
    return int(shown.count())


def panel_of(nb: Notebook, index: int = 0) -> Any:
    panel = nb.cell(index).locator(".widget-vbox").first
    panel.wait_for()
    return panel


def status_of(panel: Any) -> Any:
    """The status line: the panel's first HTML widget of its own (the table is the second)."""
    return panel.locator(":scope > .widget-html").nth(0)


def button(panel: Any, label: str) -> Any:
    return panel.locator(".widget-button").get_by_text(label, exact=True)


def field(panel: Any, label: str, kind: str = "input") -> Any:
    return (
        panel.locator(".widget-inline-hbox")
        .filter(has=panel.page.locator(".widget-label").get_by_text(label, exact=True))
        .locator(kind)
    )


def limit_line(panel: Any) -> str:
    return str(panel.locator(".widget-html").filter(has_text="limit:").inner_text())


# -- 1. the panel in both themes ------------------------------------------------------------------
@pytest.mark.parametrize("theme", [LIGHT, DARK], ids=slug)
def test_the_panel_draws_and_reads_in_the_theme(
    page: Any, lab: LabServer, request: pytest.FixtureRequest, theme: str
) -> None:
    nb = open_in(page, lab, "panel.ipynb", theme)
    nb.run_cell(0)
    panel = panel_of(nb)
    status = status_of(panel)
    rows = panel.locator("table.memlab-runs tr")
    assert images_drawn(panel) == 0  # nothing drawn yet, and no broken-image icon either
    assert not panel.evaluate(LAYOUT_JS), panel.evaluate(LAYOUT_JS)
    mode, ranks = field(panel, "mode", "select"), field(panel, "ranks (GPUs)")
    shown = lambda label, kind="input": field(panel, label, kind).is_visible()  # noqa: E731
    assert not shown("new tokens")  # generating only
    mode.select_option("generate")  # the training step's controls go, new tokens comes
    wait_for("new tokens", lambda: shown("new tokens"), 5)
    wait_for("the optimizer hidden", lambda: not shown("optimizer", "select"), 5)
    wait_for("ranks hidden", lambda: not ranks.is_visible(), 5)
    assert not panel.evaluate(LAYOUT_JS), panel.evaluate(LAYOUT_JS)
    mode.select_option("train")
    wait_for("the optimizer", lambda: shown("optimizer", "select"), 5)
    wait_for("new tokens hidden", lambda: not shown("new tokens"), 5)
    assert not shown("sharding", "select")  # one rank: nothing to share
    ranks.fill("4")
    ranks.press("Enter")
    wait_for("sharding", lambda: shown("sharding", "select"), 5)
    assert not panel.evaluate(LAYOUT_JS), panel.evaluate(LAYOUT_JS)
    ranks.fill("1")
    ranks.press("Enter")
    wait_for("sharding hidden", lambda: not shown("sharding", "select"), 5)

    for expect_rows in (2, 3):  # two runs: batch 32, then batch 64
        if expect_rows == 3:
            field(panel, "batch size").fill("64")
            field(panel, "batch size").press("Enter")
        button(panel, "Run").click()
        wait_for(f"{expect_rows - 1} runs", lambda n=expect_rows: rows.count() == n, 60)
        wait_for("the run to end", lambda: "ran " in status.inner_text(), 30)
        wait_for("Run enabled again", button(panel, "Run").is_enabled, 30)
        wait_for("Cancel hidden", lambda: not button(panel, "Cancel").is_visible(), 5)
    assert [rows.nth(i).locator("td").nth(1).inner_text() for i in (1, 2)] == [
        "train, batch 32, adam",
        "train, batch 64, adam",
    ]
    table = panel.locator(".memlab-comparison")
    head = table.locator("table.memlab-runs tr").first.inner_text()
    assert "before the step" in head
    said = "before the step: what was allocated when the measured step began"
    assert said in table.inner_text()  # the note under it
    assert images_drawn(panel) == 2  # the bars and the timeline
    area = nb.cell(0).locator(".jp-OutputArea-output").first.bounding_box()
    assert area is not None
    MEASURED.setdefault("overflow", [])
    for img in panel.locator("img:visible").all():
        box = img.bounding_box()
        assert box is not None and box["width"] > 200 and box["height"] > 100, box
        past = box["x"] + box["width"] - (area["x"] + area["width"])
        if past > 1:
            MEASURED.setdefault("overflow", []).append(
                f"{theme}: an image {box['width']:.0f} px wide ends {past:.0f} px past the "
                f"output area's right edge ({area['width']:.0f} px wide)"
            )

    # the status line and every header and note of the frame read on the theme's background
    said = texts(status)
    assert said and not unreadable(said), unreadable(said)
    limit = texts(panel.locator(".widget-html").filter(has_text="limit:"))
    assert limit and not unreadable(limit), unreadable(limit)
    least_contrast(f"{theme}: the status line", said)
    least_contrast(f"{theme}: the limit line", limit)
    MEASURED.setdefault("faint figures", []).extend(check_frames_readable(panel))
    keep(panel, f"product-panel-{slug(theme)}.png", request)


# -- 2. progress, Cancel and a free kernel --------------------------------------------------------
def test_the_search_shows_progress_keeps_the_kernel_free_and_cancels(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    nb = open_in(page, lab, "slow.ipynb")
    nb.run_cell(0)
    panel = panel_of(nb)
    status = status_of(panel)
    run, cancel = button(panel, "Run"), button(panel, "Cancel")
    assert run.is_enabled() and not cancel.is_visible()

    button(panel, "Largest batch that fits").click()
    elapsed = re.compile(r"trying [\d,]+ .*· (\d+\.\d) s")
    seen: list[float] = []

    def ticking() -> bool:
        found = elapsed.search(status.inner_text())
        if found and (not seen or float(found.group(1)) != seen[-1]):
            seen.append(float(found.group(1)))
        return len(seen) >= 3

    wait_for("the status line to tick while trying batches", ticking, 20, poll=0.1)
    assert seen == sorted(seen) and seen[-1] > seen[0], seen
    assert run.is_disabled() and button(panel, "Largest batch that fits").is_disabled()
    assert cancel.is_visible() and cancel.is_enabled()
    keep(panel, "product-search-progress.png", request)

    # the kernel answers another cell while the search runs
    nb.run_cell(1, timeout=15)
    assert nb.output_text(1).strip().endswith("2")
    assert cancel.is_visible(), "the search ended before Cancel could be tried: make it slower"
    # past the first tries (the first step carries the process's one-time costs: seconds on a
    # loaded machine), Cancel acts within the try under way
    wait_for("a batch found to fit", lambda: re.search(r"fits: [\d,]+", status.inner_text()), 30)
    assert cancel.is_visible(), "the search ended before Cancel could be tried: make it slower"

    cancel.click()
    clicked = time.monotonic()
    wait_for("the search to stop", lambda: "cancelled" in status.inner_text(), 10)
    assert time.monotonic() - clicked < 5
    wait_for("Run enabled again", run.is_enabled, 5)
    wait_for("Cancel hidden", lambda: not cancel.is_visible(), 5)
    assert "largest" in status.inner_text()  # what was found so far, or that nothing fits
    assert not nb.errors()
    keep(panel, "product-search-cancelled.png", request)


# -- 3. the budget a simulated GPU fills in -------------------------------------------------------
def test_a_simulated_gpu_fills_the_budget_unless_one_was_typed(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    from memlab.estimate import GPUS

    t4 = round(GPUS["T4"].usable / 1024**2, 1)
    nb = open_in(page, lab, "budget.ipynb")
    nb.run_cell(0)
    panel = panel_of(nb)
    budget, simulate = field(panel, "budget (MiB)"), field(panel, "simulate a GPU", "select")
    assert float(budget.input_value() or 0) == 0
    assert "limit: none" in limit_line(panel)

    simulate.select_option("T4")
    wait_for("the budget to follow the T4", lambda: float(budget.input_value() or 0) > 0, 10)
    shown = budget.input_value()
    assert re.fullmatch(r"\d+(\.\d)?", shown), shown  # rounded for people
    assert float(shown) == t4
    wait_for("the limit line", lambda: "the simulated T4" in limit_line(panel), 5)
    keep(panel, "product-budget-t4.png", request)

    # measuring here again empties the budget the T4 filled in
    simulate.select_option("no: measure here")
    wait_for("the budget to empty", lambda: float(budget.input_value() or 0) == 0, 10)
    wait_for("no limit", lambda: "limit: none" in limit_line(panel), 5)

    # a budget typed first stays when a GPU is chosen, and the line says whose it is
    budget.fill("500")
    budget.press("Enter")
    wait_for("the typed budget", lambda: "your budget" in limit_line(panel), 5)
    simulate.select_option("T4")
    time.sleep(1)  # what a T4 would fill in would have arrived by now
    assert float(budget.input_value()) == 500
    line = limit_line(panel)
    assert "your budget" in line and "500 MiB" in line and "simulated" not in line, line
    keep(panel, "product-budget-typed.png", request)


# -- 4. a loss that needs targets -----------------------------------------------------------------
def test_a_loss_with_targets_runs_through_step_fn(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    nb = open_in(page, lab, "targets.ipynb")
    nb.run_all()
    assert not nb.errors() and not nb.stderr(), nb.stderr()
    report = nb.cell(0).locator(".memlab")
    assert report.count() == 1
    assert "train, batch 16, adam" in report.inner_text()

    panel = panel_of(nb, 1)
    rows = panel.locator("table.memlab-runs tr")
    button(panel, "Run").click()
    wait_for("a run in the table", lambda: rows.count() == 2, 60)
    wait_for("the run to end", lambda: "ran " in status_of(panel).inner_text(), 30)
    wait_for("Run enabled again", button(panel, "Run").is_enabled, 30)
    assert "Error" not in status_of(panel).inner_text()
    assert images_drawn(panel) == 2  # the bars and the timeline
    assert rows.nth(1).locator("td").nth(2).get_attribute("title")  # a peak, in exact bytes
    assert rows.nth(1).locator("td").last.inner_text().strip() == ""  # no verdict: it ran
    assert not nb.errors() and not nb.stderr(), nb.stderr()
    keep(nb.cell(0).locator(".jp-OutputArea"), "product-targets-run.png", request)
    keep(panel, "product-targets-panel.png", request)


def test_the_readmes_memlab_whatif_run_works_after_import_memlab() -> None:
    """The README calls ``memlab.whatif.run(...)`` with only ``import memlab`` in sight."""
    code = "import memlab; memlab.whatif.run"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]


# -- 5. the report and a real model's graph in the dark theme -------------------------------------
def test_the_report_and_a_real_models_graph_read_in_the_dark_theme(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    nb = open_in(page, lab, "real.ipynb", DARK)
    nb.run_all(timeout=180)
    assert not nb.errors(), nb.errors()

    report = nb.cell(1)
    assert report.locator(".memlab-report").count() == 1
    assert images_drawn(report) == 1  # the timeline
    MEASURED.setdefault("faint figures", []).extend(check_frames_readable(report))
    keep(report.locator(".jp-OutputArea"), "product-report-dark.png", request)

    for index, name in ((2, "product-graph-dark.png"), (3, "product-graph-modules-dark.png")):
        graph = nb.cell(index)
        svg = graph.locator(".jp-OutputArea svg").first
        box = svg.bounding_box()
        assert box is not None and box["width"] > 100 and box["height"] > 100
        drawn = texts(svg)
        assert drawn and not unreadable(drawn), unreadable(drawn)
        least_contrast(f"{DARK}: {name}'s SVG", drawn)
        MEASURED.setdefault("faint figures", []).extend(check_frames_readable(graph))
        MEASURED.setdefault("graph text px", []).append((name, svg.evaluate(SVG_TEXT_PX_JS)))
        keep(graph.locator(".jp-OutputArea"), name, request)


def preflight_shown(
    page: Any, lab: LabServer, request: pytest.FixtureRequest, name: str
) -> dict[str, str]:
    """Runs the pre-flight notebook ``name`` once, in the light theme, then reads its report in
    each theme (the dark one switched to from JupyterLab's Settings menu, the report left where
    it is): checks its frames read on each, keeps a screenshot of each
    (product-<name>-<theme>.png) and returns each theme's text of the report."""
    nb = open_in(page, lab, f"{name}.ipynb", LIGHT)
    nb.run_all(timeout=180)
    assert not nb.errors(), nb.errors()
    shown: dict[str, str] = {}
    for theme in (LIGHT, DARK):
        if theme != LIGHT:
            switch_theme(page, theme)
        out = nb.cell(1).locator(".jp-OutputArea")
        shown[theme] = out.inner_text()
        MEASURED.setdefault("faint figures", []).extend(check_frames_readable(nb.cell(1)))
        keep(out, f"product-{name}-{slug(theme)}.png", request)
    return shown


def switch_theme(page: Any, theme: str) -> None:
    """Settings > Theme > ``theme``, as a reader switches it, on the open page."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").click()
    page.locator(".lm-Menu-itemLabel", has_text="Theme").first.hover()
    page.locator(".lm-Menu-itemLabel", has_text=theme).first.click()
    page.locator(f'body[data-jp-theme-name="{theme}"]').wait_for(state="attached", timeout=30_000)
    page.keyboard.press("Escape")  # (a menu left open would be in the picture)


def test_a_pre_flight_that_would_not_fit_reads_in_both_themes(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    for theme, shown in preflight_shown(page, lab, request, "preflight").items():
        assert "would run OUT OF MEMORY at line 4" in shown, (theme, shown)
        assert "net(x).sum().backward()" in shown and "fits" in shown  # the line, the levers


def test_a_pre_flight_without_a_verdict_says_so_in_both_themes(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    for theme, shown in preflight_shown(page, lab, request, "preflight-lost").items():
        assert "NO VERDICT: memlab lost track of 1 of this cell" in shown, (theme, shown)
        assert "the replay's own bug" in shown  # the report's notes say why
        assert ": fits" not in shown


# -- problems once seen, measured above -----------------------------------------------------------
def measured(key: str) -> list[Any]:
    if key not in MEASURED:  # the test that measures it did not run, or failed first
        pytest.skip(f"nothing measured for {key!r}: run the whole file")
    return MEASURED[key]


def test_the_panels_pictures_fit_the_output_area() -> None:
    assert not measured("overflow"), measured("overflow")


def test_coloured_figures_read_in_the_dark_theme() -> None:
    assert not measured("faint figures"), measured("faint figures")


def test_no_nested_brackets_in_reports() -> None:
    assert not measured("nested brackets"), measured("nested brackets")


def test_a_real_models_graph_labels_are_large_enough() -> None:
    sizes = measured("graph text px")
    assert sizes
    small = [(name, px) for name, px in sizes if px["median"] < MIN_TEXT_PX]
    assert not small, small
