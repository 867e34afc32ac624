"""The one argument parser of ``%%gpumem`` / ``%gpumem``, also the source of their help text."""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError

from memlab.magic.out_name import variable_name


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"%{self.prog}: {message}. See %{self.prog}? for the options.")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise UsageError(message or f"%{self.prog}: see %{self.prog}? for the options.")


class _Once(argparse.Action):
    """An option with a value, given once: a second (``-d cpu -d cuda``) is an error naming
    both, where argparse would keep the last without a word."""

    def __call__(self, parser: Any, ns: Any, value: Any, option: str | None = None) -> None:
        if getattr(ns, self.dest) is not None:
            before = getattr(ns, self.dest)
            parser.error(f"{option} given twice ({before!r}, then {value!r}): give it once")
        setattr(ns, self.dest, value)


def _parser() -> _Parser:
    p = _Parser(
        prog="gpumem",
        add_help=False,
        usage="%%%%gpumem [options] [label ...]   or   %%gpumem [options] STATEMENT",
        description="Measure what a cell (or one statement) does to GPU memory: allocated "
        "before and after, the exact peak inside, reserved (cache). Without a GPU the same "
        "report comes from exact tensor accounting on the CPU.",
    )
    p.add_argument(
        "-d",
        "--device",
        default=None,
        action=_Once,
        metavar="DEVICE",
        help="cuda, cuda:N, all (every CUDA device), cpu or meta. Default: the "
        "current CUDA device, else the CPU.",
    )
    p.add_argument(
        "-b",
        "--breakdown",
        action="store_true",
        help="attribute bytes to parameters, gradients, optimizer state, activations, "
        "inputs and temporaries (tensor accounting; slows the cell a little).",
    )
    p.add_argument(
        "-t", "--timeline", action="store_true", help="record memory over time and plot it."
    )
    p.add_argument(
        "--no-reset",
        dest="reset",
        action="store_false",
        help="leave the allocator's peak counters alone; the peak shown is then the "
        "highest since the last reset, which may predate the cell.",
    )
    p.add_argument(
        "--driver",
        action="store_true",
        help="also show the driver's view (mem_get_info, NVML), which explains why "
        "nvidia-smi shows more than memlab.",
    )
    p.add_argument(
        "-o",
        "--out",
        default=None,
        action=_Once,
        metavar="NAME",
        help="store the report object in the variable NAME (with --gpu: the pre-flight).",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="show nothing (the report still goes to %%gpumem_history and -o).",
    )
    p.add_argument(
        "-l", "--label", action=_Once, default=None, help="a label for the report and the history."
    )
    p.add_argument(
        "--gpu",
        default=None,
        action=_Once,
        metavar="GPU",
        help="pre-flight: track the cell on the CPU and replay its allocations through the "
        "allocator model of this GPU (a preset such as T4, 'A100 80GB', or a size such as "
        "24GiB): would it run out of memory there, at which line, and what would make it fit. "
        "Code written for CUDA (.cuda(), device='cuda') runs on the CPU for it.",
    )
    p.add_argument("words", nargs="*", help=argparse.SUPPRESS)
    return p


PARSER = _parser()
HELP = PARSER.format_help()

#: For splitting ``%gpumem [options] STATEMENT``: the options with a value and the flags.
_VALUED = {s for a in PARSER._actions for s in a.option_strings if a.nargs != 0}
_FLAGS = {s for a in PARSER._actions for s in a.option_strings if a.nargs == 0}
_ALL = _VALUED | _FLAGS
_TOKEN = re.compile(r"""\s*("[^"]*"|'[^']*'|\S+)""")


@dataclass(frozen=True)
class Options:
    device: str | None
    breakdown: bool
    timeline: bool
    reset: bool
    driver: bool
    out: str | None
    quiet: bool
    label: str | None
    gpu: str | None = None


def _finish(ns: argparse.Namespace, label_words: list[str]) -> Options:
    if ns.label is not None and label_words:
        raise UsageError(
            f"%gpumem: -l takes one word; {' '.join(label_words)!r} came after -l {ns.label}: "
            "quote a label of several words (-l 'two words'), or give them without -l."
        )
    label = ns.label if ns.label is not None else (" ".join(label_words) or None)
    if ns.quiet and ns.timeline:
        raise UsageError(
            "%gpumem: -q shows nothing and --timeline draws a plot: drop one "
            "(with -q -o NAME you can plot later with NAME.plot())."
        )
    if ns.out is not None:
        ns.out = variable_name(ns.out, "%gpumem")
    if ns.gpu is not None and ns.device not in (None, "cpu"):
        raise UsageError(
            f"%gpumem --gpu tracks the cell on the CPU: drop -d {ns.device} (or drop --gpu to "
            "measure on the device)."
        )
    return Options(
        ns.device, ns.breakdown, ns.timeline, ns.reset, ns.driver, ns.out, ns.quiet, label, ns.gpu
    )


@functools.lru_cache(maxsize=256)
def parse_cell_line(line: str) -> Options:
    """The ``%%gpumem`` line: options, then free words that make the label. (Cached: the same
    line comes back cell after cell; a bad line raises every time.)"""
    tokens = [_unquote(t) for t in _TOKEN.findall(line)]
    ns = PARSER.parse_args(_joined(tokens))
    return _finish(ns, ns.words)


def parse_auto_line(state: str, rest: str) -> Options | None:
    """``%gpumem_auto on [options]``: the options every cell is tracked with; None for ``off``.
    What does not apply to every cell is refused, stray words included (``on cpu`` would
    otherwise label every report "cpu" and measure the default device)."""
    if state == "off":
        if rest.strip():
            raise UsageError(f"%gpumem_auto off takes nothing after it, not {rest.strip()!r}.")
        return None
    if state != "on":
        raise UsageError(f"%gpumem_auto: expected on or off, not {state!r}.")
    opts = parse_cell_line(rest)
    given = (("-t", opts.timeline), ("-o", opts.out), ("-q", opts.quiet), ("--gpu", opts.gpu))
    refused = [flag for flag, value in given if value]
    if opts.label is not None:
        refused.append(repr(opts.label))
    if refused:
        stray = (opts.label or "").split()
        hint = f" (for a device: -d {stray[0]})" if len(stray) == 1 else ""
        raise UsageError(
            f"%gpumem_auto takes -d, -b, --no-reset and --driver only, not {', '.join(refused)}"
            f"{hint}."
        )
    return opts


def _options_of(line: str) -> tuple[list[str], bool, int]:
    """The option tokens at the start of a ``%gpumem`` line, whether the last still waits for
    its value, and where the statement starts."""
    pos, tokens, expecting_value = 0, [], False
    for m in _TOKEN.finditer(line):
        tok = m.group(1)
        if expecting_value:
            tokens.append(_unquote(tok))
            expecting_value = False
        elif tok in _FLAGS:
            tokens.append(tok)
        elif tok in _VALUED:
            tokens.append(tok)
            expecting_value = True
        elif tok.startswith("-") and tok.split("=")[0] in _VALUED:
            tokens.append(tok)
        else:
            break
        pos = m.end()
    return tokens, expecting_value, pos


def _joined(tokens: list[str]) -> list[str]:
    """An option's value that starts with "-" (``--gpu -1GiB``) joined to its option, which
    argparse would otherwise read as an option of its own, so its check says what it got."""
    out: list[str] = []
    for tok in tokens:
        dashed = tok.startswith("-") and not tok.startswith("--")
        if out and out[-1] in _VALUED and dashed and tok.split("=")[0] not in _ALL:
            option = out.pop()
            tok = f"{option}={tok}" if option.startswith("--") else option + tok
        out.append(tok)
    return out


def parse_statement_line(
    line: str, expand: Callable[[str], str] | None = None
) -> tuple[Options, str]:
    """``%gpumem [options] STATEMENT``: the statement is kept verbatim, never re-tokenised;
    ``expand``, where given, is applied to the options alone (IPython's ``$name``)."""
    tokens, expecting_value, pos = _options_of(line)
    if expand is not None and (head := expand(line[:pos])) != line[:pos]:
        line = head + line[pos:]  # (read again: what $name held may hold several words)
        tokens, expecting_value, pos = _options_of(line)
    statement = line[pos:].strip()
    if expecting_value:
        raise UsageError(f"%gpumem: option {tokens[-1]} needs a value.")
    first = statement.split(maxsplit=1)[0] if statement else ""
    if first == "-h" or re.fullmatch(r"--[A-Za-z][\w-]*", first):  # meant as an option
        raise UsageError(
            f"%gpumem: unrecognized option {first}. See %gpumem? for the options "
            f"(to measure the expression itself, put it in brackets: %gpumem ({first}))."
        )
    ns = PARSER.parse_args(_joined(tokens))
    if not statement:
        raise UsageError(
            "%gpumem needs a statement to measure, e.g. `%gpumem y = model(x)`; "
            "use %%gpumem at the top of a cell to measure the whole cell."
        )
    return _finish(ns, []), statement


def _unquote(tok: str) -> str:
    if len(tok) >= 2 and tok[0] == tok[-1] and tok[0] in "\"'":
        return tok[1:-1]
    return tok
