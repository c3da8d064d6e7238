"""The kernels `hybridkv kernels report` compiles: each Triton (or Gluon) kernel of hybridkv and the ways its host
code launches it on Qwen3.5 shapes (dk = dv = 128, bf16 activations): the same constexprs, warps and stages, and the
argument specialisations Triton's launcher makes at run time. `compile_report` compiles and reads them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

D = 128  # dk = dv for every Qwen3.5 / Qwen3-Next GDN layer


class Arch(enum.IntEnum):
    """Compute capability as Triton's GPUTarget spells it (major * 10 + minor)."""

    HOPPER = 90
    BLACKWELL = 100


@dataclass(frozen=True, kw_only=True)
class Launch:
    """One way the host code launches a kernel."""

    label: str
    num_warps: int
    num_stages: int = 3  # Triton's default on NVIDIA
    constants: Mapping[str, object] = field(default_factory=dict)
    maxnreg: int | None = None  # ptxas's register cap, as the host code passes it (None: no cap)
    types: Mapping[str, str] = field(default_factory=dict)  # runtime arguments typed otherwise in this launch


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    name: str
    module: str
    attr: str
    signature: Mapping[str, str]  # runtime arguments: Triton type ("*bf16", "i32", "fp32")
    constants: Mapping[str, object]  # constexpr arguments (a None pointer is one too)
    aligned: tuple[str, ...]  # int arguments the launcher sees as multiples of 16
    launches: tuple[Launch, ...]
    gluon: bool = False  # written in Gluon (triton.experimental.gluon), not in Triton's language
    archs: tuple[Arch, ...] = (Arch.HOPPER, Arch.BLACKWELL)  # what it is written for (Hopper's wgmma: Hopper only)


# The row-looped decode kernels' common arguments (`triton_decode_rows`, `triton_decode_prefetch`), 35B's heads.
ROW_LOOP = dict(
    signature={"q": "*bf16", "k": "*bf16", "v": "*bf16", "a": "*fp32", "b": "*fp32", "A_log": "*fp32",
               "dt_bias": "*fp32", "o": "*bf16", "state_indices": "*i32", "scale": "fp32", "stride_slot": "i32",
               "stride_head": "i32", "softplus_beta": "fp32", "softplus_threshold": "fp32"},
    constants={"H": 16, "HV": 32, "K": D, "V": D, "L2NORM": True},
    aligned=("stride_slot", "stride_head"),
)


def _has_gluon() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: F401
    except ImportError:
        return False
    return True


def _specs() -> list[KernelSpec]:
    from hybridkv.kernels.gdn import (chunk_plan, triton_chunk, triton_chunk_inverse, triton_chunk_scan,
                                      triton_chunk_scores_tma, triton_decode_prefetch, triton_decode_rows,
                                      triton_decode_tma, triton_recurrent)

    chunk = "hybridkv.kernels.gdn.triton_chunk"
    inverse = "hybridkv.kernels.gdn.triton_chunk_inverse"
    recurrent = "hybridkv.kernels.gdn.triton_recurrent"
    split = "hybridkv.kernels.gdn.triton_chunk_wu"
    scan = "hybridkv.kernels.gdn.triton_chunk_scan"
    inv = triton_chunk_inverse.INVERSE_CONFIG
    conv = "hybridkv.kernels.gdn.triton_conv"
    state_launches = tuple(
        Launch(label=f"BV={bv}{' scores' if sc else ''}", num_warps=w, num_stages=s,
               constants={"BV": bv, "SEGMENTED": False, "SCORES_IN": sc})
        for sc in (False, True) for bv, w, s in triton_chunk.STATE_CONFIGS
    ) + tuple(
        Launch(label=f"segment BV={bv}{' scores' if sc else ''}", num_warps=w, num_stages=s,
               constants={"BV": bv, "SEGMENTED": True, "SCORES_IN": sc})
        for sc in (False, True) for bv, w, s in (chunk_plan.PIPELINE_CONFIG,)
    ) + tuple(
        Launch(label=f"BV={bv} s{s} scores", num_warps=w, num_stages=s,
               constants={"BV": bv, "SEGMENTED": False, "SCORES_IN": True})
        for bv, w, s in (chunk_plan.ONE_PER_SM_CONFIG,)
    ) + tuple(
        Launch(label=f"scan BV={bv}{' scores' if sc else ''}", num_warps=w, num_stages=s,
               constants={"BV": bv, "SEGMENTED": False, "SCORES_IN": sc, "SCAN": True, "PDL": True})
        for sc, (bv, w, s) in ((False, chunk_plan.PIPELINE_CONFIG), (True, chunk_plan.PIPELINE_CONFIG),
                               (True, chunk_plan.SCAN_WIDE_CONFIG))
    )
    decode_launches = tuple(
        Launch(label=f"{dt} state BV={bv}", num_warps=w, constants={"BV": bv, "state": dt, "STREAM": dt == "bf16"})
        for dt in ("fp32", "bf16") for bv, w in triton_recurrent.DECODE_CONFIGS
    )
    recurrent_sig = {
        "q": "*bf16", "k": "*bf16", "v": "*bf16", "o": "*bf16", "state": "*fp32", "scale": "fp32",
        "T": "i32", "stride_slot": "i32", "stride_head": "i32", "softplus_beta": "fp32",
        "softplus_threshold": "fp32", "H": "i32", "HV": "i32",
    }
    specs = [
        KernelSpec(
            name="chunk_inverse", module=inverse, attr="_chunk_inverse_kernel",
            signature={"q": "*bf16", "k": "*bf16", "g": "*fp32", "beta": "*fp32", "A": "*bf16", "R": "*fp32",
                       "G": "*fp32", "cu_seqlens": "*i32", "chunk_table": "*i32", "row0": "i32",
                       "c_lo": "i32", "c_hi": "i32", "scale": "fp32", "H": "i32", "HV": "i32"},
            constants={"K": D, "BK": D, "BKC": inv.bkc, "L2NORM": True, "METHOD": inv.method,
                       "PREC": inv.prec, "MPREC": inv.merge_prec},
            aligned=("H", "HV"),
            launches=tuple(Launch(label=f"{'segment' if seg else 'default'} group={grp}", num_warps=inv.warps,
                                  num_stages=inv.stages, constants={"SEGMENTED": seg, "GROUP": grp})
                           for seg in (False, True) for grp in sorted({1, inv.group})),
        ),
        KernelSpec(
            name="chunk_scores", module=inverse, attr="_chunk_scores_kernel",
            signature={"q": "*bf16", "k": "*bf16", "R": "*fp32", "P": "*bf16", "cu_seqlens": "*i32",
                       "chunk_table": "*i32", "row0": "i32", "c_lo": "i32", "c_hi": "i32", "H": "i32",
                       "HV": "i32"},
            constants={"K": D, "BK": D, "PDL": False},
            aligned=("H", "HV"),
            launches=tuple(Launch(label=f"{'segment' if seg else 'default'} group={grp}",
                                  num_warps=triton_chunk_inverse.SCORES_WARPS, num_stages=1,
                                  constants={"SEGMENTED": seg, "GROUP": grp})
                           for seg in (False, True) for grp in sorted({1, inv.group})),
        ),
        KernelSpec(
            # The descriptors' boxes: q and k one chunk row of a key head, P one chunk of a value head.
            name="chunk_scores_tma", module="hybridkv.kernels.gdn.triton_chunk_scores_tma",
            attr="_scores_tma_kernel",
            signature={"q_desc": f"tensordesc<bf16[64, {D}]>", "k_desc": f"tensordesc<bf16[64, {D}]>",
                       "p_desc": "tensordesc<bf16[64, 64]>", "R": "*fp32", "cu_seqlens": "*i32",
                       "chunk_table": "*i32", "row0": "i32", "c_lo": "i32", "c_hi": "i32", "rows": "i32",
                       "progs": "i32", "H": "i32", "HV": "i32"},
            constants={"K": D, "PDL": False},
            aligned=("H", "HV"),
            launches=tuple(Launch(label=f"{'segment ' if seg else ''}group={grp} {per_sm}/SM", num_warps=w,
                                  constants={"SEGMENTED": seg, "GROUP": grp, "STAGES": st})
                           for seg in (False, True) for grp in (2, 4)
                           for w, per_sm, st in triton_chunk_scores_tma.CONFIGS if not seg or grp == 4),
        ),
        KernelSpec(
            name="chunk_state", module=chunk, attr="_chunk_state_kernel",
            signature={"q": "*bf16", "k": "*bf16", "v": "*bf16", "A": "*bf16", "P": "*bf16", "R": "*fp32",
                       "G": "*fp32", "o": "*bf16", "h_in": "*fp32", "h_out": "*fp32", "cu_seqlens": "*i32",
                       "chunk_offsets": "*i32", "c_lo": "i32", "c_hi": "i32", "stride_ik": "i32",
                       "stride_ok": "i32", "H": "i32", "HV": "i32", "WORK_LOG2": "i32"},
            constants={"stride_iv": 1, "stride_ov": 1, "K": D, "V": D, "BK": D, "HAS_H_IN": True,
                       "HAS_H_OUT": True, "SCAN": False, "PDL": False},
            aligned=("stride_ik", "stride_ok", "H", "HV"),
            launches=state_launches,
        ),
        KernelSpec(
            name="scan_summary", module=scan, attr="_segment_summary_kernel",
            signature={"k": "*bf16", "v": "*bf16", "A": "*bf16", "R": "*fp32", "G": "*fp32", "summary": "*fp32",
                       "cu_seqlens": "*i32", "chunk_offsets": "*i32", "seg_chunks": "i32", "seg0": "i32", "H": "i32",
                       "HV": "i32"},
            constants={"K": D, "V": D, "BK": D, "PDL": True},
            aligned=("H", "HV"),
            launches=tuple(Launch(label=f"BV={bv} stages={st}", num_warps=w, num_stages=st, constants={"BV": bv})
                           for bv, w, st in (triton_chunk_scan.SUMMARY_MANY_HEADS,
                                             triton_chunk_scan.SUMMARY_FEW_HEADS_CONFIG,
                                             triton_chunk_scan.SUMMARY_WIDE_FEW_HEADS_CONFIG)),
        ),
        KernelSpec(
            name="scan_starts", module=scan, attr="_segment_scan_kernel",
            signature={"summary": "*fp32", "h_in": "*fp32", "starts": "*fp32", "stride_ik": "i32", "n_seg": "i32",
                       "NH": "i32", "W": "i32", "MCOL": "i32"},
            constants={"stride_iv": 1, "K": D, "V": D, "BK": D, "HAS_H_IN": True, "WHOLE_M": False,
                       "PREC": triton_chunk_scan.SCAN_PRECISION, "PDL": True},
            aligned=("stride_ik", "W", "MCOL"),
            launches=(Launch(label=f"BV={triton_chunk_scan.SCAN_BV}", num_warps=4, num_stages=1,
                             constants={"BV": triton_chunk_scan.SCAN_BV, "SLAB": triton_chunk_scan.SCAN_SLAB}),),
        ),
        KernelSpec(
            name="chunk_wu", module=split, attr="_chunk_wu_kernel",
            signature={"q": "*bf16", "k": "*bf16", "v": "*bf16", "A": "*bf16", "R": "*fp32", "WQ": "*bf16",
                       "UU": "*bf16", "cu_seqlens": "*i32", "chunk_table": "*i32",
                       "row0": "i32", "c_lo": "i32", "c_hi": "i32", "H": "i32", "HV": "i32"},
            constants={"K": D, "V": D, "BK": D, "BC": 64},
            aligned=("H", "HV"),
            launches=tuple(Launch(label=f"{'segment' if seg else 'default'}", num_warps=4, num_stages=1,
                                  constants={"SEGMENTED": seg}) for seg in (False, True)),
        ),
        KernelSpec(
            name="chunk_chain", module=split, attr="_chunk_chain_kernel",
            signature={"k": "*bf16", "WQ": "*bf16", "UU": "*bf16", "R": "*fp32",
                       "G": "*fp32", "o": "*bf16", "h_in": "*fp32", "h_out": "*fp32", "cu_seqlens": "*i32",
                       "chunk_offsets": "*i32", "c_lo": "i32", "c_hi": "i32", "stride_ik": "i32",
                       "stride_ok": "i32", "H": "i32", "HV": "i32", "WORK_LOG2": "i32"},
            constants={"stride_iv": 1, "stride_ov": 1, "K": D, "V": D, "BK": D, "HAS_H_IN": True,
                       "HAS_H_OUT": True},
            aligned=("stride_ik", "stride_ok", "H", "HV"),
            launches=tuple(Launch(label=f"{'segment ' if seg else ''}BV={bv} s{st}", num_warps=w, num_stages=st,
                                  constants={"BV": bv, "SEGMENTED": seg})
                           for bv, w, st in triton_chunk.CHAIN_CONFIGS for seg in (False, True)),
        ),
        KernelSpec(
            name="recurrent_prefill", module=recurrent, attr="_recurrent_kernel",
            signature={**recurrent_sig, "g": "*fp32", "beta": "*fp32", "state_out": "*fp32",
                       "cu_seqlens": "*i32"},
            constants={"a": None, "b": None, "A_log": None, "dt_bias": None, "state_indices": None,
                       "K": D, "V": D, "BK": D, "BV": 32, "HAS_G": True, "HAS_BETA": True,
                       "GATE_IN_KERNEL": False, "L2NORM": True, "IS_VARLEN": True, "HAS_STATE": True,
                       "STORE_STATE": True, "USE_SLOTS": False, "V_FIRST": False, "EVEN": False, "STREAM": False},
            aligned=("H", "HV"),
            launches=(Launch(label="BV=32", num_warps=4),
                      # FLA's default call: no initial state, no final state (a None pointer each).
                      Launch(label="BV=32 no states", num_warps=4,
                             constants={"state": None, "state_out": None, "HAS_STATE": False,
                                        "STORE_STATE": False}),
                      Launch(label="BV=32 final state only", num_warps=4,
                             constants={"state": None, "HAS_STATE": False})),
        ),
        KernelSpec(
            name="decode", module=recurrent, attr="_recurrent_kernel",
            signature={**recurrent_sig, "a": "*fp32", "b": "*fp32", "A_log": "*fp32", "dt_bias": "*fp32",
                       "state_indices": "*i32"},
            constants={"g": None, "beta": None, "state_out": None, "cu_seqlens": None, "K": D, "V": D,
                       "BK": D, "HAS_G": False, "HAS_BETA": False, "GATE_IN_KERNEL": True, "L2NORM": True,
                       "IS_VARLEN": False, "HAS_STATE": True, "STORE_STATE": True, "USE_SLOTS": True,
                       "V_FIRST": False, "EVEN": True, "STREAM": False},
            aligned=("stride_slot", "stride_head", "H", "HV"),
            launches=decode_launches,
        ),
        KernelSpec(
            # The descriptor's element type and box follow the launch (`desc` in its constants).
            name="decode_tma", module="hybridkv.kernels.gdn.triton_decode_tma", attr="_decode_tma_kernel",
            signature={"q": "*bf16", "k": "*bf16", "v": "*bf16", "a": "*fp32", "b": "*fp32", "A_log": "*fp32",
                       "dt_bias": "*fp32", "o": "*bf16", "stride_slot": "i32", "stride_head": "i32",
                       "stride_row": "i32", "state_indices": "*i32", "N": "i32", "progs": "i32", "scale": "fp32",
                       "softplus_beta": "fp32", "softplus_threshold": "fp32"},
            constants={"H": 16, "HV": 32, "K": D, "V": D, "L2NORM": True},
            aligned=("stride_slot", "stride_head", "stride_row"),
            # The direct store is a probe candidate; q, k and v by TMA (a v row of 128 bytes) are tuner candidates.
            launches=tuple(
                Launch(label=f"{dt} state BV={bv} {per_sm}/SM{'' if tma_store else ' direct store'}"
                             f"{' qkv-tma' if qkv_tma else ''}", num_warps=w, num_stages=st,
                       constants={"BV": bv, "STAGES": st, "TMA_STORE": tma_store, "QKV_TMA": qkv_tma, "state": dt,
                                  "desc": f"tensordesc<{dt}[1, 1, {bv}, {D}]>"},
                       types={"q": f"tensordesc<bf16[1, 1, {D}]>", "k": f"tensordesc<bf16[1, 1, {D}]>",
                              "v": f"tensordesc<bf16[1, 1, {bv}]>"} if qkv_tma else {})
                for dt in ("fp32", "bf16") for bv, w, per_sm, st in triton_decode_tma.TMA_CONFIGS
                for tma_store, qkv_tma in ((True, False), (False, False), (True, True))
                if not qkv_tma or bv * 2 % 128 == 0),
        ),
        KernelSpec(
            name="decode_rows", module="hybridkv.kernels.gdn.triton_decode_rows", attr="_decode_rows_kernel",
            **ROW_LOOP,
            launches=tuple(
                Launch(label=f"{dt} state BV={bv} ROWS={rows}", num_warps=w, num_stages=st,
                       constants={"BV": bv, "ROWS": rows, "STAGES": st, "STREAM": dt == "bf16", "state": dt})
                for dt in ("fp32", "bf16") for bv, rows, w, st in triton_decode_rows.ROWS_CONFIGS),
        ),
        KernelSpec(
            name="decode_prefetch", module="hybridkv.kernels.gdn.triton_decode_prefetch",
            attr="_decode_prefetch_kernel",
            **ROW_LOOP,
            launches=tuple(
                Launch(label=f"{dt} state BV={c[0]} ROWS={c[1]}{f' L2AHEAD={c[3]}' if len(c) > 3 else ''}",
                       num_warps=c[2], num_stages=1,
                       constants={"BV": c[0], "ROWS": c[1], "STREAM": dt == "bf16", "state": dt,
                                  "L2AHEAD": triton_decode_prefetch.l2_ahead(c)})
                for dt in ("fp32", "bf16") for c in triton_decode_prefetch.PREFETCH_CONFIGS) + tuple(
                # Heads of 16 value rows (one block a program: the unrolled loop runs once or not at all) and of K 32.
                Launch(label=f"bf16 state K={k} V=16 BV={min(c[0], 16)} ROWS={min(c[1], 16)}"
                             f"{f' L2AHEAD={c[3]}' if len(c) > 3 else ''}", num_warps=c[2], num_stages=1,
                       constants={"BV": min(c[0], 16), "ROWS": min(c[1], 16), "K": k, "V": 16, "STREAM": True,
                                  "state": "bf16", "L2AHEAD": triton_decode_prefetch.l2_ahead(c)})
                for k in (32, 128) for c in triton_decode_prefetch.PREFETCH_CONFIGS),
        ),
        KernelSpec(
            name="conv_prefill", module=conv, attr="_conv_out_kernel",
            signature={"x": "*bf16", "weight": "*bf16", "y": "*bf16", "seq_of_token": "*i32",
                       "cu_seqlens": "*i32", "conv_state": "*bf16", "state_indices": "*i32", "has_init": "*i8",
                       "total": "i32", "D": "i32", "stride_slot": "i32"},
            constants={"bias": None, "W": 4, "BT": 32, "BD": 128, "HAS_BIAS": False, "HAS_STATE": True,
                       "HAS_INIT_FLAGS": True, "SILU": True},
            aligned=("D", "stride_slot"),
            launches=(Launch(label="default", num_warps=4),),
        ),
        KernelSpec(
            name="conv_state", module=conv, attr="_conv_state_kernel",
            signature={"x": "*bf16", "cu_seqlens": "*i32", "conv_state": "*bf16", "state_indices": "*i32",
                       "has_init": "*i8", "D": "i32", "stride_slot": "i32"},
            constants={"W": 4, "BW": 4, "BD": 256, "HAS_INIT_FLAGS": True},
            aligned=("D", "stride_slot"),
            launches=(Launch(label="default", num_warps=4),),
        ),
        KernelSpec(
            name="conv_update", module=conv, attr="_conv_update_kernel",
            signature={"x": "*bf16", "conv_state": "*bf16", "weight": "*bf16", "y": "*bf16",
                       "state_indices": "*i32", "D": "i32", "stride_slot": "i32"},
            constants={"bias": None, "W": 4, "BW": 4, "BD": 256, "HAS_BIAS": False, "SILU": True},
            aligned=("D", "stride_slot"),
            launches=(Launch(label="default", num_warps=4),),
        ),
    ]
    if _has_gluon():  # Triton's Gluon dialect (3.6 is the version it was written against)
        specs.append(KernelSpec(
            name="chunk_inverse_gluon", module="hybridkv.kernels.gdn.gluon_chunk_inverse", attr="_gluon_inverse_kernel",
            signature={"q": "*bf16", "k": "*bf16", "g": "*fp32", "beta": "*fp32", "A": "*bf16", "R": "*fp32",
                       "G": "*fp32", "P": "*bf16", "cu_seqlens": "*i32", "chunk_table": "*i32", "row0": "i32",
                       "c_lo": "i32", "c_hi": "i32", "scale": "fp32", "H": "i32", "HV": "i32"},
            constants={"K": D, "L2NORM": True}, aligned=("H", "HV"), gluon=True,
            # Without the scores `launch` passes no P (a None constexpr); the scores need the loads ahead.
            launches=tuple(Launch(label=f"{'segment' if seg else 'default'} group={grp}"
                                        f"{' loads ahead' if ahead else ''}{' scores' if scores else ''}"
                                        f"{' 4 warps' if nw == 4 else ''}",
                                  num_warps=nw, constants={"GROUP": grp, "SEGMENTED": seg, "LOADS_AHEAD": ahead,
                                                           "SCORES": scores,
                                                           **({} if scores else {"P": None})})
                           for seg in (False, True) for grp in (1, 2, 4) for ahead, scores, nw in
                           ((False, False, 2), (True, False, 2), (True, True, 2), (True, True, 4))),
        ))
        tile = ("NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=False, "
                "fp4_padded=False, cga_layout=[])")
        rows = ("NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2, transposed=False, "
                "fp4_padded=False, cga_layout=[])")
        for bv in (128, 64):  # the whole state per program, or half (v's TMA box is as wide)
            specs.append(KernelSpec(
                name="chunk_chain_gluon" if bv == 128 else "chunk_chain_gluon_half",
                module="hybridkv.kernels.gdn.gluon_chunk_chain", attr="_gluon_chain_kernel",
                signature={"q_desc": f"tensordesc<bf16[64, {D}],{tile}>",
                           "k_desc": f"tensordesc<bf16[64, {D}],{tile}>",
                           "v_desc": f"tensordesc<bf16[64, {bv}],{tile}>",
                           "a_desc": f"tensordesc<bf16[64, 64],{tile}>",
                           "r_desc": f"tensordesc<fp32[8, 64],{rows}>",
                           "p_desc": f"tensordesc<bf16[64, 64],{tile}>",
                           "R": "*fp32", "G": "*fp32", "o": "*bf16", "h_in": "*fp32", "h_out": "*fp32",
                           "cu_seqlens": "*i32", "chunk_offsets": "*i32", "stride_ik": "i32", "stride_iv": "i32",
                           "stride_ok": "i32", "stride_ov": "i32", "H": "i32", "HV": "i32"},
                constants={"K": D, "V": D, "BV": bv}, aligned=("H", "HV"), gluon=True, archs=(Arch.HOPPER,),
                launches=tuple(Launch(label=(f"overlap={overlap}" if overlap else "default")
                                      + (" staged" if staged else "") + (" scores" if scores else ""),
                                      num_warps=bv // 16,
                                      # `launch` passes no descriptor of R unstaged, nor of P without the scores form
                                      # (None constexprs).
                                      constants={"HAS_H_IN": True, "HAS_H_OUT": True, "OVERLAP": overlap,
                                                 "STAGED_SCALES": staged, "SCORES_IN": scores,
                                                 **({} if staged else {"r_desc": None}),
                                                 **({} if scores else {"p_desc": None})})
                               for overlap in (0, 1, 2) for staged in (False, True) for scores in (False, True)
                               if not (scores and (overlap == 2 or staged))),
            ))
    return specs
