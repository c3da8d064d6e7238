"""FLA-style GDN prefill arguments (hybridkv's and `hybridkv bench gdn`'s) as FlashInfer 0.7.2's
`flashinfer.gdn_prefill.chunk_gated_delta_rule` takes them, and its results back.

FlashInfer's contract, from its docstring, checked against its sm90 kernel (`delta_rule_sm90.py`) and its tests:

- q, k `[T_total, H, K]`, v `[T_total, HV, V]`: no batch dimension; sequences are always given by `cu_seqlens`
  (required, int32 or int64, on q's device), so a `[B, T]` batch becomes B sequences of T tokens.
- g is the decay factor alpha itself, not FLA's log decay: the kernel takes log2(alpha + 1e-10) and sums it over
  the chunk (its `AlphaProcessor`), so alpha = exp(g) is passed. fp32 `[T_total, HV]`, as is beta.
- States are `[N, HV, V, K]` (V before K, FLA's and hybridkv's are `[N, HV, K, V]`; FlashInfer's own tests transpose
  its final state before comparing with a K-by-V reference). The final state is fp32, allocated by FlashInfer.
- Value head h reads key head h // (HV // H), as in hybridkv; the output is `[T_total, HV, V]` in q's dtype.
- `use_qk_l2norm_in_kernel`: FlashInfer normalizes q and k (eps 1e-6, fp32 sums) in a kernel of its own before the
  prefill kernel and rounds them back to q's dtype; hybridkv's reference keeps them in fp32.
- `scale` None means 1/sqrt(K) in both; it is passed explicitly all the same.

Everything else is left at FlashInfer's defaults (`use_cp="auto"`, `backend="auto"`), as vLLM calls it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

HEAD_DIM = 128  # FlashInfer's sm90 (and sm100) GDN prefill kernels take head_size 128 only
IO_DTYPES = ("bfloat16", "float16")  # q/k/v/o dtypes its CuTe DSL kernels are built for
CU_SEQLENS_DTYPES = ("int32", "int64")


@dataclass(frozen=True, kw_only=True)
class Unpack:
    """How FlashInfer's flat results map back: `batch` sequences of `length` tokens (B = 1 when varlen)."""

    batch: int
    length: int
    output_final_state: bool


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=64)
def _even_cu_seqlens(batch: int, length: int, device: str) -> Any:
    # Built once per shape: FlashInfer never writes it, and a new tensor per call would put an arange kernel (and
    # an allocation) into the timed call of a baseline that hybridkv's [B, T] inputs do not need.
    import torch

    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


class _DecayCache:
    """exp(g) of the last g seen, kept while that tensor is unchanged (same object, same version counter).

    FlashInfer takes the decay itself where FLA and hybridkv take its log; an engine feeding FlashInfer would have
    its gating kernel write the decay as cheaply as the log, so the bench does not charge the conversion to
    FlashInfer's timed calls: it runs once per g tensor (in the untimed first call), as `chunk._TableCache`
    keeps hybridkv's chunk tables."""

    def __init__(self) -> None:
        self._g: Any = None
        self._version = -1
        self._decay: Any = None

    def get(self, g: Any) -> Any:
        import torch

        if g is not self._g or g._version != self._version:
            self._decay = torch.exp(g.float()).reshape(-1, g.shape[-1]).contiguous()
            self._g, self._version = g, g._version
        return self._decay


_decays = _DecayCache()


def to_flashinfer(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    scale: float | None = None,
    initial_state: Any | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[dict[str, Any], Unpack]:
    """The keyword arguments of FlashInfer's `chunk_gated_delta_rule` for FLA's layouts (q, k `[B, T, H, K]`; v
    `[B, T, HV, V]`; g, the log decay, and beta `[B, T, HV]`; states `[N, HV, K, V]`), and how to unpack its result.

    Reshapes of contiguous inputs are views; exp(g) is computed once per g tensor (`_DecayCache`), and an initial
    state is copied transposed.
    """
    import torch

    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q and v must be [B, T, heads, dim], got shapes {list(q.shape)} and {list(v.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if (K, V) != (HEAD_DIM, HEAD_DIM):
        raise ValueError(f"FlashInfer's GDN prefill takes K = V = {HEAD_DIM}, got K={K}, V={V}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if _dtype_name(x) not in IO_DTYPES:
            raise ValueError(f"FlashInfer's GDN prefill takes {'/'.join(IO_DTYPES)} {name}, got {_dtype_name(x)}")
    if cu_seqlens is None:
        cu, max_seqlen = _even_cu_seqlens(B, T, str(q.device)), T
    else:
        if B != 1:
            raise ValueError(f"varlen (cu_seqlens given) needs batch size 1, got {B}")
        if cu_seqlens.dim() != 1 or _dtype_name(cu_seqlens) not in CU_SEQLENS_DTYPES:
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor, got shape {list(cu_seqlens.shape)} "
                             f"dtype {_dtype_name(cu_seqlens)}")
        # FlashInfer takes either width; its kernels are specialized per width, nothing is converted. Without a
        # host copy of the lengths, its context-parallel route bounds its grids by T_total (its documented default).
        cu, max_seqlen = cu_seqlens, None
    state = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    kwargs = {
        # FlashInfer refuses non-contiguous q/k/v/g/beta; .contiguous() is a no-op on the bench's tensors.
        "q": q.reshape(B * T, H, K).contiguous(),
        "k": k.reshape(B * T, H, K).contiguous(),
        "v": v.reshape(B * T, HV, V).contiguous(),
        "g": _decays.get(g),
        "beta": beta.float().reshape(B * T, HV).contiguous(),
        "scale": K**-0.5 if scale is None else float(scale),
        "initial_state": state,
        "output_final_state": output_final_state,
        "cu_seqlens": cu,
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
        "max_seqlen": max_seqlen,
    }
    return kwargs, Unpack(batch=B, length=T, output_final_state=output_final_state)


def from_flashinfer(result: Any, unpack: Unpack) -> tuple[Any, Any | None]:
    """(o `[B, T, HV, V]`, final state `[N, HV, K, V]` or None) from FlashInfer's output `[T_total, HV, V]` and
    `[N, HV, V, K]` state. Both are views: a copy would add a kernel to the timed call that no caller needs."""
    o, state = result if unpack.output_final_state else (result, None)
    o = o.view(unpack.batch, unpack.length, *o.shape[1:])
    return o, None if state is None else state.transpose(-1, -2)
