"""Shared fixtures: a real in-process IPython shell that records what it displays, golden files."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/* from the current output (review the diff before committing)",
    )
    parser.addoption(
        "--update-screenshots",
        action="store_true",
        help="copy the browser tests' screenshots to docs/screenshots/ (the README shows them)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test item, so fixtures can tell a failed test at teardown
    (the browser tests save a screenshot and the server log then)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the tests selected (after -k, -m and --deselect) need the Binder environment, its
    build starts now, in a process of its own, so that the other tests run meanwhile and no
    worker waits idle for it (pytest-xdist runs those modules about halfway through)."""
    needs = any("binder_env" in getattr(item, "fixturenames", ()) for item in session.items)
    if needs and not session.config.option.collectonly:
        from binder_env import start

        start(_shared(session.config))
    # the type check too, where selected: in the time the workers leave a core idle
    import types_early

    typed = any(item.nodeid.endswith(types_early.TEST) for item in session.items)
    if typed and not session.config.option.collectonly:
        types_early.start(_shared(session.config))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # (the controller: every worker is done)
        import types_early
        from binder_env import stop

        stop(_shared(session.config))
        types_early.stop(_shared(session.config))


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: each torch one thread, not two that wait for a core (OpenMP
    # threads spin while they wait, and an oversubscribed step can take many times as long).
    # The processes the tests start (kernels, ranks, scripts) too, unless told otherwise.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def native_record_ready() -> None:
    """memlab builds its native record on a thread of its own where a cell would otherwise wait;
    the tests wait for it once, so that every region is measured the same way from the first
    (and for the breakdown's hooks in C, built after it: tests of the op they replace say so)."""
    from memlab.core import native
    from memlab.core.native import pack

    if native.unavailable() is None:
        pack.wait()


@pytest.fixture(autouse=True)
def fresh_ledger(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test gets its own process ledger, so tensors an earlier test left alive (pytest keeps
    failed tests' frames) don't show up in its figures."""
    from memlab.core import ledger

    fresh = ledger.Ledger()
    monkeypatch.setattr(ledger, "_DEFAULT", fresh)
    return fresh


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Any:
    """``golden(name, text)``: compare with tests/golden/name; --update-golden rewrites it."""

    def check(name: str, text: str) -> None:
        path = GOLDEN / name
        if request.config.getoption("--update-golden"):
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            return
        assert path.exists(), f"{path} is missing: run pytest --update-golden and review it"
        assert text == path.read_text(), f"{name} differs from its golden file"

    return check


def dispatch_modes() -> int:
    return int(torch._C._len_torch_dispatch_stack())


def saved_tensor_hooks() -> int:
    """1 when default saved-tensor hooks are installed. PyTorch before 2.5 cannot tell: 0."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return 0 if top is None else int(top(False) is not None)


def hooks_installed() -> dict[str, int]:
    """Every global hook or mode memlab could leave behind, counted."""
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    return {
        "dispatch modes": dispatch_modes(),
        "saved-tensor hooks": saved_tensor_hooks(),
        "module forward pre-hooks": len(m._global_forward_pre_hooks),
        "module forward hooks": len(m._global_forward_hooks),
        "optimizer pre-hooks": len(o._global_optimizer_pre_hooks),
        "optimizer post-hooks": len(o._global_optimizer_post_hooks),
    }


NOTHING_INSTALLED = {
    "dispatch modes": 0,
    "saved-tensor hooks": 0,
    "module forward pre-hooks": 0,
    "module forward hooks": 0,
    "optimizer pre-hooks": 0,
    "optimizer post-hooks": 0,
}


class Recorded:
    """What the shell displayed, in order: each item is (kind, mime bundle)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []

    def clear(self) -> None:
        self.items.clear()

    def html(self) -> list[str]:
        return [d["text/html"] for _, d in self.items if "text/html" in d]

    def kinds(self) -> list[str]:
        return [k for k, _ in self.items]

    def reports(self) -> list[str]:
        return [h for h in self.html() if "memlab-report" in h]


@pytest.fixture(scope="session")
def _shell() -> Iterator[tuple[Any, Recorded]]:
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    rec = Recorded()

    class Publisher(DisplayPublisher):
        def publish(self, data: Any, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
            rec.items.append(("display", dict(data)))

    class Hook(DisplayHook):
        def write_output_prompt(self) -> None:
            pass

        def write_format_data(self, format_dict: Any, md_dict: Any = None) -> None:
            rec.items.append(("out", dict(format_dict)))

        def finish_displayhook(self) -> None:
            pass

    shell = InteractiveShell.instance()
    shell.display_pub = Publisher(shell=shell)
    hook = Hook(shell=shell, cache_size=1000)
    shell.displayhook = hook
    shell.display_trap.hook = hook
    shell.run_line_magic("load_ext", "memlab")
    yield shell, rec
    shell.run_line_magic("unload_ext", "memlab")


@pytest.fixture
def ip(_shell: tuple[Any, Recorded]) -> Iterator[Any]:
    """A clean shell with memlab loaded; ``ip.rec`` holds what it displayed."""
    shell, rec = _shell
    shell.reset(new_session=False)
    shell._memlab_magics.history.clear()
    shell._memlab_magics.auto_off()
    rec.clear()
    shell.rec = rec
    shell.run_cell("import torch", store_history=True)
    rec.clear()
    yield shell
    shell._memlab_magics.auto_off()
    assert hooks_installed() == NOTHING_INSTALLED


#: A decoder small enough for a test's step in a second, with grouped-query attention (4 query
#: heads, 2 key/value heads): a Hugging Face config's keyword arguments (Llama, Qwen2, Mistral).
TINY_DECODER: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def bounded(fn: Any, seconds: float = 60) -> Any:
    """``fn()`` in a thread; a hang fails the test instead of the run."""
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def run(ip: Any, source: str) -> Any:
    """Run a cell as a notebook would (stored in history, so Out[n] and _ work)."""
    return ip.run_cell(source, store_history=True)


def _shared(config: pytest.Config) -> Path:
    """The folder every worker of this session sees (without pytest-xdist, its own base)."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return Path(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(scope="session")
def binder_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The Binder environment's variables (tests/binder_env.py), built once a session, in the
    folder the workers share: by the process `pytest_collection_finish` started, or by the first
    test that needs it before that process takes the lock, while the others wait."""
    from binder_env import BuildError, ready

    try:
        return ready(_shared(request.config))
    except BuildError as e:
        pytest.fail(f"the Binder environment did not build:\n{e}")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium for the browser tests (one per test module)."""
    from jupyterlab_driver import chromium

    try:
        yield from chromium(tmp_path_factory.mktemp("chromium"))
    except RuntimeError as e:  # Chromium missing: a failure that says how to get it
        pytest.fail(str(e))


@pytest.fixture
def route(request: pytest.FixtureRequest) -> Iterator[str]:
    """The route the native record follows ops by, forced for the test (parametrized
    indirectly: "dispatch key" or "RecordFunction", as on a PyTorch without the key)."""
    from memlab.core import native

    lib = native.library()
    assert lib is not None
    lib.mn_prefer_records(int(request.param == "RecordFunction"))
    yield request.param
    lib.mn_prefer_records(0)
