"""Gated DeltaNet (linear attention of Qwen3.5 / Qwen3-Next) over a flattened varlen batch.

Per token: one merged projection gives q|k|v (through a short causal depthwise conv + SiLU), the
output gate z, beta = sigmoid(b) and the log decay g = -exp(A_log) * softplus(a + dt_bias). q and k
are L2-normalized, q scaled by head_k_dim^-0.5; per value head the state S [Kd, Vd] evolves as

    S = exp(g) S;   u = beta (v - S^T k);   S = S + k u^T;   o = S^T q

then o goes through an RMSNorm gated by silu(z) and out_proj. A key head serves
num_v_heads / num_k_heads consecutive value heads.

Each sequence keeps two fixed-size states in its slot (`backend.state(j)` at `meta.state_slots`):
`conv` [K-1, conv_dim], the last K-1 pre-conv inputs, and `ssm` [HV, Kd, Vd], both float32 (the
conv inputs are model-dtype values, so float32 holds them exactly whatever the model dtype).
A sequence with `meta.has_initial_state` False starts from zeros. Everything below runs on device
tensors without host syncs in decode, so a decode step with these layers can be captured in a CUDA
graph. Padding rows (slot -1, CUDA-graph batches) read slot 0's state and write back exactly what
row 0 writes, so they never disturb a live sequence.

Kernels, chosen once when the model is placed on its device (`GatedDeltaNet.impl`):
* "fla": fla-core's Triton kernels, chunk_gated_delta_rule (varlen, cu_seqlens) for steps with a
  prefill and fused_recurrent_gated_delta_rule for decode steps;
* "torch": the float32 reference below (chunked WY form, one sequence at a time).
The conv is torch on both (K gathers of [T, conv_dim] rows; small next to the projections).

Tensor parallel: each rank holds num_k_heads / N key heads and num_v_heads / N value heads (a key
head's value heads stay on its rank): its rows of q, k and v in in_proj_qkv (three blocks, split
one by one), of z, b and a, its conv channels, dt_bias and A_log; the state of a slot holds only
its heads; out_proj is row-parallel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.distributed import parallel_state as ps
from ninfer.layers.linear import MergedLinear, RowParallelLinear

CHUNK = 64


def fla_available() -> bool:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: F401
    except Exception:  # fla needs triton; a CPU-only install may lack either
        return False
    return True


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, float32. q/k [L, HV, Kd] (normalized, q scaled), v [L, HV, Vd], g/beta [L, HV],
    state [HV, Kd, Vd] -> (o [L, HV, Vd], new state). Within a chunk of c tokens with cumulative log
    decay G_i, the updates u solve (I + strict_tril(beta_i e^(G_i-G_j) k_i.k_j)) u = beta (v - e^G k S0),
    then o = e^G q S0 + tril(e^(G_i-G_j) q_i.k_j) u and S = e^(G_c) S0 + sum_j e^(G_c-G_j) k_j u_j^T."""
    q, k, v, g, beta = (t.transpose(0, 1).float() for t in (q, k, v, g, beta))  # head-major
    s = state.float()
    outs = []
    for c0 in range(0, q.shape[1], chunk):
        qc, kc, vc = q[:, c0:c0 + chunk], k[:, c0:c0 + chunk], v[:, c0:c0 + chunk]
        gam = g[:, c0:c0 + chunk].cumsum(-1)  # [H, c]
        bc = beta[:, c0:c0 + chunk, None]
        n = qc.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (gam[:, :, None] - gam[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, c, c]
        a = (bc * decay * (kc @ kc.transpose(1, 2))).tril(-1)
        eye = torch.eye(n, dtype=a.dtype, device=a.device)
        rhs = bc * (vc - gam.exp()[..., None] * (kc @ s))
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        outs.append(gam.exp()[..., None] * (qc @ s) + (decay * (qc @ kc.transpose(1, 2))) @ u)
        last = gam[:, -1:]
        s = last.exp()[..., None] * s + (kc * (last - gam).exp()[..., None]).transpose(1, 2) @ u
    return torch.cat(outs, 1).transpose(0, 1), s


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times silu(gate) (transformers' order and rounding)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """`state_layer` is the layer's index among the recurrent layers (`backend.state(state_layer)`)."""

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, *, state_layer: int) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        size = ps.tp_size()
        for n, what in ((num_k_heads, "linear_num_key_heads"), (num_v_heads, "linear_num_value_heads")):
            if n % size:
                raise ValueError(f"tensor-parallel-size {size} does not divide {what}={n}")
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim  # whole model
        qkv = (key_dim, key_dim, value_dim)
        self.hk, self.hv, self.dk, self.dv = num_k_heads // size, num_v_heads // size, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = self.hk * head_k_dim, self.hv * head_v_dim  # this rank
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = conv_kernel
        self.state_layer = state_layer
        self.impl = "torch"
        self.in_proj = MergedLinear(hidden, (("in_proj_qkv", qkv), ("in_proj_z", value_dim),
                                             ("in_proj_b", num_v_heads), ("in_proj_a", num_v_heads)), bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.conv1d.tp_shards = {"weight": (0, qkv)}
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.tp_shards = {"dt_bias": (0, (num_v_heads,)), "A_log": (0, (num_v_heads,))}
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowParallelLinear(value_dim, hidden, bias=False)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.kernel - 1, self.conv_dim), "ssm": (self.hv, self.dk, self.dv)}

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, backend: BaseAttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        state = backend.state(self.state_layer)
        slots = meta.state_slots.long()
        # padding rows (slot -1) alias row 0: they read its state and write back its values
        valid = slots >= 0
        rows = torch.where(valid, slots, slots[:1])
        keep = meta.has_initial_state & valid
        mixed, z, b, a = self.in_proj(x).split((self.conv_dim, self.value_dim, self.hv, self.hv), dim=-1)
        mixed = self._conv(mixed, state["conv"], rows, keep, valid, meta)
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = q.reshape(t, self.hk, self.dk)
        k = k.reshape(t, self.hk, self.dk)
        v = v.reshape(t, self.hv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        s0 = state["ssm"].index_select(0, rows) * keep[:, None, None, None]
        o, s1 = self._rule(q, k, v, g, beta, s0, meta)
        s1 = torch.where(valid[:, None, None, None], s1, s1[:1])
        state["ssm"].index_copy_(0, rows, s1.to(state["ssm"].dtype))
        o = self.norm(o.reshape(t * self.hv, self.dv).to(x.dtype), z.reshape(t * self.hv, self.dv))
        return self.out_proj(o.reshape(t, self.value_dim))

    def _conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor,
              valid: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Causal depthwise conv + SiLU of each sequence's tokens, continuing its stored window;
        writes the last K-1 inputs back. Sequence s's rows in `ext` are its K-1 stored inputs then
        its tokens, so token i of it sees ext rows i .. i+K-1 of its segment."""
        t, km1 = mixed.shape[0], self.kernel - 1
        nseq = rows.shape[0]
        qsl = meta.query_start_loc.long()
        seq_of = torch.searchsorted(qsl[1:], torch.arange(t, device=mixed.device), right=True)
        tok_row = torch.arange(t, device=mixed.device) + (seq_of + 1) * km1
        init = conv_state.index_select(0, rows).to(mixed.dtype) * keep[:, None, None]
        ext = mixed.new_empty(t + nseq * km1, self.conv_dim)
        seg_start = qsl[:-1] + torch.arange(nseq, device=mixed.device) * km1
        ext[(seg_start[:, None] + torch.arange(km1, device=mixed.device)).reshape(-1)] = init.reshape(-1, self.conv_dim)
        ext[tok_row] = mixed
        w = self.conv1d.weight.reshape(self.conv_dim, self.kernel).float()
        acc = torch.zeros(t, self.conv_dim, dtype=torch.float32, device=mixed.device)
        for j in range(self.kernel):  # peak: ext + acc + one gathered tap (12 B per element in bf16)
            acc.addcmul_(ext[tok_row - km1 + j], w[:, j])
        seg_end = qsl[1:] + (torch.arange(nseq, device=mixed.device) + 1) * km1
        new = ext[(seg_end[:, None] - km1 + torch.arange(km1, device=mixed.device)).reshape(-1)]
        new = new.reshape(nseq, km1, self.conv_dim)
        new = torch.where(valid[:, None, None], new, new[:1])
        conv_state.index_copy_(0, rows, new.to(conv_state.dtype))
        return F.silu(acc, inplace=True).to(mixed.dtype)

    def _rule(self, q, k, v, g, beta, s0, meta: AttentionMetadata):
        """(o [T, HV, Vd], final states [B, HV, Kd, Vd] float32)."""
        if self.impl == "fla":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            if meta.is_decode:  # one token per sequence: batch of B sequences of length 1
                o, s1 = fused_recurrent_gated_delta_rule(
                    q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=self.dk ** -0.5,
                    initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
                return o[:, 0], s1
            cpu = None  # the host copy of cu_seqlens spares fla a device sync
            if meta.query_lens_cpu is not None:
                cpu = torch.tensor([0, *meta.query_lens_cpu], dtype=torch.long).cumsum(0)
            o, s1 = chunk_gated_delta_rule(
                q[None], k[None], v[None], g[None], beta[None], scale=self.dk ** -0.5, initial_state=s0,
                output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=meta.query_start_loc.long(),
                cu_seqlens_cpu=cpu)
            return o[0], s1
        rep = self.hv // self.hk
        q = l2norm(q.float()).repeat_interleave(rep, dim=1) * self.dk ** -0.5
        k = l2norm(k.float()).repeat_interleave(rep, dim=1)
        if meta.is_decode:  # one recurrence step for the whole batch
            s = s0 * g.exp()[..., None, None]
            u = beta.float()[..., None] * (v.float() - torch.einsum("bhkv,bhk->bhv", s, k))
            s = s + k[..., None] * u[..., None, :]
            return torch.einsum("bhkv,bhk->bhv", s, q), s
        lens = meta.query_lens_cpu or meta.query_start_loc.diff().tolist()
        outs, states, start = [], [], 0
        for i, n in enumerate(lens):
            o, s = gated_delta_rule_ref(q[start:start + n], k[start:start + n], v[start:start + n],
                                        g[start:start + n], beta[start:start + n], s0[i])
            outs.append(o)
            states.append(s)
            start += n
        return torch.cat(outs), torch.stack(states)
