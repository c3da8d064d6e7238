"""The `hybridkv` command line.

Subcommands live in the packages that own them and are found through the
`hybridkv.commands` entry-point group, so this module knows none of them.
Each entry point names a `register(parser)` function that adds its arguments
and sets `handler=fn(args) -> int` as a parser default. The first sentence of the
register module's docstring, "`hybridkv NAME`: what it does.", is the command's
one-line help in `hybridkv -h`. Every option has help text; the formatter adds its
default (and the bound of a `bounded` type) unless the text already says it.

The contract every command keeps:

- With --json, stdout carries exactly one JSON document, written by `print_json`. For the
  run, file descriptor 1 points at stderr, so whatever else writes to stdout (NIXL's and UCX's
  logs, from native code or from the processes a command starts, which inherit the descriptor;
  progress; a stray print) lands on stderr.
- Every error is one `hybridkv: error: ...` line on stderr (details indented under it), argparse's
  own errors included, which point to -h instead of printing a usage block.
- Exit status (EXIT_HELP, also at the end of `hybridkv -h`):
  0 done; 1 the run could not finish (CommandError, a missing optional dependency, no GPU, a
  peer or transfer failure, or the run's own check failed, e.g. demo's mismatches); 2 bad input
  (ValueError, argparse's errors, a bound exceeded); 130 interrupted.
- Sizes are bounded: an absurd value is refused at once, naming the bound, instead of running
  for hours or without end.
- A missing optional dependency names the extra that installs it, in one wording everywhere
  (`install_hint`; hybridkv's own ImportErrors raise `MissingExtra`).

Anything else is a bug in hybridkv and keeps its traceback: that is what a bug report needs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import sys
import threading
from importlib.metadata import entry_points
from typing import Any

import hybridkv
from hybridkv.errors import HybridKVError, MissingExtra, install_hint

ENTRY_POINT_GROUP = "hybridkv.commands"

#: Import name of an optional dependency -> the extra of pyproject.toml that installs it. torch maps
#: to `kernels` (torch and Triton), which covers every command that imports torch.
OPTIONAL_MODULES = {
    "torch": "kernels",
    "triton": "kernels",
    "matplotlib": "sims",
    "yaml": "sims",
    "rich": "cli",
    "fla": "bench",
    "nixl": "transport",
    "nixl_cu12": "transport",
    "nixl_cu13": "transport-cu13",
    "ucxx": "transport",
    "vllm": "vllm",
    "sglang": "sglang",
}

#: A command group whose own extra also installs modules mapped elsewhere above: `sim` needs rich
#: too, and the `sims` extra has it, so a `sim` user is pointed at the one extra that makes it run.
COMMAND_EXTRAS = {"sim": ("sims", frozenset({"rich", "yaml", "matplotlib"}))}

# Exit statuses: 2 for bad input, as argparse uses for bad flags; 1 for a run that could not finish.
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

EXIT_HELP = """\
exit status:
  0    done
  1    the run could not finish: an optional dependency is missing, no GPU, a peer or
       transfer failed, a --timeout ran out, or the run's own check failed
  2    bad input: an unknown option, a bad value, a size above its bound, an invalid recipe
  130  interrupted
An error is one `hybridkv: error: ...` line on stderr. With --json, stdout is exactly one
JSON document; logs (NIXL, UCX, progress) go to stderr."""

_SUMMARY = re.compile(r"^`hybridkv [^`]*`:\s*(?P<text>.+?)\.?$")
_SENTENCE_END = re.compile(r"\.\s")


class CommandError(Exception):
    """A command's run ended in a way its user can act on, not through a bug: printed without a
    traceback. The message's first line is the error line; further lines are details under it."""


_HINT = re.compile(r'install hybridkv\'s "[^"]+" extra')


# ----------------------------------------------------------------------------- bounds


class bounded:  # noqa: N801 - used like `int` and `float` as an argparse type
    """An argparse type: a number of `kind` at most `high` (and at least `low` where given; where a
    command's own check already refuses small values with its message, `low` is left to it). A
    value out of bounds is argparse's one error line, naming the bound; -h shows the bound."""

    def __init__(self, kind: type, high: float, low: float | None = None) -> None:
        self.kind, self.low, self.high = kind, low, high
        self.__name__ = kind.__name__  # argparse names the type in "invalid int value"

    def __call__(self, text: str):
        value = self.kind(text)  # ValueError: argparse says "invalid int value: 'x'"
        if value != value or value > self.high or (self.low is not None and value < self.low):  # NaN too
            raise argparse.ArgumentTypeError(f"{text} is outside the bound {self.describe()}")
        return value

    def describe(self) -> str:
        if self.low is None:
            return f"at most {_number(self.high)}"
        return f"{_number(self.low)} to {_number(self.high)}"


def _number(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


# ----------------------------------------------------------------------------- parser


class _Formatter(argparse.HelpFormatter):
    """Every option's help shows its default (and its bound), unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        extra = []
        if action.nargs != 0 and not action.required and "default" not in text.lower():
            extra.append("default: %(default)s")
        if isinstance(action.type, bounded):
            extra.append(action.type.describe())
        return f"{text} ({'; '.join(extra)})" if extra else text


class _TopFormatter(_Formatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the exit-status table of the epilog as written."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        # One line like every other error, and where to look instead of a usage block.
        self.exit(EXIT_USAGE, f"hybridkv: error: {message} (see `{self.prog} -h`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hybridkv",
        description="Cache transfer for hybrid LLMs in disaggregated serving.",
        epilog=EXIT_HELP,
        formatter_class=_TopFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {hybridkv.__version__}")
    commands = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    nested: dict[str, argparse._SubParsersAction] = {}
    for ep in commands:
        *path, leaf = ep.name.split(".")
        where = top
        for depth, part in enumerate(path):
            key = ".".join(path[: depth + 1])
            if key not in nested:
                members = sorted({e.name.split(".")[depth + 1] for e in commands if e.name.startswith(key + ".")})
                group_parser = where.add_parser(
                    part, help=f"subcommands: {', '.join(members)}", formatter_class=_Formatter,
                    description=f"`hybridkv {key.replace('.', ' ')}` subcommands; each has its own -h.")
                nested[key] = group_parser.add_subparsers(
                    dest=f"{key}_command", metavar="COMMAND", required=True
                )
            where = nested[key]
        try:
            register = ep.load()
        except ImportError as exc:
            # An optional part that is not installed must not take the whole CLI down; its
            # command says why it cannot run when it is run.
            sub = where.add_parser(leaf, help=f"(unavailable: {exc})", formatter_class=_Formatter)
            sub.set_defaults(handler=_unavailable(exc))
            continue
        summary = command_summary(register)
        # The summary is the description too, unless register() writes a longer one.
        sub = where.add_parser(leaf, help=summary, description=summary, formatter_class=_Formatter)
        register(sub)
    return parser


def command_summary(register) -> str:
    """One line saying what a command does: the first sentence of its register module's docstring
    (which may wrap over several lines)."""
    doc = (sys.modules[register.__module__].__doc__ or register.__doc__ or "").strip()
    paragraph = " ".join(doc.split("\n\n")[0].split())
    first = _SENTENCE_END.split(paragraph, maxsplit=1)[0]
    m = _SUMMARY.match(first)
    return m.group("text") if m else first.rstrip(".")


def _unavailable(exc: ImportError):
    def handler(_args: argparse.Namespace) -> int:
        # Raised again when the command is run: main() turns a missing extra into one line, and
        # anything else (hybridkv's own import broken) keeps its traceback.
        raise exc

    return handler


def missing_extra(exc: BaseException, command: str) -> str | None:
    """What `command` lacks and how to install it, for the ImportError of an optional dependency;
    None for any other.

    Only a missing top-level module counts: an installed dependency that fails to import is
    not fixed by installing it, and its traceback says why.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name in OPTIONAL_MODULES:
            extra = OPTIONAL_MODULES[seen.name]
            own, covers = COMMAND_EXTRAS.get(command.split()[0], ("", frozenset()))
            if seen.name in covers:
                extra = own
            return f"`hybridkv {command}` needs {seen.name}, which is not installed; {install_hint(extra)}"
        # hybridkv's own ImportErrors for optional parts already say what to install.
        if isinstance(seen, MissingExtra) or (isinstance(seen, ImportError) and _HINT.search(str(seen))):
            return f"`hybridkv {command}`: {seen}"
        seen = seen.__cause__ or seen.__context__
    return None


# ----------------------------------------------------------------------------- --json


class _JsonRun:
    """The one document of a --json run, held until stdout is stdout again."""

    def __init__(self) -> None:
        self.document: str | None = None


_json_run: _JsonRun | None = None


def print_json(doc: Any, **dumps: Any) -> None:
    """Write a command's --json document. In a run of `main`, this is the one thing on stdout; a
    second document is a bug. `dumps` go to json.dumps (indent, allow_nan, ...)."""
    text = json.dumps(doc, **dumps) + "\n"
    if _json_run is None:  # called outside main(), e.g. by a test of a handler
        sys.stdout.write(text)
        return
    if _json_run.document is not None:
        raise RuntimeError("a --json run wrote a second JSON document; stdout must hold exactly one")
    _json_run.document = text


def _flush_c_stdio() -> None:
    # Native libraries (NIXL, UCX) may hold stdout bytes in their C stdio buffer: flush them to
    # stderr before stdout is stdout again.
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # pragma: no cover - no libc to ask
        pass


def _run_json(handler, args: argparse.Namespace) -> int:
    global _json_run
    out = sys.stdout
    out.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (closed): nothing native can write there either
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    sys.stdout = sys.stderr  # Python-level writes (and logging set up now, like NIXL's) go to stderr
    _json_run = run = _JsonRun()
    try:
        status = int(handler(args) or 0)
    finally:
        _json_run = None
        sys.stdout = out
        for stream in (out, sys.__stdout__, sys.stderr):
            if stream is not None:
                stream.flush()
        _flush_c_stdio()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
    if run.document is None:
        raise RuntimeError("a --json run ended without a JSON document (print_json)")
    out.write(run.document)
    out.flush()
    _stdout_to_stderr_at_exit()
    return status


_EXIT_QUIET = False


def _stdout_to_stderr_at_exit() -> None:
    """Once the document is out, what native libraries print while the interpreter exits goes to stderr: ucxx's
    worker may warn from its destructor (a notifier thread stopped late), after the document, on stdout."""
    global _EXIT_QUIET
    if _EXIT_QUIET:
        return
    _EXIT_QUIET = True

    def quiet() -> None:
        try:
            for stream in (sys.stdout, sys.__stdout__):
                if stream is not None:
                    stream.flush()
            _flush_c_stdio()
            os.dup2(2, 1)
        except (OSError, ValueError):  # exiting: never raise
            pass

    # threading's exit hooks run before the interpreter joins its threads and tears modules down (where the
    # destructors run); atexit's after that join
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(quiet)
    except RuntimeError:
        atexit.register(quiet)


# ----------------------------------------------------------------------------- main


def _command_name(args: argparse.Namespace) -> str:
    words = [args.command]
    while (sub := getattr(args, f"{'.'.join(words)}_command", None)) is not None:
        words.append(sub)
    return " ".join(words)


def error(message: str, status: int) -> int:
    lines = message.splitlines() or [""]
    print(f"hybridkv: error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(f"  {line}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.error(f"command {args.command!r} has no handler")
    try:
        if getattr(args, "json", False) is True:
            return _run_json(handler, args)
        return int(handler(args) or 0)
    except ValueError as exc:
        # Bad input is the caller's to fix: say what was wrong, exit like argparse does.
        return error(str(exc), EXIT_USAGE)
    except CommandError as exc:
        return error(str(exc), EXIT_FAILED)
    except HybridKVError as exc:
        # A peer or the data path failed: the run could not finish, hybridkv worked as designed.
        return error(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    except ImportError as exc:
        hint = missing_extra(exc, _command_name(args))
        if hint is None:
            raise
        return error(hint, EXIT_FAILED)
    except KeyboardInterrupt:
        print("hybridkv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    # Run as `python -m hybridkv.cli`, this file is `__main__`, a second copy of the module: the
    # commands raise hybridkv.cli's CommandError, which this copy's `main` would not catch.
    from hybridkv.cli import main as _main

    sys.exit(_main())
