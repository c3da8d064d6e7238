"""The implementations `hybridkv bench gdn` measures beside hybridkv's: for prefill FLA's own Triton path, FlashQLA and
FlashInfer; for decode FLA's fused recurrent step and FlashInfer's decode on a slot pool.

fla-core 0.6.0 dispatches `chunk_gated_delta_rule` to FlashQLA (Qwen's TileLang kernels) whenever the `flash_qla`
package can be found, so with both installed a plain FLA call times FlashQLA twice. The FLA column therefore calls
FLA with `FLA_FLASH_QLA=0` set for the duration of each call (FLA reads it per call, `fla/backends.py`), after checking
that FLA's backend registry then picks no backend at all, i.e. its Triton path; FlashQLA is called through its own API
with `auto_cp=True`, as FLA's backend calls it. FlashInfer (vLLM's default GDN prefill backend on Hopper) is called
through its own API with its default routing, the arguments mapped by `flashinfer_args`. docs/background/gdn.md
section 3 has the packages' facts.

Nothing here imports torch, FLA, FlashQLA or FlashInfer until a loader runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hybridkv.benchmarks.gdn import flashinfer_args

# FLA's switch for its FlashQLA backend (FlashQLABackend.env_var, also FLA_<backend_type>).
FLA_FLASH_QLA_ENV = "FLA_FLASH_QLA"
GDN_OPERATION = "gated_delta_rule"


@dataclass(frozen=True, kw_only=True)
class Loaded:
    """One baseline: its callable (None when it cannot run here) and why not, or which version runs."""

    name: str
    fn: Callable[..., Any] | None
    note: str


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def fla_default_backend() -> str | None:
    """The backend FLA's `chunk_gated_delta_rule` dispatches to on this machine before per-call checks (its
    `backend_type`, e.g. "flash_qla"), or None for its own Triton path (also FLA before 0.6, which had no dispatch)."""
    try:
        from fla.backends import _load_operation_registry
    except ImportError:
        return None
    active = _load_operation_registry(GDN_OPERATION).get_active()
    return None if active is None else active.backend_type


def _version(module: Any) -> str:
    return str(getattr(module, "__version__", "unknown version"))


def load_fla_chunk() -> Loaded:
    """FLA's chunked prefill on its own Triton path, whatever else is installed."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        return Loaded(name="fla", fn=None, note=f"not installed ({exc})")
    default = fla_default_backend()
    with _env(FLA_FLASH_QLA_ENV, "0"):
        bypassed = fla_default_backend()
    if bypassed is not None:
        # Timing this would time another backend under FLA's name.
        return Loaded(name="fla", fn=None,
                      note=f"{FLA_FLASH_QLA_ENV}=0 leaves FLA's dispatch on backend {bypassed!r}, not its Triton path")

    def triton_path(*args: Any, **kwargs: Any) -> Any:
        with _env(FLA_FLASH_QLA_ENV, "0"):
            return chunk_gated_delta_rule(*args, **kwargs)

    route = "Triton path" if default is None else f"Triton path ({FLA_FLASH_QLA_ENV}=0; default would be {default})"
    return Loaded(name="fla", fn=triton_path, note=f"fla-core {_version(fla)}, {route}")


def load_fla_recurrent() -> Callable[..., Any] | None:
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return fused_recurrent_gated_delta_rule


def load_flash_qla() -> Loaded:
    """FlashQLA's chunked prefill through its own API, with automatic intra-card context parallelism."""
    try:
        import flash_qla
    except Exception as exc:  # noqa: BLE001 - tilelang can fail at import in many ways (no nvcc, GPU arch, libs)
        kind = "not installed" if isinstance(exc, ImportError) else "failed to import"
        return Loaded(name="flash_qla", fn=None, note=f"{kind} ({type(exc).__name__}: {exc})")
    chunk = flash_qla.chunk_gated_delta_rule

    def auto_cp(*args: Any, **kwargs: Any) -> Any:
        return chunk(*args, auto_cp=True, **kwargs)

    tilelang = sys.modules.get("tilelang")
    with_tilelang = "" if tilelang is None else f" (tilelang {_version(tilelang)})"
    return Loaded(name="flash_qla", fn=auto_cp, note=f"flash-qla {_version(flash_qla)}{with_tilelang}, auto_cp=True")


# Compute capability majors FlashInfer 0.7.2's `chunk_gated_delta_rule` dispatches to a kernel for (sm90; sm100 and
# sm103; sm120); on any other GPU it raises NotImplementedError at the first call.
FLASHINFER_GDN_ARCH_MAJORS = (9, 10, 12)


def flashinfer_gpu_problem(capability: tuple[int, int] | None) -> str | None:
    """Why FlashInfer's GDN prefill cannot run on a GPU of this compute capability (None: no GPU), or None if it can."""
    if capability is None:
        return "needs a CUDA GPU of compute capability 9.0 (Hopper) or newer; torch sees none here"
    if capability[0] not in FLASHINFER_GDN_ARCH_MAJORS:
        archs = ", ".join(f"sm{m}x" for m in FLASHINFER_GDN_ARCH_MAJORS)
        return f"has GDN prefill kernels for {archs} only, this GPU is sm{capability[0]}{capability[1]}"
    return None


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown version"


def flashinfer_call(chunk: Callable[..., Any]) -> Callable[..., Any]:
    """FlashInfer's `chunk_gated_delta_rule` (or a stand-in keeping its contract) called with FLA's arguments and
    returning FLA's layouts, so that the bench checks it against the reference as it checks the others."""

    def mapped(q: Any, k: Any, v: Any, g: Any, beta: Any, **kwargs: Any) -> Any:
        fi_kwargs, unpack = flashinfer_args.to_flashinfer(q, k, v, g, beta, **kwargs)
        return flashinfer_args.from_flashinfer(chunk(**fi_kwargs), unpack)

    return mapped


def load_flashinfer() -> Loaded:
    """FlashInfer's chunked GDN prefill through its own API (CuTe DSL kernels on sm90; context-parallel where its
    heuristic picks it), hybridkv's arguments and results mapped by `flashinfer_args`."""
    try:
        import flashinfer
        from flashinfer.gdn_prefill import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - its import pulls in CuTe DSL, tvm_ffi, cuda-bindings: many ways to fail
        kind = "not installed" if isinstance(exc, ImportError) else "failed to import"
        return Loaded(name="flashinfer", fn=None, note=f"{kind} ({type(exc).__name__}: {exc})")
    import torch

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    problem = flashinfer_gpu_problem(capability)
    if problem is not None:
        return Loaded(name="flashinfer", fn=None, note=f"flashinfer-python {_version(flashinfer)} {problem}")

    return Loaded(name="flashinfer", fn=flashinfer_call(chunk_gated_delta_rule),
                  note=f"flashinfer-python {_version(flashinfer)} (nvidia-cutlass-dsl "
                       f"{_dist_version('nvidia-cutlass-dsl-libs-base')}), sm{capability[0]}{capability[1]}, "
                       f"use_cp=auto")


def flashinfer_decode_call(decode: Callable[..., Any]) -> Callable[..., Any]:
    """FlashInfer's `gated_delta_rule_decode_pretranspose` (or a stand-in keeping its contract) called as hybridkv's
    `gated_delta_rule_decode` is: q, k `[N, H, K]`, v `[N, HV, V]`, a and b `[N, HV]` (bf16 or fp16: FlashInfer
    refuses fp32 gate inputs, so the caller passes them in that dtype), A_log and dt_bias `[HV]`, a pool
    `[slots, HV, V, K]` (the layout both use) read and written in place at `idx`. Returns o `[N, HV, V]`.

    The inputs gain FlashInfer's token axis as views; nothing is copied, so the timed call is FlashInfer's alone."""

    def mapped(q: Any, k: Any, v: Any, a: Any, b: Any, A_log: Any, dt_bias: Any, pool: Any, idx: Any) -> Any:
        o, _ = decode(q=q[:, None], k=k[:, None], v=v[:, None], state=None, A_log=A_log, a=a[:, None],
                      dt_bias=dt_bias, b=b[:, None], scale=q.shape[-1] ** -0.5, use_qk_l2norm=True,
                      initial_state=pool, initial_state_indices=idx)
        return o[:, 0]

    return mapped


def load_flashinfer_decode() -> Loaded:
    """FlashInfer's GDN decode on a slot pool (`gdn_decode.gated_delta_rule_decode_pretranspose`: CuTe DSL kernels, a
    bf16-state fast path and an fp32 one), the decode an engine would take from FlashInfer (vLLM PR #41966)."""
    try:
        import flashinfer
        from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose
    except Exception as exc:  # noqa: BLE001 - as load_flashinfer
        kind = "not installed" if isinstance(exc, ImportError) else "failed to import"
        return Loaded(name="flashinfer_decode", fn=None, note=f"{kind} ({type(exc).__name__}: {exc})")
    import torch

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability is None or capability[0] < 9:
        found = "none" if capability is None else f"sm{capability[0]}{capability[1]}"
        return Loaded(name="flashinfer_decode", fn=None,
                      note=f"flashinfer-python {_version(flashinfer)}'s GDN decode needs sm90+, this GPU: {found}")
    return Loaded(name="flashinfer_decode", fn=flashinfer_decode_call(gated_delta_rule_decode_pretranspose),
                  note=f"flashinfer-python {_version(flashinfer)} gated_delta_rule_decode_pretranspose, pool + indices")
