"""The `hybridkv` command line.

Subcommands live in the packages that own them and are found through the
`hybridkv.commands` entry-point group, so this module knows none of them.
Each entry point names a `register(parser)` function that adds its arguments
and sets `handler=fn(args) -> int` as a parser default. The first line of the
register module's docstring, "`hybridkv NAME`: what it does.", is the command's
one-line help in `hybridkv -h`.

Errors: a handler's ValueError (bad input), CommandError (a run that ended in a
way its user can act on, e.g. a --timeout that ran out) and the ImportError of an
optional dependency (names the extra to install) print as one `hybridkv: error:`
line on stderr and a non-zero exit. Anything else is a bug in hybridkv and keeps
its traceback: that is what a bug report needs.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib.metadata import entry_points

import hybridkv

ENTRY_POINT_GROUP = "hybridkv.commands"

#: Import name of an optional dependency -> the extra of pyproject.toml that installs it. torch maps
#: to `kernels` (torch and Triton), which covers every command that imports torch.
OPTIONAL_MODULES = {
    "torch": "kernels",
    "triton": "kernels",
    "matplotlib": "sims",
    "fla": "bench",
    "nixl": "transport",
    "nixl_cu12": "transport",
    "nixl_cu13": "transport-cu13",
    "ucxx": "transport",
    "vllm": "vllm",
    "sglang": "sglang",
}

# Exit statuses: 2 for bad input, as argparse uses for bad flags; 1 for a run that could not finish.
EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

_SUMMARY = re.compile(r"^`hybridkv [^`]*`:\s*(?P<text>.+?)\.?$")


class CommandError(Exception):
    """A command's run ended in a way its user can act on, not through a bug: printed without a
    traceback. The message's first line is the error line; further lines are details under it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="Cache transfer for hybrid LLMs in disaggregated serving.",
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
                    part, help=f"subcommands: {', '.join(members)}",
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
            sub = where.add_parser(leaf, help=f"(unavailable: {exc})")
            sub.set_defaults(handler=_unavailable(exc))
            continue
        summary = command_summary(register)
        # The summary is the description too, unless register() writes a longer one.
        sub = where.add_parser(leaf, help=summary, description=summary)
        register(sub)
    return parser


def command_summary(register) -> str:
    """One line saying what a command does, from its register module's docstring."""
    doc = (sys.modules[register.__module__].__doc__ or register.__doc__ or "").strip()
    first = doc.splitlines()[0].strip() if doc else ""
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
            return (f"`hybridkv {command}` needs {seen.name}, which is not installed: "
                    f"pip install 'hybridkv[{OPTIONAL_MODULES[seen.name]}]'")
        # hybridkv's own ImportErrors for optional parts already say what to install.
        if isinstance(seen, ImportError) and "pip install 'hybridkv[" in str(seen):
            return f"`hybridkv {command}`: {seen}"
        seen = seen.__cause__ or seen.__context__
    return None


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
        return int(handler(args) or 0)
    except ValueError as exc:
        # Bad input is the caller's to fix: say what was wrong, exit like argparse does.
        return error(str(exc), EXIT_USAGE)
    except CommandError as exc:
        return error(str(exc), EXIT_FAILED)
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
