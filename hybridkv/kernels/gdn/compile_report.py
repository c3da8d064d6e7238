"""`hybridkv kernels report`: compile every Triton kernel of hybridkv for a GPU architecture, on any machine.

No GPU is needed: Triton lowers to PTX and its bundled ptxas assembles the cubin for the target named
here (sm_90 Hopper, sm_100 Blackwell). The report reads what decides a kernel's speed before any run:
registers per thread and spills (cuobjdump's resource usage), shared memory, tensor-core instructions
(wgmma / tcgen05 / mma.sync) and asynchronous copies in the PTX. Device time is scarce; a kernel change
that spills, loses its tensor-core GEMMs or its pipelined loads shows here first.

Each kernel is compiled the way its host code launches it on Qwen3.5 shapes (dk = dv = 128, bf16
activations): the same constexprs, warps and stages, and the argument specialisations Triton's launcher
makes at run time (16-byte-aligned pointers, ints divisible by 16, a stride of 1 as a constant).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass

# The catalogue lives beside this module; its names stay reachable here (`compile_report._specs`, `.Launch`, ...).
from hybridkv.kernels.gdn.compile_specs import D, Arch, KernelSpec, Launch, _specs  # noqa: F401


@dataclass(frozen=True, kw_only=True)
class Report:
    kernel: str
    launch: str
    arch: int
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int  # per-thread stack (local memory), where ptxas put what did not fit in registers
    shared_bytes: int
    mma_kind: str  # the tensor-core instruction family in the PTX: wgmma, tcgen05, mma.sync, or "-"
    mma: int  # tensor-core instructions of that family in the PTX (static count)
    async_copies: int  # cp.async / bulk (TMA) copies into shared memory in the PTX (static count)
    # The most copy groups (one per load) an async_wait leaves in flight (TTGIR). 0 with copies: every
    # wait drains them, so a loop waits at each step for the copies it issued at the end of the step
    # before (two stages).
    copies_in_flight: int = 0
    # Warp shuffles and CTA barriers in the PTX (static counts): what reductions across lanes and layout changes
    # through shared memory cost a kernel whose time is latency, not bandwidth or FLOPs (the inverse).
    shuffles: int = 0
    barriers: int = 0


_MMA = {"wgmma": r"\bwgmma\.mma_async\b", "tcgen05": r"\btcgen05\.mma\b", "mma.sync": r"\bmma\.sync\b"}
_ASYNC_COPY = r"\bcp\.async\.(?:ca|cg)\.shared|\bcp\.async\.bulk\.(?:tensor\.\w+\.)?shared"


def _jit_function(spec: KernelSpec):
    import importlib

    obj = getattr(importlib.import_module(spec.module), spec.attr)
    while not hasattr(obj, "arg_names"):  # an autotuner or heuristics wrapper around the JITFunction
        obj = obj.fn
    return obj


def _tool(name: str) -> str:
    import triton.backends.nvidia as nv

    path = os.path.join(os.path.dirname(nv.__file__), "bin", name)
    if not os.path.exists(path):
        raise ValueError(f"Triton's NVIDIA backend has no {name} at {path}; install a triton wheel with it")
    return path


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the cubin's one kernel, as cuobjdump reports them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    if regs is None or stack is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    return int(regs.group(1)), int(stack.group(1))


def compiled_kernel(spec: KernelSpec, launch: Launch, arch: Arch):
    """Triton's compiled kernel (its ``asm`` holds ttgir, ptx and cubin) of one launch of ``spec`` for ``arch``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function(spec)
    constants = {**spec.constants, **launch.constants}
    signature = {**spec.signature, **launch.types}
    # A str names the state's element type; None is a launch without a state pointer (a constexpr None).
    state_dtype = constants.pop("state") if isinstance(constants.get("state"), str) else None
    if state_dtype is not None:
        signature["state"] = f"*{state_dtype}"
    if "desc" in constants:  # a tensor descriptor's type ("tensordesc<bf16[1, 1, 64, 128]>") set per launch
        signature["desc"] = constants.pop("desc")
    unknown = set(signature) | set(constants)
    missing = [a for a in fn.arg_names if a not in unknown]
    extra = unknown - set(fn.arg_names)
    if missing or extra:
        raise ValueError(f"{spec.name}: spec does not match {spec.attr}'s arguments: missing {missing}, "
                         f"unknown {sorted(extra)}")
    full = {a: ("constexpr" if a in constants else signature[a]) for a in fn.arg_names}
    index = {a: i for i, a in enumerate(fn.arg_names)}
    aligned = [a for a, t in full.items() if t.startswith("*")] + list(spec.aligned)
    source = ASTSource
    if spec.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=full, constexprs={(index[a],): v for a, v in constants.items()},
                 attrs={(index[a],): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(src, target=GPUTarget("cuda", int(arch), 32),
                          options={"num_warps": launch.num_warps, "num_stages": launch.num_stages,
                                   **({} if launch.maxnreg is None else {"maxnreg": launch.maxnreg})})


def sass(cubin: bytes) -> str:
    """cuobjdump's SASS listing of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout


_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def loop_mix(listing: str) -> tuple[int, Counter]:
    """(instructions, opcode counts) of a SASS listing's main loop: from the last backward branch's target to the
    branch. Predicates are dropped and modifiers cut (`FFMA.FTZ` counts as FFMA)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, listing.splitlines()) if m]
    back = [(at, int(t.group(1), 16)) for at, ins in code
            if (t := re.search(r"\bBRA\s+0x([0-9a-f]+)", ins)) and int(t.group(1), 16) < at]
    if not back:
        raise ValueError("no backward branch in the listing: no loop")
    end, start = max(back)
    body = [ins for at, ins in code if start <= at <= end]
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in body)
    return len(body), ops


def compile_one(spec: KernelSpec, launch: Launch, arch: Arch) -> Report:
    compiled = compiled_kernel(spec, launch, arch)
    ptx = compiled.asm["ptx"]
    registers, spill = _resource_usage(compiled.asm["cubin"])
    counts = {kind: len(re.findall(pattern, ptx)) for kind, pattern in _MMA.items()}
    kind = max(counts, key=counts.get)
    return Report(
        kernel=spec.name, launch=launch.label, arch=int(arch), num_warps=launch.num_warps,
        num_stages=launch.num_stages, registers=registers, spill_bytes=spill,
        shared_bytes=int(compiled.metadata.shared),
        mma_kind=kind if counts[kind] else "-", mma=counts[kind],
        async_copies=len(re.findall(_ASYNC_COPY, ptx)),
        copies_in_flight=max((int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", compiled.asm["ttgir"])),
                             default=0),
        shuffles=len(re.findall(r"\bshfl\.sync\b", ptx)), barriers=len(re.findall(r"\bbar\.sync\b", ptx)),
    )


def reports(archs: tuple[Arch, ...], only: str | None = None) -> Iterator[Report]:
    specs = _specs()
    names = [s.name for s in specs]
    if only is not None and only not in names:
        # Here, not in the generator below: a bad name is refused before the table's header prints.
        raise ValueError(f"--kernel {only!r} is not one of {names}")
    return _compile_all(archs, specs, only)


def _compile_all(archs: tuple[Arch, ...], specs, only: str | None) -> Iterator[Report]:
    for arch in archs:
        for spec in specs:
            if (only is None or spec.name == only) and arch in spec.archs:
                for launch in spec.launches:
                    yield compile_one(spec, launch, arch)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=[a.name.lower() for a in Arch], action="append",
                        help="target (repeatable); default: hopper and blackwell")
    parser.add_argument("--kernel", default=None, help="one kernel by name (default: all)")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import triton  # noqa: F401  (missing, hybridkv.cli names the extra that installs it)

    archs = tuple(Arch[a.upper()] for a in args.arch) if args.arch else (Arch.HOPPER, Arch.BLACKWELL)
    found = reports(archs, args.kernel)
    rows = []
    if not args.json:
        print(f"{'kernel':18} {'launch':18} {'sm':>4} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>7} "
              f"{'smem KiB':>8} {'mma':>14} {'async':>5} {'flight':>6} {'shfl':>5} {'bar':>4}")
    for r in found:
        rows.append(r)
        if not args.json:
            print(f"{r.kernel:18} {r.launch:18} {r.arch:>4} {r.num_warps:>5} {r.num_stages:>6} {r.registers:>5} "
                  f"{r.spill_bytes:>7} {r.shared_bytes / 1024:>8.1f} {f'{r.mma_kind} {r.mma}':>14} {r.async_copies:>5} "
                  f"{r.copies_in_flight:>6} {r.shuffles:>5} {r.barriers:>4}",
                  flush=True)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    return 0
