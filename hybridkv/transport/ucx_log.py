"""What UCX said about a run: its console captured to a file, and its protocol tables read back.

With ``UCX_PROTO_INFO=y`` UCX prints, per endpoint configuration and operation, which transport
serves which message sizes. `hybridkv bench transfer --proto-log` captures that console for both of
its processes and summarises which transports carried NIXL's reads (tools/device/transfer_2gpu.sh too).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys


@contextlib.contextmanager
def console_to(path: str | None):
    """fd 1 and 2 of this process and of the producer it spawns go to `path` (UCX prints to them)."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(Exception):  # UCX writes through C stdio: flush its buffers into the log too
            import ctypes

            ctypes.CDLL(None).fflush(None)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for s in saved:
            os.close(s)


def _tables(text: str):
    """UCX_PROTO_INFO tables as (title, rows): title = context, scope and operation; rows = (range, how, via).

    Lines are grouped by the [host:pid:tid] prefix UCX puts on each, since both processes write one log."""

    state: dict[str, tuple[list[str], list[tuple[str, ...]], list[bool]]] = {}
    for line in text.splitlines():
        cut = min((i for i in (line.find("|"), line.find("+-")) if i >= 0), default=-1)
        if cut < 0:
            continue
        who = re.search(r"\[[^\]\s]*:(\d+):\d+\]", line[:cut])
        title, rows, in_rows = state.setdefault(who.group(1) if who else "", ([], [], [False]))
        body = line[cut:].strip()
        if body.startswith("+"):
            if in_rows[0] and rows:  # the closing border
                yield " ".join(title), list(rows)
                title.clear(), rows.clear()
                in_rows[0] = False
            continue
        cells = [c.strip() for c in body.strip("|").split("|")]
        if cells[:2] == ["Range", "Description"]:
            in_rows[0] = True
        elif in_rows[0]:
            if len(cells) >= 3:
                rows.append(tuple(cells[:3]))
        else:
            title.extend(c for c in cells if c)


def summarize_transports(text: str) -> dict:
    """Which UCX transports NIXL's agents chose for remote reads/writes (ucxx's control channel left out).

    UCX prints a table for every operation it set up, not only those that moved bytes; the benchmark
    moves its bytes with READs only, so ``software_emulation`` is judged on the read tables and
    emulated tables of other operations are listed apart (``emulated_elsewhere``).
    """

    data_path: list[str] = []
    elsewhere: list[str] = []
    tls: set[str] = set()
    emulated = False
    for title, rows in _tables(text):
        if not title.startswith("hybridkv-") or " self " in f" {title} " or "remote memory" not in title:
            continue
        op = title[title.index("remote memory"):]
        for rng, how, via in rows:
            entry = f"{op}: {rng} {how} via {via}"
            if entry not in data_path:
                data_path.append(entry)
            tls.update(re.findall(r"\b([a-z][a-z0-9_]*)/[^\s,|]+", f"{how} {via}"))
            if "emulation" in how:
                if op.startswith("remote memory read"):
                    emulated = True
                elif entry not in elsewhere:
                    elsewhere.append(entry)
    return {"data_path": data_path, "tls": sorted(tls), "cuda_ipc": "cuda_ipc" in tls,
            "software_emulation": emulated, "emulated_elsewhere": elsewhere, "proto_lines": text.count("|")}
