"""Does a peer removed by the owner lose data-plane access? (docs/security.md, "What a secret holder can
reach, per transport".) Not a test: prints what it saw, for the NIXL/UCX and transports at hand.

    UCX_TLS=tcp python -m tests.transport.revocation_probe      # or cma,tcp / posix,tcp / unset

An owner process registers a host buffer and hands its NIXL metadata to a reader (this process), which READs
it; the owner then removes the reader's agent (``remove_remote_agent``), deregisters the buffer, overwrites it
and registers it again (new rkeys); the reader READs once more with its old copy of the metadata. On NIXL 1.5.1 /
UCX 1.21 over tcp, cma and posix shm the second READ completes with the new contents: nothing revoked it.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

SIZE = 1 << 16


def _agent(name: str):
    from hybridkv.transport.nixl_shim import load_nixl

    api = load_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _rows(buf: np.ndarray) -> np.ndarray:
    return np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64)


def _owner(out, inbox) -> None:
    agent = _agent("probe-owner")
    buf = (np.arange(SIZE) % 251).astype(np.uint8)
    reg = agent.register_memory(_rows(buf), "DRAM")
    out.put((agent.get_agent_metadata(), buf.ctypes.data))
    reader = agent.add_remote_agent(inbox.get())  # as a producer loads a consumer's, then drops it
    reader = reader.decode() if isinstance(reader, bytes) else reader
    agent.remove_remote_agent(reader)
    agent.deregister_memory(reg)
    buf[:] = 7  # new contents: a READ after this shows whose bytes it got
    reg = agent.register_memory(_rows(buf), "DRAM")
    out.put("rotated")
    while inbox.empty():
        agent.get_new_notifs()  # progress, as a serving producer does
        time.sleep(0.001)


def _read(agent, peer: str, local: np.ndarray, addr: int) -> tuple[str, list[int]]:
    local[:] = 0
    src = agent.get_xfer_descs(np.array([[local.ctypes.data, 4096, 0]], dtype=np.uint64), "DRAM")
    dst = agent.get_xfer_descs(np.array([[addr, 4096, 0]], dtype=np.uint64), "DRAM")
    try:
        handle = agent.initialize_xfer("READ", src, dst, peer, b"")
        state = agent.transfer(handle)
        stop = time.monotonic() + 5.0
        while state not in ("DONE", "ERR") and time.monotonic() < stop:
            state = agent.check_xfer_state(handle)
    except Exception as exc:
        state = f"{type(exc).__name__}: {exc}"[:120]
    return state, local[:4].tolist()


def main() -> int:
    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_owner, args=(out, inbox), daemon=True)
    owner.start()
    metadata, addr = out.get(timeout=60)
    agent = _agent("probe-reader")
    local = np.zeros(SIZE, dtype=np.uint8)
    agent.register_memory(_rows(local), "DRAM")
    peer = agent.add_remote_agent(metadata)
    print("READ before removal:", *_read(agent, peer, local, addr), flush=True)
    inbox.put(agent.get_agent_metadata())
    out.get(timeout=60)
    state, got = _read(agent, peer, local, addr)
    print("READ after remove_remote_agent and re-registration, old metadata:", state, got, flush=True)
    print("revoked" if state != "DONE" or got != [7] * 4 else "NOT revoked: the removed reader still reads")
    inbox.put("stop")
    owner.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
