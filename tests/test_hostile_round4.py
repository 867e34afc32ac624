"""Hostile input in a real kernel, round 4: the user's own objects running their own code inside
memlab's hooks (an overridden ``parameters()``, a ``grad`` property, an optimizer's ``state``),
memlab failing to build a report after a cell that ran to its end, names in the namespace that
are not strings or whose keys refuse ``repr``, nested tensors, NaN typed into the panel, snapshot
files whose fields overflow or unpack to gigabytes, and arguments ``memlab.track``,
``memlab.graph_of``, ``Graph.view`` and ``%gpumem_auto`` used to misread.

Each case runs one cell and checks what the user sees; every case then checks that the kernel
answers and that memlab left nothing installed. Cases whose code has a meaning without memlab
compare with it (``like_plain``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernel_harness import Kernel, Outcome
from kernel_rounds import Case, Cases, imports_this_checkout, run_case, started
from test_hostile_kernel import (
    SAME,
    SETUP,
    Check,
    clean_traceback,
    escaped,
    like_plain,
    memlab_error,
    raises,
    report,
    shows,
    usage,
    value,
    within,
)

from memlab.core import native

pytestmark = pytest.mark.slow

ROUND4 = r"""
import gzip, itertools, os, pickle, struct, tempfile, warnings
from memlab.core.accounting import Accountant
from memlab.snapshot import tap as _tap
warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")

class NoParams(nn.Module):
    "parameters() refuses: memlab's module hook asks for them at every forward."
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
    def parameters(self, recurse=True):
        raise RuntimeError("parameters refuses")
    def forward(self, x):
        return self.l(x)

class NoBuffers(nn.Linear):
    def buffers(self, recurse=True):
        raise ValueError("buffers refuses")

class IntParams(nn.Linear):
    "parameters() yields what is not a tensor."
    def parameters(self, recurse=True):
        yield 5

class GradRaises(nn.Parameter):
    @property
    def grad(self):
        raise RuntimeError("grad refuses")

class GradModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = GradRaises(torch.ones(2, 2))
    def forward(self, x):
        return x @ self.w

class StatelessSGD(torch.optim.SGD):
    @property
    def state(self):
        raise RuntimeError("state refuses")
    @state.setter
    def state(self, value):
        pass

class BadKey:
    def __hash__(self):
        return 1
    def __repr__(self):
        raise RuntimeError("repr refuses")

class BadFlatten(torch.Tensor):
    def __tensor_flatten__(self):
        raise ValueError("flatten refuses")

XSS = "<img src=x onerror=alert(1)>"
XSSError = type(XSS, (Exception,), {})
lin = nn.Linear(4, 4)
out4 = lin(torch.ones(2, 4))

def _nested(grad=True):
    return torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], requires_grad=grad)

_snapdir = tempfile.mkdtemp()

def _pickled(name, data):
    path = os.path.join(_snapdir, name)
    with open(path, "wb") as f:
        pickle.dump(data, f)
    return path

def _bomb(n):
    "A gzipped pickle of a dict with a string of n bytes: a few hundred KiB on disk."
    path = os.path.join(_snapdir, "bomb.pickle.gz")
    head = b"\x80\x04}\x94(\x8c\x08segments\x94]\x94\x8c\x01x\x94\x8d" + struct.pack("<Q", n)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(head)
        f.write(b"a" * n)
        f.write(b"\x94u.")
    return path

_available, _finish = _tap.available_memory, Accountant.finish
from memlab.core.native.roles import NativeRoles
_native_finish = NativeRoles.finish

def _broken_finish(self):
    raise RuntimeError("memlab's own bug")
"""


CASES = Cases()
case = CASES.case


def no_error_shown() -> Check:
    """No traceback at all: not the cell's, not an "Error in callback" of memlab's."""

    def check(out: Outcome, plain: Outcome | None) -> None:
        assert "error" not in out.kinds and "Error in callback" not in out.stdout, out.describe()

    return check


def not_in_message(*needles: str) -> Check:
    def check(out: Outcome, plain: Outcome | None) -> None:
        for n in needles:
            assert n not in (out.evalue or ""), f"{n!r} in the message\n{out.describe()}"

    return check


# -- the user's objects inside memlab's hooks (-b: module, optimizer and gradient hooks) -------
B = "%%gpumem -b -d cpu\n"
HOOKED = {
    "module-parameters-raise": ("m = NoParams()", "y = m(torch.ones(1, 2))\ny.shape"),
    "module-buffers-raise": ("m = NoBuffers(2, 2)", "y = m(torch.ones(1, 2))\ny.shape"),
    "module-parameters-not-tensors": ("m = IntParams(2, 2)", "y = m(torch.ones(1, 2))\ny.shape"),
    "grad-property-raises-in-backward": (
        "m = GradModule()",
        "y = m(torch.ones(1, 2))\ny.sum().backward()\ny.shape",
    ),
    "optimizer-state-raises": (
        "opt = StatelessSGD(nn.Linear(2, 2).parameters(), lr=0.1)",
        "opt.step()\n'stepped'",
    ),
}
# The dispatch mode's hooks call the user's parameters(), buffers() and grad property: each
# failure is skipped and said. The native record's hooks read a module's own dicts of them, and
# the gradients in C++: none of that user code runs, and the roles are read all the same.
DISPATCH = "os.environ['MEMLAB_NATIVE'] = '0'\n"
NATIVE = "os.environ.pop('MEMLAB_NATIVE', None)\n"
for name, (make, cell) in HOOKED.items():
    case(
        f"breakdown-{name}",
        B + cell,
        like_plain(),
        report("not read"),
        plain=SAME,
        setup=DISPATCH + make,
        cleanup=NATIVE,
    )
    case(f"native-breakdown-{name}", B + cell, like_plain(), report(), plain=SAME, setup=make)
case(
    "track-breakdown-module-parameters-raise",
    "with memlab.track('cpu', breakdown=True) as t:\n    y = m(torch.ones(1, 2))\n"
    "y.shape, any('not read' in n for n in t.report.notes)",
    value("(torch.Size([1, 2]), True)"),
    setup=DISPATCH + "m = NoParams()",
    cleanup=NATIVE,
)
case(
    "native-track-breakdown-module-parameters-raise",
    "with memlab.track('cpu', breakdown=True) as t:\n    y = m(torch.ones(1, 2))\n"
    "y.shape, not any('not read' in n for n in t.report.notes)",
    value("(torch.Size([1, 2]), True)"),
    setup="m = NoParams()",
)

# -- a report memlab cannot build never replaces the cell's outcome ---------------------------
case(
    "cell-grad-property-in-the-namespace",
    B + "kept = 41\nkept + 1",
    value("42"),
    report(),
    no_error_shown(),
    setup="gr = GradRaises(torch.ones(2, 2))",
    cleanup="del gr",
)
# memlab's own bug at a breakdown's end, under the dispatch mode and the native record
BREAKS = {
    "": (DISPATCH + "Accountant.finish = _broken_finish", NATIVE + "Accountant.finish = _finish"),
    "native-": ("NativeRoles.finish = _broken_finish", "NativeRoles.finish = _native_finish"),
}
for way, (broken, restore) in BREAKS.items():
    case(
        f"{way}cell-report-not-built-keeps-the-value",
        B + "kept = 41\nkept + 1",
        value("42"),
        no_error_shown(),
        shows("no report for this cell", "memlab's own bug"),
        setup=broken,
        after=(("kept", "41"),),
        cleanup=restore,
    )
    case(
        f"{way}cell-report-not-built-the-cells-error-as-it-is",
        B + "raise KeyError('mine')",
        raises("KeyError", "mine"),
        clean_traceback(),
        setup=broken,
        cleanup=restore,
    )
case(
    "auto-report-not-built-keeps-the-value",
    "kept = 41\nkept + 1",
    value("42"),
    no_error_shown(),
    shows("no report for this cell"),
    setup=f"{BREAKS['native-'][0]}\nget_ipython().run_line_magic('gpumem_auto', 'on -b -d cpu')",
    cleanup=f"%gpumem_auto off\n{BREAKS['native-'][1]}",
)
case(
    "auto-one-line-summary-escapes-the-exception",
    "raise XSSError('x')",
    raises("<img src=x onerror=alert(1)>"),
    escaped("<img src=x onerror=alert(1)>"),
    setup="%gpumem_auto on -d cpu",
    cleanup="%gpumem_auto off",
)

# -- pre-flight: names in the namespace that memlab cannot name by ----------------------------
GPU = "%%gpumem --gpu 0.6GiB\nbig = torch.ones(30 * 2**20)\n'ran'"
for name, make, clean in (
    ("a-name-that-is-not-a-string", "globals()[5] = torch.ones(1000)", "del globals()[5]"),
    ("a-dict-key-whose-repr-raises", "keyed = {BadKey(): torch.ones(1000)}", "del keyed"),
    ("a-subclass-whose-flatten-raises", "bf = torch.ones(1000).as_subclass(BadFlatten)", "del bf"),
):
    case(f"gpu-preflight-{name}", GPU, value("'ran'"), report("OUT OF MEMORY", "line 2"),
         setup=make, cleanup=f"{clean}; del big")  # fmt: skip
case(
    "gpu-too-small-says-it-once",
    "%%gpumem --gpu 1MiB\nx = 1",
    usage("--gpu got '1MiB'", "CUDA context", "24GiB"),
    not_in_message("gpu got 1,048,576"),
)

# -- nested tensors in graphs -------------------------------------------------------------------
case(
    "graph-of-a-nested-tensor",
    "g = memlab.graph_of(_nested() * 2)\ng.nodes[-1].leaf",
    value("'leaf 2×?×4'"),
)
case(
    "graph-of-a-jagged-tensor",
    "nj = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], "
    "layout=torch.jagged, requires_grad=True)\n"
    "import json\ng = memlab.graph_of(nj * nj)\n"
    "sorted({str(s['shape']) for n in json.loads(json.dumps(g.to_dict()))['nodes'] "
    "for s in n['saved']})",
    value("[\"[2, 'j1', 4]\"]"),
)
case("graph-a-nested-tensor-as-the-model", "memlab.graph(_nested())",
     memlab_error("model must be a torch.nn.Module", "nested"))  # fmt: skip
case("graph-of-a-nested-tensor-without-grad", "memlab.graph_of(_nested(False))",
     raises("NoGraphError", "nested", "does not require grad"))  # fmt: skip

# -- graph_of(inputs=...) and view(depth=...) -------------------------------------------------
case("graph-of-inputs-an-int", "memlab.graph_of(out4, inputs=5)",
     memlab_error("inputs", "an int (5)", "inputs=[x]"))  # fmt: skip
case("graph-of-inputs-no-tensor", "memlab.graph_of(out4, inputs=[5, 'x'])",
     memlab_error("inputs", "holding no tensor"))  # fmt: skip
case("graph-of-inputs-none", "len(memlab.graph_of(out4, inputs=None).nodes)", value("4"))
for depth in ("'x'", "0", "-1", "1.5"):
    case(f"graph-view-depth-{depth}", f"memlab.graph(lin, torch.ones(2, 4)).view(depth={depth})",
         memlab_error("depth", f"not {depth}", "None"))  # fmt: skip

# -- NaN typed into the panel ---------------------------------------------------------------------
PANEL = "ex = memlab.Explorer(lambda: lin, lambda n: torch.randn(n, 4))"
for field, label in (("budget", "budget (MiB)"), ("custom_gib", "custom GPU (GiB)")):
    case(
        f"panel-{field}-nan",
        f"ex.{field}.value = float('nan')",
        raises("TraitError", f"{label} got nan", "type a number from"),
        setup=PANEL,
        after=(
            (f"import math; math.isnan(ex.{field}.value)", "False"),
            ("ex.simulate.value = 'custom size'; ex.limit.value.count('limit:')", "1"),
        ),
    )

# -- snapshots whose fields overflow, and a decompression bomb ----------------------------------
SEG = "{'segments': [{'total_size': %s, 'blocks': [{'size': %s, 'state': 'active_allocated'}]}]}"
for name, size in (("infinite", "float('inf')"), ("beyond-int64", "10**30")):
    case(
        f"snapshot-size-{name}",
        f"memlab.load_snapshot(_pickled('{name}', {SEG % (size, size)}))",
        memlab_error("not laid out as a memory snapshot", "OverflowError", "_dump_snapshot"),
    )
for name, traces, said in (("ints", "[5, 6]", "holds an int"), ("a-dict", "{'a': 1}", "is a dict")):
    case(
        f"snapshot-traces-{name}",
        f"memlab.load_snapshot(_pickled('{name}', {{'segments': [], 'device_traces': {traces}}}))",
        memlab_error("not laid out", f"device_traces {said}", "list of events per device"),
    )
for name, when in (("nan", "float('nan')"), ("inf", "float('inf')")):
    case(
        f"snapshot-time-{name}",
        "memlab.load_snapshot(_pickled('t', {'segments': [], 'device_traces': [[{'action': "
        f"'alloc', 'addr': 1, 'size': 512, 'stream': 0, 'time_us': {when}}}]]}}))",
        memlab_error(
            "not laid out as a memory snapshot", "time_us is not a finite", "_dump_snapshot"
        ),
    )
case(
    "snapshot-decompression-bomb",
    # memory falls 256 MiB at each look, as a bomb's would: the reading stops at a quarter left
    "_looks = itertools.count()\n"
    "_tap.available_memory = lambda: 2**30 - next(_looks) * 2**28\n"
    "memlab.load_snapshot(_bomb(64 * 2**20))",
    memlab_error("decompression bomb", "down to", "_dump_snapshot"),
    within(10),
    cleanup="_tap.available_memory = _available",
)

# -- memlab.track's arguments -------------------------------------------------------------------
T = "with memlab.track('cpu', {}) as t:\n    tracked = lin(torch.ones(2, 4))\n"
case("track-watch-a-module", T.format("watch=lin, breakdown=True") +
     "t.report.allocated_delta", value("64"), cleanup="del tracked")  # fmt: skip
case("track-breakdown-a-string", T.format("breakdown='no'"),
     memlab_error("breakdown='no'", "a str", "True or False"))  # fmt: skip
case("track-label-an-int", T.format("label=5"), memlab_error("label=5", "an int", "a str"))
case("track-inputs-an-int", T.format("inputs=[5]"),
     memlab_error("inputs[0]", "an int", "tensors"))  # fmt: skip
case("track-watch-returns-an-int", T.format("watch=lambda: 5"),
     memlab_error("watch function returned an int", "list of tensors"))  # fmt: skip
case("track-ledger-an-int", T.format("ledger=5"),
     memlab_error("ledger must be a memlab Ledger or None, got int", "leave it out"))  # fmt: skip

# -- %gpumem_auto's line ---------------------------------------------------------------------------
case("auto-on-a-stray-word", "%gpumem_auto on cpu", usage("'cpu'", "-d cpu"),
     after=(("_hk_callbacks()", "0"),))  # fmt: skip
case("auto-on-a-label", "%gpumem_auto on -d cpu -l mine", usage("'mine'", "-d, -b"))
case("auto-off-with-words", "%gpumem_auto off now", usage("off", "'now'"))

# -- the line form's options ------------------------------------------------------------------
case("line-help-after-options", "%gpumem -d cpu --help",
     usage("unrecognized option --help", "%gpumem?", "%gpumem (--help)"))  # fmt: skip
case("line-unknown-long-option", "%gpumem --gpus T4 y = 1",
     usage("unrecognized option --gpus", "%gpumem?"))  # fmt: skip
case("line-negation-in-brackets", "%gpumem -d cpu (-torch.ones(2)).sum()", value("tensor(-2.)"))


# -- running them ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    yield from started(str(tmp_path_factory.mktemp("ipython")), SETUP + ROUND4)


def test_the_kernel_imports_this_checkout(kernel: Kernel) -> None:
    assert imports_this_checkout(kernel)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_round4(kernel: Kernel, c: Case) -> None:
    old = native.too_old()  # (scripts/test_torch.sh on an older PyTorch: no native record)
    if old is not None and (c.id.startswith("native-") or "NativeRoles" in c.setup):
        pytest.skip(old)
    run_case(kernel, c)
