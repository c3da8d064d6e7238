"""The `hybridkv` command line.

Subcommands live in the packages that own them and are found through the
`hybridkv.commands` entry-point group, so this module knows none of them.
Each entry point names a `register(parser)` function that adds its arguments
and sets `handler=fn(args) -> int` as a parser default.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "hybridkv.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="Cache transfer for hybrid LLMs in disaggregated serving.",
    )
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    nested: dict[str, argparse._SubParsersAction] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        *path, leaf = ep.name.split(".")
        where = top
        for depth, part in enumerate(path):
            key = ".".join(path[: depth + 1])
            if key not in nested:
                group_parser = where.add_parser(part, help=f"{part} subcommands")
                nested[key] = group_parser.add_subparsers(
                    dest=f"{key}_command", metavar="COMMAND", required=True
                )
            where = nested[key]
        sub = where.add_parser(leaf, help=f"(from {ep.value.split(':')[0]})")
        try:
            register = ep.load()
        except ImportError as exc:
            # An optional part that is not installed (or not written yet) must not
            # take the whole CLI down; its command says why it cannot run.
            sub.set_defaults(handler=_unavailable(ep.name, exc))
            continue
        register(sub)
    return parser


def _unavailable(name: str, exc: ImportError):
    def handler(_args: argparse.Namespace) -> int:
        print(f"hybridkv: '{name.replace('.', ' ')}' is unavailable: {exc}", file=sys.stderr)
        return 1

    return handler


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
        print(f"hybridkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
