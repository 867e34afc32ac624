"""memlab in a real Jupyter kernel: loaded by the lab's IPython config, displays in order."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A kernel whose IPython reads exactly the config scripts/setup.sh installs."""
    from jupyter_client.manager import start_new_kernel

    ipydir = tmp_path_factory.mktemp("ipython")
    (ipydir / "profile_default").mkdir()
    shutil.copy(ROOT / "scripts" / "ipython_config.py", ipydir / "profile_default")
    env = {**os.environ, "IPYTHONDIR": str(ipydir)}
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def execute(kc: Any, code: str) -> tuple[str, list[dict[str, Any]]]:
    msgs: list[dict[str, Any]] = []
    reply = kc.execute_interactive(code, timeout=120, output_hook=msgs.append)
    keep = ("execute_result", "display_data", "stream", "error")
    execute.count = reply["content"].get("execution_count")  # type: ignore[attr-defined]
    return reply["content"]["status"], [m for m in msgs if m["msg_type"] in keep]


@pytest.mark.slow
def test_lab_config_loads_memlab_and_the_report_follows_out(kernel: Any) -> None:
    status, msgs = execute(kernel, "import torch")
    assert status == "ok"
    status, msgs = execute(kernel, "%%gpumem\nx = torch.empty(1000, 1000)\nx.shape")
    assert status == "ok", msgs  # no %load_ext: the config loaded memlab
    kinds = [m["msg_type"] for m in msgs]
    assert kinds == ["execute_result", "display_data"]
    assert "torch.Size([1000, 1000])" in msgs[0]["content"]["data"]["text/plain"]
    assert "+3.81 MiB" in msgs[1]["content"]["data"]["text/html"]
    status, msgs = execute(kernel, "list(Out.values())[-1]")
    assert "1000" in msgs[0]["content"]["data"]["text/plain"]


@pytest.mark.slow
def test_auto_mode_and_errors_in_a_real_kernel(kernel: Any) -> None:
    execute(kernel, "%gpumem_auto on")
    status, msgs = execute(kernel, "y = torch.empty(2000)")
    line = f"memlab [{execute.count}] cpu: "  # type: ignore[attr-defined]
    assert any(line in m["content"].get("data", {}).get("text/plain", "") for m in msgs), msgs
    execute(kernel, "%gpumem_auto off")
    status, msgs = execute(kernel, "%%gpumem\na = 1\nraise ValueError('boom')")
    assert status == "error"
    kinds = [m["msg_type"] for m in msgs]
    assert kinds == ["display_data", "error"]  # the report, then the traceback
    tb = "\n".join(msgs[1]["content"]["traceback"])
    assert "boom" in tb
    status, msgs = execute(kernel, "%%gpumem --bogus\nz = 1")
    assert status == "error" and "unrecognized arguments" in str(msgs)
    status, msgs = execute(kernel, "'z' in dir(), a")
    assert msgs[0]["content"]["data"]["text/plain"] == "(False, 1)"
