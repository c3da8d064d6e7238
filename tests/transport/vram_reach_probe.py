"""What a NIXL metadata holder reaches in a producer's GPU memory over cuda_ipc (docs/security.md, "What a secret
holder can reach, per transport"). Not a test: it needs a GPU and prints what it saw.

    python -m tests.transport.vram_reach_probe          # one GPU, two processes, UCX picks cuda_ipc

The owner allocates one 4 MiB CUDA tensor (PyTorch's caching allocator), puts a marker 2 MiB into it and registers
only its first 1 MiB with NIXL. The reader, holding the owner's metadata, tries:
  1. a READ inside the registered span (the control);
  2. the same READ of the marker with the metadata as given (NIXL checks it against its copy of the registration);
  3. the marker with a copy of the metadata whose registered length was edited from 1 MiB to 4 MiB;
  4. after the owner removed the reader's agent, deregistered the span and registered it again, a READ inside the span
     with the old (unedited) metadata: is a removed peer revoked?
Each line says what came back; the owner's process survives each step or the line says it did not.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import time

SPAN = 1 << 20
WHOLE = 4 << 20
MARK_AT = 2 << 20
MARK = 0xA5
PROBE = 4096


def _agent(name: str):
    from hybridkv.transport.nixl_shim import load_nixl

    api = load_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _owner(out, inbox) -> None:
    import numpy as np
    import torch

    agent = _agent("vram-owner")
    whole = torch.full((WHOLE,), 3, dtype=torch.uint8, device="cuda:0")
    whole[MARK_AT:MARK_AT + PROBE] = MARK
    rows = np.array([[whole.data_ptr(), SPAN, 0]], dtype=np.uint64)
    reg = agent.register_memory(rows, "VRAM")
    torch.cuda.synchronize()
    out.put((agent.get_agent_metadata(), whole.data_ptr()))
    reader = agent.add_remote_agent(inbox.get())
    reader = reader.decode() if isinstance(reader, bytes) else reader
    while inbox.empty():
        agent.get_new_notifs()
        time.sleep(0.001)
    assert inbox.get() == "rotate"
    agent.remove_remote_agent(reader)
    agent.deregister_memory(reg)
    whole[:SPAN] = 7  # new contents: a READ after this shows whose bytes it got
    torch.cuda.synchronize()
    agent.register_memory(rows, "VRAM")
    out.put("rotated")
    while inbox.empty():
        agent.get_new_notifs()
        time.sleep(0.001)


def _read(agent, peer: str, local, addr: int) -> tuple[str, list[int]]:
    import numpy as np
    import torch

    local.zero_()
    torch.cuda.synchronize()
    src = agent.get_xfer_descs(np.array([[local.data_ptr(), PROBE, 0]], dtype=np.uint64), "VRAM")
    dst = agent.get_xfer_descs(np.array([[addr, PROBE, 0]], dtype=np.uint64), "VRAM")
    try:
        handle = agent.initialize_xfer("READ", src, dst, peer, b"")
        state = agent.transfer(handle)
        stop = time.monotonic() + 5.0
        while state not in ("DONE", "ERR") and time.monotonic() < stop:
            state = agent.check_xfer_state(handle)
    except Exception as exc:  # NIXL refuses a descriptor outside its copy of the registration here
        state = f"{type(exc).__name__}: {exc}"[:160]
    torch.cuda.synchronize()
    return state, sorted(set(local.cpu().tolist()))


def _widened(metadata: bytes) -> tuple[bytes, int]:
    """The metadata with every little-endian u64 equal to the registered length replaced by the whole tensor's."""
    old, new = struct.pack("<Q", SPAN), struct.pack("<Q", WHOLE)
    return metadata.replace(old, new), metadata.count(old)


def main() -> int:
    import torch

    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_owner, args=(out, inbox), daemon=True)
    owner.start()
    metadata, base = out.get(timeout=120)
    local = torch.zeros(PROBE, dtype=torch.uint8, device="cuda:0")
    import numpy as np

    reader = _agent("vram-reader")
    reader.register_memory(np.array([[local.data_ptr(), PROBE, 0]], dtype=np.uint64), "VRAM")
    peer = reader.add_remote_agent(metadata)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    print(f"1. inside the span: {_read(reader, peer, local, base)} (expected DONE, [3])", flush=True)
    print(f"2. marker, metadata as given: {_read(reader, peer, local, base + MARK_AT)}", flush=True)
    tampered, hits = _widened(metadata)
    other = _agent("vram-tamperer")
    other.register_memory(np.array([[local.data_ptr(), PROBE, 0]], dtype=np.uint64), "VRAM")
    try:
        tpeer = other.add_remote_agent(tampered)
        tpeer = tpeer.decode() if isinstance(tpeer, bytes) else tpeer
        got = _read(other, tpeer, local, base + MARK_AT)
    except Exception as exc:
        got = (f"{type(exc).__name__}: {exc}"[:160], [])
    print(f"3. marker, length edited in {hits} place(s): {got} (the marker is [{MARK}])", flush=True)
    print(f"   owner alive after 3: {owner.is_alive()}", flush=True)
    inbox.put(reader.get_agent_metadata())
    inbox.put("rotate")
    out.get(timeout=60)
    state, got4 = _read(reader, peer, local, base)
    print(f"4. after remove_remote_agent and re-registration, old metadata: {state}, {got4} "
          f"({'NOT revoked: the removed reader still reads' if state == 'DONE' and got4 == [7] else 'revoked'})",
          flush=True)
    inbox.put("stop")
    owner.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
