"""memlab as a user sees it: a real JupyterLab, driven in headless Chromium.

One JupyterLab server serves a temporary folder holding small notebooks written here and copies
of the course notebooks (outputs stripped). Each test opens a notebook in a fresh page,
runs cells the way a user does (Run All, Shift+Enter, clicking widgets) and checks what the page
shows. On failure a screenshot and the server's log land in tests/artifacts/browser/ and the log's
tail is printed; on success a few screenshots land there too (``--update-screenshots`` copies
them to docs/screenshots/, which the README shows).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyterlab_driver import (
    DONE_PROMPT,
    LabServer,
    Notebook,
    notebook,
    wait_for,
    watched_page,
)

from memlab.reports.frame import GROW

ROOT = Path(__file__).parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts" / "browser"
SCREENSHOTS = ROOT / "docs" / "screenshots"
#: The teaching notebooks (01-…, 02-…). The 00-* tours of the tools run in the Binder
#: environment by nbconvert (tests/test_binder.py); here the tools themselves are driven by the
#: tests above.
COURSE = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.startswith("00-"))

pytestmark = [pytest.mark.browser, pytest.mark.slow]


# -- the notebooks the tests drive ---------------------------------------------------------------
MAGIC = (
    "%load_ext memlab\nimport torch",
    "%%gpumem -o rep four million bytes\n"
    "x = torch.empty(1000, 1000)\n"
    'print("the cell\'s own output")\n'
    "x.shape",
    '%%gpumem\ny = torch.ones(10)\nraise ValueError("boom from the cell")',
    "%gpumem_history",
)

PANEL = (
    """%load_ext memlab
import json
import torch
from torch import nn
import memlab
from memlab.whatif import RunConfig, run

def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])

def input_fn(batch):
    if batch == 3:
        raise ValueError("this input_fn refuses a batch of 3")
    return torch.randn(batch, 256)

explorer = memlab.Explorer(model_fn, input_fn, config=RunConfig(device="cpu", batch_size=16))
explorer""",
    # what the same configurations give through the Python API, for the test to compare
    """base = RunConfig(device="cpu", batch_size=16)
changes = [{}, {"amp": "bf16", "checkpoint": "auto"}, {"retention": "detached"},
           {"mode": "no_grad"}]
print(json.dumps([run(model_fn, input_fn, None, base.with_(**c)).peak for c in changes]))""",
)

GRAPH = (
    """%load_ext memlab
import torch
from torch import nn
import memlab
from memlab.reports.units import fmt_bytes

torch.manual_seed(0)
model = nn.Sequential(
    nn.Sequential(nn.Linear(64, 128), nn.ReLU()),
    nn.Sequential(nn.Linear(128, 128), nn.Tanh()),
    nn.Linear(128, 10),
)
g = memlab.graph(model, torch.randn(32, 64))
g""",
    "g.view(depth=1)",
    "import json\n"
    "kinds = dict(g.module_types)  # a box reads '0 (Sequential)'\n"
    "print(json.dumps({'nodes': [f'{n.op} {fmt_bytes(n.bytes)}' for n in g.nodes if n.bytes],\n"
    "                  'modules': [[f'{k} ({kinds[k]})',\n"
    "                               f\"{c} node{'s' * (c != 1)} · {fmt_bytes(b)}\"]\n"
    "                              for k, (b, c) in g.by_module(1).items() if k]}))",
)


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lab(
    tmp_path_factory: pytest.TempPathFactory, binder_env: dict[str, str]
) -> Iterator[LabServer]:
    """JupyterLab served from the Binder environment (tests/binder_env.py): the course runs
    where a reader on Binder runs it."""
    root = tmp_path_factory.mktemp("lab-root")
    notebook(root / "magic.ipynb", *MAGIC)
    notebook(root / "panel.ipynb", *PANEL)
    notebook(root / "graph.ipynb", *GRAPH)
    for path in COURSE:  # the course, as a reader gets it before running anything
        nb = nbformat.read(path, as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                c.outputs, c.execution_count = [], None
                # Solutions are collapsed for readers; a collapsed cell shows no prompt, and the
                # prompts are how the test sees that every cell ran, so open them here.
                c.metadata.get("jupyter", {}).pop("source_hidden", None)
        nbformat.write(nb, root / path.name)
    for folder in ("solutions", "data"):
        if (ROOT / "notebooks" / folder).is_dir():
            shutil.copytree(ROOT / "notebooks" / folder, root / folder)
    server = LabServer(root, tmp_path_factory.mktemp("lab-home"), binder_env)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def page(browser: Any, lab: LabServer, request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from watched_page(browser, lab, request.node, ARTIFACTS, "")


def keep(element: Any, name: str, request: pytest.FixtureRequest) -> None:
    """A screenshot of what the user sees, for the README (see --update-screenshots)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    element.scroll_into_view_if_needed()
    element.screenshot(path=str(ARTIFACTS / name))
    if request.config.getoption("--update-screenshots"):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(ARTIFACTS / name, SCREENSHOTS / name)


def rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


# -- %%gpumem -------------------------------------------------------------------------------------
def test_the_report_renders_under_the_cell_with_the_bytes_it_allocated(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    nb = Notebook(page, lab, "magic.ipynb").open()
    nb.run_cell(0)
    nb.run_cell(1)
    cell = nb.cell(1)
    text = nb.output_text(1)
    # the cell's own output is still there, above the report: its print, then its Out
    assert "the cell's own output" in text
    assert "torch.Size([1000, 1000])" in text
    assert text.index("torch.Size") < text.index("memlab")
    report = cell.locator(".memlab-report")
    assert report.count() == 1
    assert "four million bytes" in report.inner_text()
    # 1000 × 1000 float32 is 4,000,000 B: shown as +3.81 MiB, exact on hover, in growth colour
    exact = report.locator('td[title="4,000,000 B"]')
    assert exact.all_inner_texts() == ["3.81 MiB", "+3.81 MiB", "3.81 MiB", "+3.81 MiB"]
    change = exact.nth(1)  # after, change, peak, peak − before
    assert change.evaluate("e => getComputedStyle(e).color") == rgb(GROW)
    keep(cell, "magic-report.png", request)

    # an exception: the report, then the traceback, both under the cell
    nb.run_cell(2)
    cell = nb.cell(2)
    assert cell.locator(".memlab-report").count() == 1
    assert "raised ValueError" in cell.locator(".memlab-report").inner_text()
    errors = nb.errors()
    assert len(errors) == 1 and "ValueError: boom from the cell" in errors[0]
    text = nb.output_text(2)
    assert text.index("memlab") < text.index("boom from the cell")

    # the history: a table of both tracked cells and a plot that was drawn
    nb.run_cell(3)
    cell = nb.cell(3)
    assert "four million bytes" in cell.inner_text()
    image = cell.locator("img").first
    wait_for("the history plot to load", lambda: image.evaluate("i => i.naturalWidth") > 0, 10)
    keep(cell, "magic-history.png", request)


# -- the what-if panel ----------------------------------------------------------------------------
def toggle(panel: Any, group: str, option: str) -> None:
    box = panel.locator(".widget-toggle-buttons").filter(
        has=panel.page.locator(".widget-label").get_by_text(group, exact=True)
    )
    button = box.locator(".widget-toggle-button").get_by_text(option, exact=True)
    button.click()
    active = lambda: "mod-active" in (button.get_attribute("class") or "")  # noqa: E731
    wait_for(f"{group} = {option}", active, 5)


def choose(panel: Any, label: str, option: str) -> None:
    select = (
        panel.locator(".widget-dropdown")
        .filter(has=panel.page.locator(".widget-label").get_by_text(label, exact=True))
        .locator("select")
    )
    select.select_option(label=option)
    wait_for(
        f"{label} = {option}",
        lambda: select.evaluate("s => s.selectedOptions[0].text") == option,
        5,
    )


def set_number(panel: Any, label: str, value: int) -> None:
    field = (
        panel.locator(".widget-inline-hbox")
        .filter(has=panel.page.locator(".widget-label").get_by_text(label, exact=True))
        .locator("input")
    )
    field.fill(str(value))
    field.press("Enter")


def test_the_panel_compares_runs_with_the_python_apis_numbers(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    nb = Notebook(page, lab, "panel.ipynb").open()
    nb.run_cell(0)
    panel = nb.cell(0).locator(".widget-vbox").first
    panel.wait_for()
    rows = panel.locator("table.memlab-runs tr")
    chart = panel.locator(".widget-image").first
    status = panel.locator(".memlab-status").first

    def press_run(expect_rows: int) -> None:
        before = chart.get_attribute("src")
        panel.locator(".widget-button").get_by_text("Run", exact=True).click()
        wait_for(f"{expect_rows - 1} runs in the table", lambda: rows.count() == expect_rows, 60)
        wait_for("the chart to redraw", lambda: chart.get_attribute("src") != before, 10)
        wait_for("the chart to load", lambda: chart.evaluate("i => i.naturalWidth") > 0, 10)

    press_run(2)  # the baseline
    toggle(panel, "AMP", "bf16")
    toggle(panel, "checkpointing", "auto")
    press_run(3)
    toggle(panel, "AMP", "off")
    toggle(panel, "checkpointing", "off")
    toggle(panel, "keep outputs", "detached")
    press_run(4)
    toggle(panel, "keep outputs", "off")
    choose(panel, "mode", "no_grad")
    press_run(5)
    described = [rows.nth(i).locator("td").nth(1).inner_text() for i in range(1, 5)]
    assert described == [
        "train, batch 16, adam",
        "train, amp bf16, checkpoint auto, batch 16, adam",
        "detached outputs, batch 16",
        "no_grad, batch 16",
    ]
    shown = [rows.nth(i).locator("td").nth(2).get_attribute("title") for i in range(1, 5)]

    # the same four configurations through memlab.whatif.run, in the same kernel
    nb.run_cell(1)
    expected = json.loads(nb.output_text(1).strip().splitlines()[-1])
    assert shown == [f"{n:,} B" for n in expected]
    keep(panel, "panel.png", request)

    # a factory that raises: the message shows in the panel, no row is added, and it goes on
    choose(panel, "mode", "train")
    set_number(panel, "batch size", 3)
    panel.locator(".widget-button").get_by_text("Run", exact=True).click()
    wait_for("the error in the panel", lambda: "refuses a batch of 3" in status.inner_text(), 30)
    assert rows.count() == 5
    assert not nb.errors()  # shown in the panel, not as a traceback somewhere else
    set_number(panel, "batch size", 16)
    press_run(6)
    assert rows.nth(5).locator("td").nth(2).get_attribute("title") == shown[0]


# -- annotated graphs -----------------------------------------------------------------------------
def svg_texts(element: Any) -> list[str]:
    return [t.strip() for t in element.locator("svg text").all_text_contents()]


def test_the_graph_draws_with_byte_labels_and_a_module_view(
    page: Any, lab: LabServer, request: pytest.FixtureRequest
) -> None:
    nb = Notebook(page, lab, "graph.ipynb").open()
    nb.run_all()
    assert not nb.errors()
    expected = json.loads(nb.output_text(2).strip().splitlines()[-1])
    graph, view = nb.cell(0), nb.cell(1)

    svg = graph.locator("svg").first
    box = svg.bounding_box()
    assert box is not None and box["width"] > 100 and box["height"] > 100  # drawn, not empty
    texts = " ".join(svg_texts(graph))
    assert expected["nodes"]
    for label in expected["nodes"]:  # each node: its op, then the bytes it saved
        op, size = label.split(" ", 1)
        assert f"{op} {size}" in texts, label
    assert graph.locator("svg title").count() > 0  # hover text survives the front end
    assert graph.locator(".memlab-graph-table").count() == 1
    assert "saved for backward" in nb.output_text(0)
    keep(graph, "graph.png", request)

    texts = " ".join(svg_texts(view))
    assert view.locator("svg").first.bounding_box()["width"] > 50
    assert len(expected["modules"]) == 3
    for name, line in expected["modules"]:  # one box per module: its name, nodes and bytes
        assert f"{name} {line}" in texts, (name, line, texts)
    keep(view, "graph-modules.png", request)


# -- the course -----------------------------------------------------------------------------------
#: Notebooks in flight at once. Much of a notebook's time in the browser is the page loading and
#: the kernel starting, which overlap well with another notebook's cells even on two cores.
AT_ONCE = 3
COURSE_TIMEOUT = 300
#: A page still not ready to run this long after it was opened is loaded once more (a first page
#: can stay blank while the server settles); its deadline starts again then.
REOPEN_AFTER = 120


@pytest.fixture(scope="module")
def course_runs(browser: Any, lab: LabServer) -> dict[str, str | None]:
    """Run All on every course notebook, a few at a time, each in its own page.

    Maps each notebook to None when it ran to the end cleanly, else to what went wrong; a failed
    notebook leaves its screenshot and browser console in tests/artifacts/browser/.
    """

    class Flight:
        def __init__(self, path: Path) -> None:
            self.console: list[str] = []
            page = browser.new_page()
            page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: self.console.append(f"page error: {e}"))
            self.nb = Notebook(page, lab, path.name)
            self.started = self.reopened = False
            self.opened = time.monotonic()
            self.deadline = self.opened + COURSE_TIMEOUT
            self.nb.navigate()

    waiting = list(COURSE)
    flights: dict[str, Flight] = {}
    outcome: dict[str, str | None] = {}

    def land(name: str, problem: str | None) -> None:
        flight = flights.pop(name)
        outcome[name] = problem
        if problem is not None:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            flight.nb.page.screenshot(path=str(ARTIFACTS / f"course-{name}.png"), full_page=True)
            (ARTIFACTS / f"course-{name}.console.log").write_text("\n".join(flight.console))
        flight.nb.page.close()

    def check(name: str, flight: Flight) -> None:
        nb = flight.nb
        if not flight.started:
            if nb.ready():
                nb.start_run_all()
                flight.started = True
            elif not flight.reopened and time.monotonic() - flight.opened > REOPEN_AFTER:
                flight.reopened = True
                flight.console.append(f"not ready after {REOPEN_AFTER} s: loaded again")
                flight.deadline = time.monotonic() + COURSE_TIMEOUT
                nb.navigate()
        elif nb.finished():
            time.sleep(0.3)  # outputs can land just after the last prompt changes
            errors, prompts = nb.errors(), nb.prompts()
            if errors:
                land(name, f"a cell raised:\n{errors[0]}")
            elif not prompts or not all(DONE_PROMPT.match(p) for p in prompts):
                land(name, f"not every cell ran: {prompts}")
            else:
                land(name, None)
            return
        if time.monotonic() > flight.deadline:
            state = "running" if flight.started else "opening"
            land(name, f"still {state} after {COURSE_TIMEOUT} s; prompts: {nb.prompts()}")

    while waiting or flights:
        while waiting and len(flights) < AT_ONCE:
            path = waiting.pop(0)
            flights[path.name] = Flight(path)
        for name, flight in list(flights.items()):
            try:
                check(name, flight)
            except Exception as e:  # reported by the notebook's own test
                land(name, f"the page failed: {e!r}")
        time.sleep(0.25)
    lab.shutdown_kernels()
    return outcome


@pytest.mark.parametrize("path", COURSE, ids=[p.stem for p in COURSE])
def test_notebook_runs_to_the_end_in_the_browser(
    course_runs: dict[str, str | None], lab: LabServer, path: Path
) -> None:
    problem = course_runs[path.name]
    if problem is not None:
        print(f"server log ({lab.log_path}), last lines:\n{lab.log(3000)}")
        pytest.fail(f"{path.name}: {problem} (screenshot: {ARTIFACTS}/course-{path.name}.png)")
