"""Hostile input in a real kernel against the surfaces changed most recently: generation with
encoder-decoder models (T5, BART built from tiny configs), a ``step_fn`` that runs its own
backward, GPU names for ``gpu=`` and ``%%gpumem --gpu``, the leak finder, ``memlab.graph``
with batches it cannot take, and what-if runs on the user's own odd models.

Each case runs one cell and checks what the user sees; every case then checks that the kernel
answers, that memlab left nothing installed and that torch's session state (dispatch modes,
grad and inference mode, default device and dtype, autocast, hooks) is as before. Cases whose
code has a meaning without memlab compare with it (``like_plain``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernel_harness import Kernel
from kernel_rounds import Case, Cases, imports_this_checkout, run_case, started
from test_hostile_kernel import (
    SETUP,
    like_plain,
    memlab_error,
    raises,
    report,
    shows,
    succeeds,
    usage,
    value,
    within,
)

pytestmark = pytest.mark.slow

ROUND3 = r"""
import gc, memlab.graphs
import torch.nn.functional as F
from memlab.graphs.retained import find_retained
import transformers
transformers.logging.set_verbosity_error()

def t5(**kw):
    c = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
        num_decoder_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0, **kw)
    return transformers.T5ForConditionalGeneration(c)

def bart(**kw):
    c = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, **kw)
    return transformers.BartForConditionalGeneration(c)

def ids(n):
    return torch.randint(1, 64, (n, 5))

def gen(model_fn, input_fn, **kw):
    return memlab.whatif.run(model_fn, input_fn, mode="generate", device="cpu", batch_size=2, **kw)

def mlp():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

def xy(n):
    return torch.randn(n, 8), torch.randn(n, 1)

def step(step_fn, **kw):
    return memlab.whatif.run(mlp, xy, step_fn=step_fn, device="cpu", batch_size=6, **kw)

def own_backward(m, b):
    loss = F.mse_loss(m(b[0]), b[1])
    loss.backward()
    return loss

def _session():
    "torch's session state beyond _hk_state: inference mode, dtype, autocast, hooks."
    from torch.nn.modules import module as m
    return (torch.is_inference_mode_enabled(), torch.get_default_dtype(),
            torch.is_autocast_enabled("cpu"), len(m._global_backward_hooks),
            len(m._global_backward_pre_hooks), len(m._global_forward_hooks_always_called))

_session0 = _session()
"""


CASES = Cases()
case = CASES.case


# -- mode="generate" with encoder-decoder models ---------------------------------------------
case("gen-t5-works", "gen(t5, ids).peak > 0", value("True"))
case("gen-bart-works", "gen(bart, ids).peak > 0", value("True"))
for name, prompt in (("str", "lambda n: 'translate: hi'"), ("list", "lambda n: [[1, 2, 3]]"),
                     ("none", "lambda n: None")):  # fmt: skip
    case(f"gen-t5-prompt-{name}", f"gen(t5, {prompt})",
         memlab_error("input_fn", "encoder's input", "input_ids"))  # fmt: skip
case(
    "gen-t5-empty-prompt",
    "gen(t5, lambda n: torch.zeros(n, 0, dtype=torch.long))",
    memlab_error("input_fn", "empty prompt", "(2, 0)", "at least one token"),
)
case(
    "gen-bart-empty-prompt-in-a-dict",
    "gen(bart, lambda n: {'input_ids': torch.zeros(n, 0, dtype=torch.long)})",
    memlab_error("input_fn", "empty prompt", "at least one token"),
)
case("gen-t5-empty-dict", "gen(t5, lambda n: {})", memlab_error("input_fn", "empty dict"))
case(
    "gen-t5-only-labels",
    "gen(t5, lambda n: {'labels': ids(n)})",
    memlab_error("input_fn", "only 'labels'", "input_ids"),
)
case("gen-t5-decoder-ids", "gen(t5, lambda n: {'input_ids': ids(n), "
     "'decoder_input_ids': ids(n)}).peak > 0", value("True"))  # fmt: skip
case("gen-new-tokens-0", "gen(t5, ids, new_tokens=0)", memlab_error("new_tokens", "0", "≥ 1"))
case(
    "gen-new-tokens-past-the-positions",
    "gen(bart, ids, new_tokens=10**6)",
    memlab_error("new_tokens=1,000,000", "32 positions", "new_tokens ≤ 32"),
    within(30),
)
TUPLES = "def t5_tuples():\n    m = t5()\n    m.config.return_dict = False\n    return m"
case(
    "gen-t5-return-dict-false",
    "gen(t5_tuples, ids)",
    memlab_error("tuple", "return_dict=False", "model.config.return_dict = True"),
    setup=TUPLES,
)
case(
    "gen-float-ids-the-models-own-error",
    "gen(t5, lambda n: torch.rand(n, 5))",
    raises("RuntimeError", "indices"),
)

# -- step_fn with its own backward -------------------------------------------------------------
TWICE = "def twice(m, b):\n    l = F.mse_loss(m(b[0]), b[1]); l.backward(); l.backward(); return l"
case("step-backward-twice", "step(twice)", like_plain(), plain="twice(mlp(), xy(6))", setup=TWICE)
DETACHED = "def detached(m, b):\n    l = F.mse_loss(m(b[0]), b[1]).detach(); l.backward()"
case("step-backward-detached", "step(detached)", like_plain(),
     plain="detached(mlp(), xy(6))", setup=DETACHED)  # fmt: skip
NONE = "def none_after(m, b):\n    own_backward(m, b)\n    return None"
case("step-none-after-backward", "step(none_after).peak > 0", value("True"), setup=NONE)
RAISES = "def raises(m, b):\n    own_backward(m, b)\n    raise ValueError('the user says no')"
case("step-raises-after-backward", "step(raises)", like_plain(), plain="raises(mlp(), xy(6))",
     setup=RAISES)  # fmt: skip
GC = (
    "def from_gc(m, b):\n    loss = own_backward(m, b)\n"
    "    for o in [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)]:\n"
    "        o.step()\n    return loss"
)
case("step-steps-memlabs-optimizer-from-gc", "step(from_gc).peak > 0", value("True"), setup=GC)
for kw in ("accumulation=3", "amp='bf16'", "optimizer_in_backward=True"):
    case(f"step-own-backward-{kw.split('=')[0]}", f"step(own_backward, {kw}).peak > 0",
         value("True"))  # fmt: skip
for mode in ("no_grad", "inference_mode"):
    case(
        f"step-own-backward-{mode}",
        f"step(own_backward, mode='{mode}')",
        memlab_error("step_fn", "grad off", f"mode='{mode}'", "mode='train'"),
    )
KBI = "def interrupt(m, b):\n    own_backward(m, b)\n    raise KeyboardInterrupt"
case(
    "step-keyboard-interrupt",
    "user = nn.Linear(8, 1); _w = user.weight.clone()\n"
    "try:\n    memlab.whatif.run(lambda: user, lambda n: torch.randn(n, 8), step_fn=interrupt, "
    "device='cpu', batch_size=2)\nexcept KeyboardInterrupt:\n    print('interrupted')\n"
    "torch.equal(user.weight, _w), user.weight.grad",
    value("(True, None)"),
    shows("interrupted"),
    setup=KBI,
)

# -- GPU names ---------------------------------------------------------------------------------
EST = "estimate(lambda: nn.Linear(4, 2), lambda n: torch.randn(n, 4), batch_size=2, gpu={})"
for gpu in ("' h100 '", "'H100\\n'", "'24 GiB'", "None"):
    case(f"gpu-{gpu.strip(chr(39))!r}-taken", EST.format(gpu) + ".report.peak_allocated > 0",
         value("True"))  # fmt: skip
for gpu, needles in (
    ("'H20'", ("gpu got 'H20'", "unknown GPU", "H200")),
    ("'a10'", ("gpu got 'a10'", "unknown GPU", "A100 40GB")),
    ("'80'", ("gpu got '80'", "'A100 80GB' or 'H100 80GB'")),
    ("'🙂'", ("gpu got '🙂'", "unknown GPU", "24GiB")),
    ("''", ("gpu got ''", "unknown GPU", "T4")),
    ("'<script>'", ("gpu got '<script>'", "unknown GPU")),
    ("'1e3GB'", ("gpu got '1e3GB'", "24GiB")),
    ("0", ("gpu got 0", "CUDA context", "pass a size")),
    ("-5", ("gpu got -5", "CUDA context", "pass a size")),
    ("1.5", ("gpu", "1.5", "a size in bytes")),
):
    case(f"gpu-{gpu}-refused", EST.format(gpu), memlab_error(*needles))
CELL = "%%gpumem --gpu {}\nx = torch.ones(4)\nx.sum()"
for gpu in ("' h100 '", "H100", "'24 GiB'"):
    case(f"cell-gpu-{gpu}", CELL.format(gpu), value("tensor(4.)"), report())
case("cell-gpu-80-refused", CELL.format("80"), usage("--gpu", "'80'", "'A100 80GB' or"))
for gpu, needle in (("H20", "'H20'"), ("a10", "'a10'"), ("'🙂'", "'🙂'"),
                    ("'<script>'", "'<script>'"), ("1e3GB", "'1e3GB'"), ("0", "'0'"),
                    ("-5", "'-5'"), ("1.5", "'1.5'")):  # fmt: skip
    case(f"cell-gpu-{gpu}-refused", CELL.format(gpu), usage("--gpu", needle, "24GiB"))
case("cell-gpu-missing", "%%gpumem --gpu\nx = 1", usage("--gpu"))

# -- the leak finder ---------------------------------------------------------------------------
HOSTILE = """
_m = nn.Linear(4, 4)
losses = []
for _ in range(3):
    _l = _m(torch.randn(2, 4)).sum(); _l.backward(); losses.append(_l)
class Raising:
    def __eq__(self, o): raise RuntimeError('eq')
    def __hash__(self): raise RuntimeError('hash')
    def __len__(self): raise RuntimeError('len')
    def __iter__(self): raise RuntimeError('iter')
class RaisingList(list):
    def __eq__(self, o): raise RuntimeError('eq')
    __hash__ = None
    def __iter__(self): raise RuntimeError('iter')
    def __len__(self): raise RuntimeError('len')
class SameKey:
    def __hash__(self): return 1
    def __eq__(self, o): raise RuntimeError('eq')
selfref = []; selfref.append(selfref); selfref.append(_m(torch.randn(2, 4)))
me = {}; me['me'] = me; me['t'] = _m(torch.randn(2, 4))
raising = Raising(); rlist = RaisingList([_m(torch.randn(1, 4))])
keyed = {SameKey(): _m(torch.randn(1, 4))}
huge = [_m(torch.randn(1, 4)) for _ in range(20000)]
"""
CLEAN = "del losses, selfref, me, raising, rlist, keyed, huge, Raising, RaisingList, SameKey"
case(
    "leaks-hostile-namespace",
    "%gpumem_leaks",
    succeeds(),
    report("huge", "selfref", "me", "rlist", "keyed"),
    within(20),
    setup=HOSTILE,
    after=(("[i.name for i in find_retained({'losses': losses}).items]", "[]"),),
    cleanup=CLEAN,
)
case(
    "leaks-find-retained-ipython-objects",
    "r = find_retained(get_ipython().user_ns)\n"
    "[i.name for i in r.items if i.name in ('In', 'Out', 'exit', 'quit', 'get_ipython')]",
    value("[]"),
)

# -- graph and graph_of with batches -----------------------------------------------------------
LOADER = (
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)\n"
    "lin = nn.Linear(4, 1)"
)
case("graph-loader-batch", "memlab.graph(lin, next(iter(loader)))",
     memlab_error("input 1", "list", "x, y = next(iter(loader))"), setup=LOADER)  # fmt: skip
case("graph-generator", "memlab.graph(lin, (torch.randn(2, 4) for _ in range(2)))",
     memlab_error("input 1", "generator", "unpacked"), setup=LOADER)  # fmt: skip
case("graph-dict", "memlab.graph(lin, {'input': torch.randn(2, 4)})",
     memlab_error("input 1", "dict of tensors", "'input'", "**batch"), setup=LOADER)  # fmt: skip
case("graph-dict-as-keywords", "memlab.graph(lin, **{'input': torch.randn(2, 4)}).nodes != ()",
     value("True"), setup=LOADER)  # fmt: skip
case("graph-of-a-generator", "memlab.graph_of(lin(torch.randn(2, 4)).sum() for _ in range(2))",
     memlab_error("generator", "graph_of(loss)"), setup=LOADER)  # fmt: skip
case("graph-of-a-dict", "memlab.graph_of({'a': lin(torch.randn(2, 4)).sum()}).nodes != ()",
     value("True"), setup=LOADER)  # fmt: skip
case(
    "graph-of-10000-tensors",
    "_many = [lin(torch.randn(1, 4)).sum() for _ in range(10000)]\n"
    "g = memlab.graph_of(_many); del _many\nlen(g._repr_html_()) < 200_000",
    value("True"),
    within(20),
    setup=LOADER,
)

# -- what-if runs on the user's own odd models -------------------------------------------------
INFERENCE = (
    "with torch.inference_mode():\n    made = mlp()\n_m0 = [p.clone() for p in made.parameters()]"
)
case(
    "whatif-inference-made-model-trained",
    "memlab.whatif.run(lambda: made, xy, step_fn=own_backward, device='cpu', batch_size=2)",
    memlab_error("model_fn", "inference_mode", "mode='train'", "mode='no_grad'"),
    setup=INFERENCE,
    after=(("all(torch.equal(a, b) for a, b in zip(_m0, made.parameters()))", "True"),),
)
case(
    "whatif-inference-made-model-inference",
    "memlab.whatif.run(lambda: made, lambda n: torch.randn(n, 8), device='cpu', batch_size=2, "
    "mode='inference_mode').peak > 0",
    value("True"),
    setup=INFERENCE,
)
ADDS = """
class Adds(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.calls = 0
    def forward(self, x):
        self.calls += 1
        self.register_buffer(f"seen{self.calls}", torch.zeros(4))
        self.extra = nn.Linear(1, 1)
        return self.l(x)
adds = Adds()
_before = (sorted(dict(adds.named_buffers())), sorted(vars(adds)), list(dict(adds.named_modules())))
"""
for mode in ("train", "no_grad", "eval_with_grad"):
    case(
        f"whatif-forward-adds-a-buffer-{mode}",
        f"memlab.whatif.run(lambda: adds, lambda n: torch.randn(n, 4), device='cpu', "
        f"batch_size=2, mode='{mode}').peak > 0",
        value("True"),
        setup=ADDS,
        after=(
            (
                "(sorted(dict(adds.named_buffers())), sorted(vars(adds)), "
                "list(dict(adds.named_modules()))) == _before, adds.calls",
                "(True, 0)",
            ),
        ),
    )


# -- running them ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    yield from started(str(tmp_path_factory.mktemp("ipython")), SETUP + ROUND3)


def test_the_kernel_imports_this_checkout(kernel: Kernel) -> None:
    assert imports_this_checkout(kernel)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_round3(kernel: Kernel, c: Case) -> None:
    run_case(kernel, c, always=(("_session() == _session0", "True"),))
