"""hybridkv: cache transfer for hybrid LLMs in disaggregated serving.

A prefill worker computes a prompt and a decode worker continues it. For a hybrid
model (full attention plus Gated DeltaNet / Mamba layers, e.g. Qwen3.5, Qwen3-Next;
also sliding-window hybrids such as Gemma 3) both the attention KV blocks and the
recurrent state (conv state and SSM state) must move between them: correctly under
asynchronous scheduling, and in few, large transfer descriptors. hybridkv does this
once, for every engine, behind thin connectors (vLLM, SGLang).

This package is the engine-agnostic core. It needs numpy and msgpack only: importing
it loads no torch, NIXL, ucxx or Triton, and nothing from the packages layered above
it (``descriptors``, ``connectors``, ``sims``). The design is in ``docs/design.md``;
``docs/lifecycle.md`` walks one request from an HF config to bytes on the decode side.

Public API (everything listed here is importable from ``hybridkv``)

Model geometry: what a model's caches are
    ModelGeometry, LayerKind, AttentionSpec, GDNSpec, DType, ConvLayout
    get_preset, PRESET_NAMES                  geometries of the models hybridkv is measured on
    geometry_from_config, load_hf_config      a geometry from a Hugging Face config.json

Layouts: where every byte of every block lives
    Layout, Region, GroupLayout, Placement    a side's registered regions and group placements
    plan_layout                               hybridkv's own layout, one contiguous span per block
    adopt_layout, GroupSpec, LayerBuffer      an engine's per-layer tensors (vLLM HMA aliasing)
    adopt_buffers, Buffer                     an engine's opaque pointer lists (SGLang)
    Field, FieldKind, PageContent             what the bytes inside one page are
    Allocator, Allocation, MemKind            where planned regions get memory:
    NumpyAllocator, TorchAllocator,           host memory, torch (imported only when used),
    VirtualAllocator                          or addresses without memory (for planning)

Fencing: when a block may be read, written, reused or computed on
    TransferScheduler                         the fencing rules for one worker of either side
    scheduler_inputs, SchedulerInputs         a Layout -> the scheduler's pools and components
    PoolLayout                                how KV-cache groups map onto physical block pools
    Component, ComponentKind,                 the separately-arriving pieces of a request
    attention_component, gdn_components
    FencePolicy                               FENCED, or NONE to show what breaks without it
    NotYet, NotYetReason                      "not now, ask again": test with isinstance()
    StepTicket, LeaseGrant, RequestPhase,     what the scheduler's calls return
    TransferOutcome

Identifiers (NewTypes over int/str)
    GroupId, BlockId, RegionId, RequestId, TransferId

Errors (bad input is a plain ValueError; these are failures of a peer or the data path)
    HybridKVError, PeerError, HandshakeRefused, Difference, HandshakeTimeout, PeerLost,
    ProtocolViolation, TransferError

Not imported here, each behind its own optional dependency
    hybridkv.wire                 control-plane messages (versioned msgpack, strictly validated)
    hybridkv.transport            NIXL data plane and producer/consumer control plane (nixl, ucxx)
    hybridkv.kernels.gdn          GDN kernels (Triton) with torch references
    descriptors                   layouts + block lists -> descriptor rows; the descriptor analyzer
    connectors                    vLLM and SGLang plugins, and a small reference engine
"""

from __future__ import annotations

from importlib import metadata as _metadata

from hybridkv.errors import (
    Difference,
    HandshakeRefused,
    HandshakeTimeout,
    HybridKVError,
    PeerError,
    PeerLost,
    ProtocolViolation,
    TransferError,
)
from hybridkv.fencing import (
    Component,
    ComponentKind,
    FencePolicy,
    LeaseGrant,
    NotYet,
    NotYetReason,
    PoolLayout,
    RequestPhase,
    StepTicket,
    TransferOutcome,
    TransferScheduler,
    attention_component,
    gdn_components,
)
from hybridkv.fencing.pools import SchedulerInputs, scheduler_inputs
from hybridkv.ids import BlockId, GroupId, RegionId, RequestId, TransferId
from hybridkv.layout import (
    PRESET_NAMES,
    Allocation,
    Allocator,
    AttentionSpec,
    Buffer,
    ConvLayout,
    DType,
    Field,
    FieldKind,
    GDNSpec,
    GroupLayout,
    GroupSpec,
    LayerBuffer,
    LayerKind,
    Layout,
    MemKind,
    ModelGeometry,
    NumpyAllocator,
    PageContent,
    Placement,
    Region,
    TorchAllocator,
    VirtualAllocator,
    adopt_buffers,
    adopt_layout,
    geometry_from_config,
    get_preset,
    load_hf_config,
    plan_layout,
)

try:
    __version__ = _metadata.version("hybridkv")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    # geometry
    "AttentionSpec", "ConvLayout", "DType", "GDNSpec", "LayerKind", "ModelGeometry", "PRESET_NAMES",
    "geometry_from_config", "get_preset", "load_hf_config",
    # layouts
    "Allocation", "Allocator", "Buffer", "Field", "FieldKind", "GroupLayout", "GroupSpec", "LayerBuffer",
    "Layout", "MemKind", "NumpyAllocator", "PageContent", "Placement", "Region", "TorchAllocator",
    "VirtualAllocator", "adopt_buffers", "adopt_layout", "plan_layout",
    # fencing
    "Component", "ComponentKind", "FencePolicy", "LeaseGrant", "NotYet", "NotYetReason", "PoolLayout",
    "RequestPhase", "SchedulerInputs", "StepTicket", "TransferOutcome", "TransferScheduler",
    "attention_component", "gdn_components", "scheduler_inputs",
    # identifiers
    "BlockId", "GroupId", "RegionId", "RequestId", "TransferId",
    # errors
    "Difference", "HandshakeRefused", "HandshakeTimeout", "HybridKVError", "PeerError",
    "PeerLost", "ProtocolViolation", "TransferError",
    "__version__",
]
