"""A hybrid model with Qwen3.5's layer structure, seeded random weights, no download.

3 GDN layers then 1 gated full-attention layer, repeated. GDN layers: causal conv1d
over q|k|v (DS conv state), L2-normalised q/k, gated delta rule through
`hybridkv.kernels.gdn` (Triton on a GPU, the torch references on the CPU), gated
RMSNorm, output projection. Attention layers: GQA over a paged KV cache (a gather of
the request's pages, then SDPA), sigmoid output gate. Every request is computed on its
own (batch 1), so a request's numbers never depend on what else shares its step: that
is what lets the demo demand token-exact equality with an aggregated run, on a GPU too.

Two sizes: `tiny` (fp32, runs anywhere in seconds: the CPU demo) and the Qwen3.5
presets `qwen3.5-0.8b` / `qwen3.5-2b`, whose caches are exactly hybridkv's presets of
those models (bf16 KV and conv state, fp32 SSM state; `get_preset`) and whose weights
are bf16 on the GPU. Their hidden, MLP and vocabulary sizes follow the model cards
(not cross-checked against the config files, which were not available); they set the
compute, not what moves between the processes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from hybridkv.layout.geometry import AttentionSpec, DType, GDNSpec, ModelGeometry

from .cache import KVView, StateView, torch_dtype


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
    name: str = "tiny-qwen3.5"
    vocab: int = 384
    hidden: int = 64
    num_layers: int = 8
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    k_heads: int = 2
    v_heads: int = 4
    head_k_dim: int = 16
    head_v_dim: int = 16
    conv_kernel: int = 4
    mlp: int = 128
    full_attention_interval: int = 4
    cache_dtype: DType = DType.FLOAT32  # attention KV, conv state, and the weights and activations
    ssm_dtype: DType = DType.FLOAT32
    seed: int = 1234

    def geometry(self) -> ModelGeometry:
        attn = AttentionSpec(num_kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.cache_dtype)
        gdn = GDNSpec(num_k_heads=self.k_heads, num_v_heads=self.v_heads, head_k_dim=self.head_k_dim,
                      head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel, conv_dtype=self.cache_dtype,
                      ssm_dtype=self.ssm_dtype)
        layers = tuple(attn if self.is_attention(i) else gdn for i in range(self.num_layers))
        return ModelGeometry(name=self.name, layers=layers)

    def is_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0


def _qwen35(name: str, *, hidden: int, mlp: int) -> TinyConfig:
    # Cache shapes: docs/background/gdn.md section 2 (the same values as hybridkv's presets).
    return TinyConfig(name=name, vocab=248_320, hidden=hidden, num_layers=24, q_heads=8, kv_heads=2, head_dim=256,
                      k_heads=16, v_heads=16, head_k_dim=128, head_v_dim=128, mlp=mlp,
                      cache_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32)


MODELS = {
    "tiny": TinyConfig(),
    "qwen3.5-0.8b": _qwen35("qwen3.5-0.8b", hidden=1024, mlp=3584),
    "qwen3.5-2b": _qwen35("qwen3.5-2b", hidden=2048, mlp=6144),
}


def model_config(name: str, *, seed: int = 1234) -> TinyConfig:
    if name not in MODELS:
        raise ValueError(f"model {name!r}; expected one of {', '.join(MODELS)}")
    return replace(MODELS[name], seed=seed)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _sdpa_backends():
    """Flash, memory-efficient or math SDPA, not cuDNN's: cuDNN builds an execution plan per new key
    length, and a decode step has a new one every time (11 ms of host time per call, measured on the
    H200 with tools/device/profile_demo_engine.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class TinyHybridModel:
    def __init__(self, cfg: TinyConfig = TinyConfig(), *, device: str = "cpu") -> None:
        self.cfg = cfg
        self.device = dev = torch.device(device)
        self.dtype = dt = torch_dtype(cfg.cache_dtype)
        # Drawn on the device that computes: the same seed gives the same weights in every process
        # (the router's aggregated run, prefill, decode), without a host copy of a 0.5 GB table.
        gen = torch.Generator(device=dev).manual_seed(cfg.seed)

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            s = scale if scale is not None else shape[0] ** -0.5
            return (torch.randn(*shape, generator=gen, device=dev) * s).to(dt)

        def u(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=gen, device=dev)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=dev, dtype=dt)

        c = cfg
        self.embed = w(c.vocab, c.hidden, scale=1.0)
        # fp32 logits: with a 248k vocabulary, bf16 logits tie often enough to matter to argmax
        self.lm_head = w(c.hidden, c.vocab).float()
        self.final_norm = ones(c.hidden)
        self.layers: list[dict[str, torch.Tensor]] = []
        conv_dim = 2 * c.k_heads * c.head_k_dim + c.v_heads * c.head_v_dim
        for i in range(c.num_layers):
            p = {"norm1": ones(c.hidden), "norm2": ones(c.hidden),
                 "w1": w(c.hidden, c.mlp), "w3": w(c.hidden, c.mlp), "w2": w(c.mlp, c.hidden)}
            if cfg.is_attention(i):
                p.update(wq=w(c.hidden, c.q_heads * c.head_dim), wgate=w(c.hidden, c.q_heads * c.head_dim),
                         wk=w(c.hidden, c.kv_heads * c.head_dim), wv=w(c.hidden, c.kv_heads * c.head_dim),
                         wo=w(c.q_heads * c.head_dim, c.hidden))
            else:
                p.update(wqkv=w(c.hidden, conv_dim), wz=w(c.hidden, c.v_heads * c.head_v_dim),
                         wa=w(c.hidden, c.v_heads), wb=w(c.hidden, c.v_heads),
                         conv=w(conv_dim, c.conv_kernel, scale=0.5),
                         A_log=torch.log(u(c.v_heads) * 8 + 1), dt_bias=u(c.v_heads) - 0.5,
                         onorm=ones(c.head_v_dim), wout=w(c.v_heads * c.head_v_dim, c.hidden))
            self.layers.append(p)
        self._slot0 = torch.zeros(1, dtype=torch.int32, device=dev)
        self._init = {b: torch.tensor([b], device=dev) for b in (False, True)}

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, kv: dict[int, KVView],
                state: dict[int, StateView]) -> torch.Tensor:
        """Run `tokens` (1-D, on the model's device; positions start..) of one request, reading and
        writing its caches in place; return the greedy next token as a 1-element tensor on the device.
        Nothing here waits for the device: a step is only enqueued."""
        c = self.cfg
        x = self.embed[tokens]
        pos = torch.arange(start, start + tokens.shape[0], device=self.device)
        for i, p in enumerate(self.layers):
            h = _rms(x, p["norm1"])
            if c.is_attention(i):
                x = x + self._attention(h, p, pos, start, kv[i])
            else:
                x = x + self._gdn(h, p, start, state[i])
            h = _rms(x, p["norm2"])
            x = x + (F.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        logits = _rms(x[-1:], self.final_norm).float() @ self.lm_head
        return torch.argmax(logits, dim=-1)

    def _attention(self, h, p, pos, start: int, cache: KVView) -> torch.Tensor:
        c = self.cfg
        t = h.shape[0]
        q = _rope((h @ p["wq"]).view(t, c.q_heads, c.head_dim), pos)
        k = _rope((h @ p["wk"]).view(t, c.kv_heads, c.head_dim), pos)
        v = (h @ p["wv"]).view(t, c.kv_heads, c.head_dim)
        cache.write(start, k, v)
        keys, values = cache.read(start + t)  # [S, kv_heads, D]: the paged gather
        rep = c.q_heads // c.kv_heads
        keys = keys.to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        values = values.to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        # A decode token sees every key; a prompt chunk is causal from its own positions on.
        mask = None if t == 1 else (torch.arange(start + t, device=h.device)[None, :] <= pos[:, None])
        with _sdpa_backends():
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask)
        out = out[0].transpose(0, 1).reshape(t, -1)
        return (out * torch.sigmoid(h @ p["wgate"])) @ p["wo"]

    def _gdn(self, h, p, start: int, st: StateView) -> torch.Tensor:
        from hybridkv.kernels.gdn import causal_conv1d_fn, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        c = self.cfg
        t = h.shape[0]
        pool = st.read_conv()[None].to(h.dtype).contiguous()  # [1, conv_dim, W-1]
        mixed = causal_conv1d_fn(h @ p["wqkv"], p["conv"], conv_state=pool, state_indices=self._slot0,
                                 has_initial_state=self._init[start > 0])
        st.write_conv(pool[0])
        qd, vd = c.k_heads * c.head_k_dim, c.v_heads * c.head_v_dim
        q = mixed[:, :qd].reshape(1, t, c.k_heads, c.head_k_dim).contiguous()
        k = mixed[:, qd: 2 * qd].reshape(1, t, c.k_heads, c.head_k_dim).contiguous()
        v = mixed[:, 2 * qd:].reshape(1, t, c.v_heads, c.head_v_dim).contiguous()
        a, b = (h @ p["wa"]).float(), (h @ p["wb"]).float()
        g = (-torch.exp(p["A_log"]) * F.softplus(a + p["dt_bias"]))[None]
        beta = torch.sigmoid(b)[None]
        # The stored (HV, dv, dk) state is what the kernels take with state_v_first: no transposes.
        initial = st.read_ssm()[None].float().contiguous() if start > 0 else None
        # Decode tokens take the recurrent form, prompt chunks the chunked (WY) form, as engines do.
        rule = fused_recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
        o, final = rule(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, state_v_first=True)
        st.write_ssm(final[0])
        o = o[0].view(t, c.v_heads, c.head_v_dim)
        z = (h @ p["wz"]).view(t, c.v_heads, c.head_v_dim)
        o = _rms(o, p["onorm"]) * F.silu(z)
        return o.reshape(t, vd) @ p["wout"]


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1] // 2
    freq = base ** (-torch.arange(d, dtype=torch.float32, device=x.device) / d)
    ang = pos[:, None].float() * freq[None]
    cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    xf = x.float()
    x1, x2 = xf[..., :d], xf[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
