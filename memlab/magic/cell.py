"""Run a cell's source the way IPython would, so a cell keeps its meaning under the magic.

The source is transformed by IPython (so magics and ``!commands`` inside it work), compiled once
under a file name registered with linecache (so tracebacks show the cell's own lines, numbered as
the user sees them), and executed in the user's namespace. The last expression's value is
returned; the source is never re-indented or rewritten.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import inspect
import io
import re
import tokenize
from collections.abc import Iterator
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

NO_VALUE = object()
CUT_SHORT = (
    "a Ctrl-C came after the cell ran to its end, while memlab finished its report: the cell "
    "keeps its value; memlab's report follows"
)
_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag


def compile_cell(
    shell: InteractiveShell, source: str, header: str | None = None
) -> tuple[Any, Any, bool]:
    """Compile ``source``; ``header`` is the visible line above it (``%%gpumem ...``), kept as a
    comment so that line numbers and traceback context match the cell the user sees.

    Returns (body code, last-expression code or None, quiet). Raises ``SyntaxError`` as IPython
    would show it, and ``UsageError`` for top-level ``await``.
    """
    transformed = source if _plain_python(source) else shell.transform_cell(source)
    padded = transformed if header is None else f"# {inert(header)}\n{transformed}"
    number = getattr(shell.displayhook, "prompt_count", shell.execution_count)
    filename = shell.compile.cache(padded, number, raw_code=source)
    flags = shell.compile.flags | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    quick = None if shell.ast_transformers else _from_source(padded, filename, flags)
    if quick is not None:
        body, expr = quick
    else:  # the syntax tree decides (and the shell's ast_transformers change it)
        tree = shell.transform_ast(ast.parse(padded, filename=filename))
        last = None
        final = tree.body[-1] if tree.body else None
        if isinstance(final, ast.Expr):
            tree.body.pop()
            last = ast.Expression(final.value)
        body = compile(tree, filename, "exec", flags=flags, dont_inherit=True)
        expr = compile(last, filename, "eval", flags=flags, dont_inherit=True) if last else None
    # a `from __future__ import ...` in the cell holds for later cells, as IPython's own do
    shell.compile.flags |= body.co_flags & _FUTURE_FLAGS
    if _is_async(body) or (expr is not None and _is_async(expr)):
        raise UsageError(
            "%gpumem cannot measure a cell with top-level `await`: in a cell without %%gpumem, "
            "measure it with `with memlab.track() as t:` around the `await` lines, then show "
            "`t.report`."
        )
    return body, expr, _ends_with_semicolon(transformed)


#: What an assignment binds: a name, ``x.y``, ``x[i]`` or ``x.y[i, j]``.
_TARGET = r"[A-Za-z_][\w.]*(?:\[[^][()=]*\])*"
#: A last line that is a statement, not an expression: one that starts with a keyword only a
#: statement starts with, or an assignment (``a = 1``, ``x.y, z[i] += f(w)``).
_STATEMENT = re.compile(
    r"(?:import|from|def|class|for|while|if|elif|else|with|try|except|finally|return|del|pass"
    r"|raise|assert|global|nonlocal|async|break|continue)\b|@"
    rf"|{_TARGET}(?:\s*,\s*{_TARGET})*\s*(?:[-+*/%@&|^]|//|\*\*|>>|<<)?=(?!=)"
)


def _from_source(padded: str, filename: str, flags: int) -> tuple[Any, Any] | None:
    """(body, last expression or None) compiled from the source itself, the syntax tree's
    round trip through Python objects left out (about half of the compiling), or None where
    the tree must decide (and say what is wrong, where the cell does not compile).

    Only where the last line is a whole logical line: no quotes (no string runs into or out of
    it), brackets that close on it, no ``;``, the line before it not continued by a backslash.
    The lines before it are then whole statements. At column 0 it is the last statement, an
    expression where it compiles as one; indented, it is in the block of the last statement,
    which is then no expression."""
    head, _, last = padded.rstrip().rpartition("\n")
    if (
        not last
        or last.lstrip()[:1] == "#"
        or "\r" in padded
        or not _whole_line(last)
        or head.endswith("\\")
    ):
        return None
    if last[0] not in " \t" and _STATEMENT.match(last) is None:
        try:  # (a line of the cell's own: its line number kept)
            line = "\n" * (head.count("\n") + 1) + last if head else last
            expr = compile(line, filename, "eval", flags=flags, dont_inherit=True)
        except Exception:  # (a statement the pattern does not know, or `*x,`: the tree tells)
            return None
        try:
            return compile(head, filename, "exec", flags=flags, dont_inherit=True), expr
        except Exception:  # (the tree says where, as IPython would)
            return None
    try:
        return compile(padded, filename, "exec", flags=flags, dont_inherit=True), None
    except Exception:
        return None


def _whole_line(line: str) -> bool:
    if "'" in line or '"' in line or ";" in line or line.endswith("\\"):
        return False
    depth = 0
    for ch in line:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def inert(header: str) -> str:
    """``header`` as one line of a comment, whatever it holds: a label from ``{variable}`` may
    hold line breaks, and a line after one would run as code and move every line of the cell.
    Each break that Python or linecache (``str.splitlines``: \\v, \\f, \\x1c-\\x1e, \\x85,
    \\u2028, \\u2029 too) ends a line at becomes a space; what cannot be compiled (a NUL, a
    lone surrogate) is replaced too."""
    one = " ".join(header.splitlines()).replace("\0", " ")
    return one.encode("utf-8", "replace").decode("utf-8")


#: What IPython's input transformers act on: magics, shell escapes, help, pasted prompts,
#: leading indentation. A cell with none of them is plain Python and is compiled as it is.
_IPYTHON_SYNTAX = re.compile(r"[%!?]|^\s*(>>>|In \[|\.\.\.:)", re.MULTILINE)


def _plain_python(source: str) -> bool:
    return not source[:1].isspace() and _IPYTHON_SYNTAX.search(source) is None


def _is_async(code: Any) -> bool:
    return bool(code.co_flags & inspect.CO_COROUTINE)


def _ends_with_semicolon(source: str) -> bool:
    """IPython's rule: a trailing ``;`` on the last line hides the cell's value."""
    if ";" not in source:
        return False
    skip = {
        tokenize.NEWLINE,
        tokenize.NL,
        tokenize.COMMENT,
        tokenize.ENDMARKER,
        tokenize.INDENT,
        tokenize.DEDENT,
    }
    last = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type not in skip:
                last = tok
    except (tokenize.TokenError, SyntaxError):
        return False
    return last is not None and last.type == tokenize.OP and last.string == ";"


def execute(shell: InteractiveShell, body: Any, expr: Any) -> Any:
    """Run compiled code in the user's namespace; the last expression's value or ``NO_VALUE``."""
    __tracebackhide__ = True
    exec(body, shell.user_global_ns, shell.user_ns)
    if expr is None:
        return NO_VALUE
    return eval(expr, shell.user_global_ns, shell.user_ns)


def has_value(value: Any) -> bool:
    return value is not NO_VALUE


@contextlib.contextmanager
def measured(region: Any) -> Iterator[None]:
    """``region`` (a `memlab.track`) around a cell. The cell's own exception passes as it is;
    memlab's own failure to start measuring, or to build the report of a cell that ran to its
    end, is not raised (the cell runs and keeps its value; the magic says there is no report).
    A Ctrl-C while the region starts still reaches the user; one while memlab closes the
    region of a cell that ran to its end stops nothing of the cell's: the cell keeps its value
    (the region is closed first, and its report says so)."""
    __tracebackhide__ = True
    try:
        region.__enter__()
    except Exception:  # memlab could not start measuring: the cell runs all the same, and the
        yield  # magic says there is no report, and why (a Ctrl-C still stops it)
        return
    try:
        yield
    except BaseException as e:
        region.__exit__(type(e), e, e.__traceback__)
        raise
    try:
        region.__exit__(None, None, None)
    except KeyboardInterrupt:  # the cell ran to its end: a Ctrl-C now stops memlab's work, not
        if getattr(region, "_reports", None) is None:  # the cell (its value and variables kept)
            with contextlib.suppress(BaseException):  # (Ctrl-C after Ctrl-C: closed first)
                region.__exit__(None, None, None)
        print(f"memlab: {CUT_SHORT}")
    except Exception:
        pass
