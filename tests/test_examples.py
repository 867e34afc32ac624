"""The model zoo (memlab.examples): one home for the models and cases that tests, benchmarks and
notebooks share. Tests take them from there and never import or load anything from benchmarks/
(running a benchmark script as a process of its own is fine)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memlab.estimate.trace import read
from memlab.examples import GPT, resnet18, resnet50
from memlab.examples.cases import CONFIGS, MODELS, OPTIONAL, RUNS, case_file, config, every_model

TESTS = Path(__file__).parent
BENCHMARKS = TESTS.parent / "benchmarks"
DATA = TESTS / "data"

# -- tests never import benchmarks/ ------------------------------------------------------------
#: Module names that resolve to benchmarks/ (the package, or a script put on sys.path).
BENCHMARK_MODULES = {"benchmarks"} | {p.stem for p in BENCHMARKS.glob("*.py")}
#: Calls that import or execute Python from a module name or a file.
LOADERS = {
    "spec_from_file_location",
    "SourceFileLoader",
    "import_module",
    "__import__",
    "run_path",
    "run_module",
    "exec",
    "syspath_prepend",
}


def _mentions(node: ast.AST, tainted: set[str]) -> bool:
    """Whether ``node`` names "benchmarks" in a string, or a name bound to such an expression."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "benchmarks" in n.value:
            return True
        if isinstance(n, ast.Name) and n.id in tainted:
            return True
    return False


def _tainted(tree: ast.AST) -> set[str]:
    """Names bound, anywhere in the module, to an expression that reaches benchmarks/: variables
    assigned from one, and functions that return one."""
    tainted: set[str] = set()
    while True:
        before = len(tainted)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if node.value is not None and _mentions(node.value, tainted):
                    tainted |= {
                        n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)
                    }
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                returns = [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value]
                if any(_mentions(r, tainted) for r in returns):
                    tainted.add(node.name)
        if len(tainted) == before:
            return tainted


def _called(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _is_sys_path(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def benchmark_imports(source: str) -> list[str]:
    """Where ``source`` imports from benchmarks/, loads a file from it, or puts it on sys.path."""
    tree = ast.parse(source)
    tainted = _tainted(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call):
            name = _called(node)
            on_sys_path = (
                isinstance(node.func, ast.Attribute)
                and name in ("insert", "append", "extend")
                and _is_sys_path(node.func.value)
            )
            arguments = [*node.args, *(k.value for k in node.keywords)]
            if (name in LOADERS or on_sys_path) and any(_mentions(a, tainted) for a in arguments):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
            continue
        else:
            continue
        found += [
            f"{node.lineno}: imports {n}" for n in names if n.split(".")[0] in BENCHMARK_MODULES
        ]
    return found


def test_no_test_imports_or_loads_anything_from_benchmarks() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS.parent)
        found += [f"{rel}:{hit}" for hit in benchmark_imports(path.read_text())]
    assert not found, (
        "tests take their models and cases from memlab.examples, not from benchmarks/ "
        "(run a benchmark script with subprocess instead):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "source",
    [
        "import benchmarks.validate_estimator\n",
        "from benchmarks.record_traces import RUNS\n",
        "import sys\nsys.path.insert(0, 'benchmarks')\n",
        "from common import emit\n",
        "def script(name):\n"
        "    path = Path(__file__).parent.parent / 'benchmarks' / f'{name}.py'\n"
        "    spec = importlib.util.spec_from_file_location(name, path)\n",
        "ROOT = Path('.')\nBENCH = ROOT / 'benchmarks'\nrunpy.run_path(str(BENCH / 'x.py'))\n",
        "def where(n):\n    return ROOT / 'benchmarks' / n\nrunpy.run_path(where('x.py'))\n",
        "importlib.import_module('benchmarks.record_traces')\n",
    ],
)
def test_the_check_catches_a_test_that_reaches_into_benchmarks(source: str) -> None:
    assert benchmark_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "SCRIPT = ROOT / 'benchmarks' / 'validate_estimator.py'\n"
        "subprocess.run([sys.executable, str(SCRIPT), '--dry-run'], check=True)\n",
        "from memlab.examples.cases import RUNS\n",
        "importlib.util.find_spec('torchinfo')\n",
    ],
)
def test_the_check_lets_a_test_run_a_benchmark_script(source: str) -> None:
    assert not benchmark_imports(source)


# -- the zoo ----------------------------------------------------------------------------------
def test_importing_the_zoo_imports_torch_and_memlab_only() -> None:
    code = (
        "import json, sys, torch\n"
        "before = set(sys.modules)\n"
        "import memlab.examples, memlab.examples.cases\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "std = set(sys.stdlib_module_names)\n"
        "print(json.dumps({'packages': sorted(m for m in new - std\n"
        "                                     if not m.startswith('_sysconfigdata')),\n"
        "                  'memlab': sorted(m for m in sys.modules if m.startswith('memlab.'))}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(done.stdout)
    # no torchvision, transformers, IPython, ... (``_sysconfigdata_*`` is the standard library's
    # own, loaded by sysconfig, and not in stdlib_module_names)
    assert loaded["packages"] == ["memlab"]
    above = [m for m in loaded["memlab"] if m.split(".")[1] in ("estimate", "panel", "magic")]
    assert not above, above


def test_the_resnets_have_torchvisions_parameter_counts() -> None:
    with torch.device("meta"):
        sizes = [sum(p.numel() for p in m().parameters()) for m in (resnet18, resnet50)]
    assert sizes == [11_689_512, 25_557_032]  # torchvision.models.resnet18 and resnet50


def test_the_gpt_counts_its_parameters_layer_by_layer() -> None:
    vocab, ctx, width, layers = 1000, 128, 128, 2
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(vocab, ctx, width, layers).parameters())
    attention = 4 * width * width + 4 * width  # in-projection (q, k, v) and out-projection
    mlp = 2 * 4 * width * width + 4 * width + width
    norms = 2 * 2 * width
    per_layer = attention + mlp + norms
    assert n == vocab * width + ctx * width + layers * per_layer + 2 * width + width * vocab


def test_every_stored_trace_has_its_case() -> None:
    stored = {read(p)["case"] for p in DATA.glob("trace-*.json.gz")} - {"rules"}
    assert stored == set(RUNS)
    for path in DATA.glob("trace-*.json.gz"):
        trace = read(path)
        if trace["case"] != "rules":  # recorded with the configuration the case has now
            assert trace["config"] == RUNS[trace["case"]].config.describe(), path.name


def test_every_validation_trace_has_its_case() -> None:
    models = every_model()
    assert list(models) == [*MODELS, *(n for named in OPTIONAL.values() for n in named)]
    cases = {case_file(m, n): (m, n) for m in models for n in CONFIGS if config(m, n) is not None}
    files = {p.name.removesuffix(".json.gz"): p for p in (DATA / "validation").glob("*.json.gz")}
    assert set(files) == set(cases) and len(cases) == 69  # ten models, seven configurations
    for name, path in files.items():
        trace = read(path)
        assert (trace["model"], trace["config"]) == cases[name]


def test_a_case_without_blocks_is_not_checkpointed() -> None:
    assert config("lstm", "checkpoint adam") is None
    resnet = config("resnet18", "checkpoint adam")
    assert resnet is not None and resnet.checkpoint == tuple(str(i) for i in range(4, 12))
    assert config("mlp", "amp bf16 adam") == MODELS["mlp"].config("amp bf16 adam")
