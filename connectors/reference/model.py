"""A tiny hybrid model with Qwen3.5's layer structure, seeded random weights, no download.

3 GDN layers then 1 gated full-attention layer, repeated. GDN layers: causal conv1d
over q|k|v (DS conv state), L2-normalised q/k, gated delta rule through
`hybridkv.kernels.gdn`, gated RMSNorm, output projection. Attention layers: GQA over
a paged KV cache, sigmoid output gate. Every request is computed on its own (batch 1),
so a request's numbers never depend on what else shares its step: that is what lets
the demo demand token-exact equality with an aggregated run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.layout.geometry import AttentionSpec, DType, GDNSpec, ModelGeometry

from .cache import KVView, StateView


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
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
    seed: int = 1234

    def geometry(self) -> ModelGeometry:
        attn = AttentionSpec(num_kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=DType.FLOAT32)
        gdn = GDNSpec(num_k_heads=self.k_heads, num_v_heads=self.v_heads, head_k_dim=self.head_k_dim,
                      head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel, conv_dtype=DType.FLOAT32,
                      ssm_dtype=DType.FLOAT32)
        layers = tuple(attn if self.is_attention(i) else gdn for i in range(self.num_layers))
        return ModelGeometry(name="tiny-qwen3.5", layers=layers)

    def is_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class TinyHybridModel:
    def __init__(self, cfg: TinyConfig = TinyConfig()) -> None:
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            s = scale if scale is not None else shape[0] ** -0.5
            return torch.randn(*shape, generator=gen) * s

        c = cfg
        self.embed = w(c.vocab, c.hidden, scale=1.0)
        self.lm_head = w(c.hidden, c.vocab)
        self.final_norm = torch.ones(c.hidden)
        self.layers: list[dict[str, torch.Tensor]] = []
        conv_dim = 2 * c.k_heads * c.head_k_dim + c.v_heads * c.head_v_dim
        for i in range(c.num_layers):
            p = {"norm1": torch.ones(c.hidden), "norm2": torch.ones(c.hidden),
                 "w1": w(c.hidden, c.mlp), "w3": w(c.hidden, c.mlp), "w2": w(c.mlp, c.hidden)}
            if cfg.is_attention(i):
                p.update(wq=w(c.hidden, c.q_heads * c.head_dim), wgate=w(c.hidden, c.q_heads * c.head_dim),
                         wk=w(c.hidden, c.kv_heads * c.head_dim), wv=w(c.hidden, c.kv_heads * c.head_dim),
                         wo=w(c.q_heads * c.head_dim, c.hidden))
            else:
                p.update(wqkv=w(c.hidden, conv_dim), wz=w(c.hidden, c.v_heads * c.head_v_dim),
                         wa=w(c.hidden, c.v_heads), wb=w(c.hidden, c.v_heads),
                         conv=w(conv_dim, c.conv_kernel, scale=0.5),
                         A_log=torch.log(torch.rand(c.v_heads, generator=gen) * 8 + 1),
                         dt_bias=torch.rand(c.v_heads, generator=gen) - 0.5,
                         onorm=torch.ones(c.head_v_dim), wout=w(c.v_heads * c.head_v_dim, c.hidden))
            self.layers.append(p)

    @torch.no_grad()
    def forward(self, tokens: list[int], start: int, kv: dict[int, KVView], state: dict[int, StateView]) -> int:
        """Run `tokens` (positions start..) of one request, reading and writing its caches in place;
        return the greedy next token after the last one."""
        c = self.cfg
        x = self.embed[torch.tensor(tokens)]
        pos = torch.arange(start, start + len(tokens))
        for i, p in enumerate(self.layers):
            h = _rms(x, p["norm1"])
            if c.is_attention(i):
                x = x + self._attention(h, p, pos, kv[i])
            else:
                x = x + self._gdn(h, p, start, state[i])
            h = _rms(x, p["norm2"])
            x = x + (F.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        logits = _rms(x[-1], self.final_norm) @ self.lm_head
        return int(torch.argmax(logits))

    def _attention(self, h, p, pos, cache: KVView) -> torch.Tensor:
        c = self.cfg
        t = h.shape[0]
        q = _rope((h @ p["wq"]).view(t, c.q_heads, c.head_dim), pos)
        k = _rope((h @ p["wk"]).view(t, c.kv_heads, c.head_dim), pos)
        v = (h @ p["wv"]).view(t, c.kv_heads, c.head_dim)
        cache.write(int(pos[0]), k, v)
        keys, values = cache.read(int(pos[-1]) + 1)  # [S, kv_heads, D]
        rep = c.q_heads // c.kv_heads
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) * c.head_dim ** -0.5
        mask = torch.arange(keys.shape[0])[None, :] > pos[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), values).reshape(t, -1)
        return (out * torch.sigmoid(h @ p["wgate"])) @ p["wo"]

    def _gdn(self, h, p, start: int, st: StateView) -> torch.Tensor:
        from hybridkv.kernels.gdn import causal_conv1d_fn, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        c = self.cfg
        t = h.shape[0]
        conv_state = st.read_conv()  # [conv_dim, W-1]
        pool = conv_state[None].clone()
        mixed = causal_conv1d_fn(h @ p["wqkv"], p["conv"], conv_state=pool,
                                 state_indices=torch.tensor([0]), has_initial_state=torch.tensor([start > 0]))
        st.write_conv(pool[0])
        qd, vd = c.k_heads * c.head_k_dim, c.v_heads * c.head_v_dim
        q = mixed[:, :qd].view(1, t, c.k_heads, c.head_k_dim)
        k = mixed[:, qd: 2 * qd].view(1, t, c.k_heads, c.head_k_dim)
        v = mixed[:, 2 * qd:].view(1, t, c.v_heads, c.head_v_dim)
        a, b = h @ p["wa"], h @ p["wb"]
        g = (-torch.exp(p["A_log"]) * F.softplus(a + p["dt_bias"]))[None]
        beta = torch.sigmoid(b)[None]
        ssm = st.read_ssm()  # (HV, dv, dk)
        initial = ssm.transpose(-1, -2)[None].contiguous() if start > 0 else None  # FLA: [N, HV, K, V]
        # Decode tokens take the recurrent form, prompt chunks the chunked (WY) form, as engines do.
        rule = fused_recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
        o, final = rule(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        st.write_ssm(final[0].transpose(-1, -2))
        o = o[0].view(t, c.v_heads, c.head_v_dim)
        z = (h @ p["wz"]).view(t, c.v_heads, c.head_v_dim)
        o = _rms(o, p["onorm"]) * F.silu(z)
        return o.reshape(t, vd) @ p["wout"]


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1] // 2
    freq = base ** (-torch.arange(d, dtype=torch.float32) / d)
    ang = pos[:, None].float() * freq[None]
    cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
