"""The magic's compiling of a cell straight from its source (`memlab.magic.cell._from_source`)
against the syntax tree's split, which IPython's own rule is: the same statements, the same last
expression (or none), the same line numbers, the same value and variables when run."""

from __future__ import annotations

import ast
import itertools
import random
import re
from typing import Any

import pytest

from memlab.magic.cell import _from_source

HEADER = "# %%gpumem -q\n"

CELLS = [
    "a = 1",
    "a = 1\na",
    "a = 1\na + 1",
    "x = [1,\n2,\n3]\nlen(x)",
    "x = [1,\n2,\n3]",
    "def f(x=1):\n    return x\nf(x=2)",
    "def f(x=1):\n    return x\nf",
    "lambda x=1: x",
    "a, b = 1, 2\na, b",
    "a = b = 3\na == b",
    "a = 2\na <= 3",
    "a = 2\na != 3",
    "a = 2\na >>= 1\na",
    "a = 5\na >>= 1",
    "total = 1 + \\\n2",
    "total = 1 \\\n+ 2",
    "v = 1\nif v: v\nelse: 0",
    "v = 1\nif v:\n    v\nelse:\n    0",
    "for i in range(3):\n    i",
    "for i in range(3):\n    pass\ni",
    "s = 'x = 1'\ns",
    's = """\nx = 1\n"""\ns',
    'print("""\nx = 1\n  """)',
    'len("""\nx = 1\n  """)',
    'len("""\nx\n  """)',
    "x = 1  # a note\nx  # shown",
    "x = 1\n# only a comment",
    "x = 1\nx; y = 2",
    "x = 1\ny = 2; x",
    "x = {'a': 1}\nx['a']",
    "x = {}\nx[1] = 2",
    "class A:\n    pass\nA.b = 3\nA.b",
    "import math\nmath.pi",
    "from math import pi as p\np * 2",
    "x: int = 4\nx",
    "x = 1\nx: int",
    "(a := 3)\na",
    "a = 1\nnot a",
    "a = [1, 2]\na[0], a[1] = a[1], a[0]\na",
    "a = [1, 2]\na[0], a[1] = a[1], a[0]",
    "a = 1\n@staticmethod",
    "a = (\n1",
    "a = 1\n)",
    "x = 1\n  x",
    "try:\n    x = 1\nexcept Exception:\n    x = 2\nfinally:\n    x",
    "with open(__file__) as f_:\n    n = 1\nn",
    "async_x = 1\nasync_x",
    "if_ = 2\nif_",
    "import_rate = 3\nimport_rate + 1",
    "x = [i for i in range(4) if i]\nx",
    "x = 1\n\n\n\nx\n\n",
    "x = 1\nx\n# a comment at the end",
    "def g():\n    yield 1\nlist(g())",
    "yield 1",
    "a = 1\ndel a",
    "a = 1\nassert a\na",
    "x = 0x1F\nx.bit_length()",
    "x = 1e3\n-x",
    "x = 1\n~x",
    "x = 1\n+x",
    "x = [1]\n*x,",
    "x = 1\nx if x else 2",
    "x = 1\n(x,\n x)",
    "d = dict(a=1)\nd.get('a')",
    "d = dict(a=1)\nd.update(b=2)\nd",
    "f = lambda: (yield)",
    "x = 1 # (unclosed in a comment\nx",
    "x = 1\nx # ) closed in a comment",
    "\tx = 1",
    "x = 1\n\tx",
    "x = 'a\\\nb'\nx",
]


def _by_tree(padded: str) -> tuple[Any, Any]:
    tree = ast.parse(padded, filename="<cell>")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, "<cell>", "exec", dont_inherit=True)
    return body, compile(last, "<cell>", "eval", dont_inherit=True) if last else None


def _lines(code: Any) -> set[int]:
    found = {line for _, _, line in code.co_lines() if line is not None}
    for const in code.co_consts:
        if hasattr(const, "co_lines"):
            found |= _lines(const)
    return found


def _run(body: Any, expr: Any) -> tuple[str, dict[str, str]]:
    ns: dict[str, Any] = {"__file__": __file__}
    try:
        exec(body, ns)
        value = repr(eval(expr, ns)) if expr is not None else "<none>"
    except Exception as e:
        value = f"raised {type(e).__name__}"
    shown = {k: _plain(repr(v)) for k, v in ns.items() if k != "__builtins__"}
    return _plain(value), shown


def _plain(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # (a function's address differs each run)


def _check(cell: str) -> bool:
    padded = HEADER + cell
    quick = _from_source(padded, "<cell>", 0)
    try:
        tree = _by_tree(padded)
    except (SyntaxError, ValueError):
        assert quick is None, cell  # the tree says what is wrong, as IPython would
        return False
    if quick is None:
        return False
    assert (quick[1] is None) == (tree[1] is None), cell
    for mine, theirs in zip(quick, tree, strict=True):
        if theirs is not None:
            assert _lines(mine) == _lines(theirs), cell
    assert _run(*quick) == _run(*tree), cell
    return True


@pytest.mark.parametrize("cell", CELLS)
def test_a_cell_compiled_from_its_source_is_the_cell_the_tree_compiles(cell: str) -> None:
    _check(cell)


def test_the_usual_cells_take_the_quick_way() -> None:
    """A cell that ends with an assignment, a call, a name or an indented block."""
    for cell in ["a = 1", "a = 1\na", "x = [1]\nlen(x)", "for i in range(2):\n    a = i"]:
        assert _check(cell), cell


def test_random_cells_of_lines_that_each_may_break_a_statement() -> None:
    """Cells put together from lines that open or close brackets and strings, continue with a
    backslash, or hold a ``;`` or a comment: whatever the quick way compiles, it compiles as
    the tree does (and it takes the quick way for some of them)."""
    pieces = [
        "x = 1", "x", "y = (", "1)", "2,", "]", "z = [", "s = '''", "'''", "t = 'a'",
        "x + 1", "    x", "if x:", "    pass", "else:", "x = 1 \\", "+ 2", "w = x; x",
        "# note", "x  # (", "f(x=1)", "print(x)", "del x", "x = {", "}", "lambda q=1: q",
    ]  # fmt: skip
    rng = random.Random(11)
    quick = 0
    for n in itertools.chain.from_iterable(itertools.repeat(range(1, 6), 300)):
        cell = "f = print\n" + "\n".join(rng.choice(pieces) for _ in range(n))
        quick += _check(cell)
    assert quick > 100
