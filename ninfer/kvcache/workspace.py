"""Transient memory of a forward step (the planner's workspace and CUDA-graph terms), and the
prefill chunk sizes the planner chooses among (`plan_memory` with max_num_batched_tokens="auto")."""
from __future__ import annotations

from ninfer.kvcache.memory import MiB
from ninfer.model_config import ModelConfig

GRAPH_BYTES_PER_CAPTURE = 4 * MiB     # per captured batch size: graph exec + static I/O buffers
DECODE_MAX_SPLITS = 64                # split-KV partitions the decode kernel may use per sequence
# "auto" prefill chunk: the largest of these whose workspace over the smallest one's costs at most
# CHUNK_KV_SHARE of the KV pool (a long prompt in fewer, larger chunks re-reads its stored prefix
# fewer times and launches fewer kernels); the smallest is the chunk on CPU and the floor everywhere.
AUTO_PREFILL_CHUNKS = (32768, 16384, 8192)
CHUNK_KV_SHARE = 0.02


def activation_workspace(model: ModelConfig, tokens: int, act_bytes: int, max_num_seqs: int) -> dict[str, int]:
    """Peak transient memory of one forward step over `tokens` new tokens, by named buffer.

    With T tokens, H hidden, I intermediate, Hq/Hkv heads of size D, a = activation bytes:
      hidden     2*T*H*a                       residual stream + normed input, live across layers
      attention  T*((Hq+2Hkv)*D + (Hq+Hkv)*D + Hq*D + H)*a
                                               qkv projection, q/k after norm+RoPE, attention
                                               output, o_proj output
      mlp        T*(3*I + H)*a                 gate_up (2I), act(gate)*up (I), down output
      gdn        T*((C + Vh + 2Hv)*a + C*(2a+8))  hybrids' GDN layer (C conv channels, Vh value
                                               dims, Hv value heads): in_proj output, conv input,
                                               fp32 accumulator, one gathered tap
      kv_store   4*T*Hkv*D*4                   fp32 K and V staged for quantization, plus their
                                               rotated copies
      decode     S*Hq*DECODE_MAX_SPLITS*(D+1)*4 split-KV partial outputs + log-sum-exp, S = seqs
      logits     6*S*V*4                       fp32 logits of the sampled rows and the sampler's
                                               copies: penalised logits, probabilities, sorted
                                               values, int64 sort indices (2 units), cumsum
    Attention and MLP stages of a layer never overlap, so the peak takes the larger of the two;
    the others are added. Prefill attention itself is tiled (flash-style) and needs no T x ctx
    buffer on the GPU path; the CPU reference path is not what this arithmetic measures.
    """
    T, H, I, D = tokens, model.hidden_size, model.intermediate_size, model.head_dim
    hq, hkv, S = model.num_heads, model.num_kv_heads, max_num_seqs
    attn = T * ((hq + 2 * hkv) * D + (hq + hkv) * D + hq * D + H) * act_bytes
    mlp = T * (3 * I + H) * act_bytes
    gdn, shapes = 0, model.recurrent_state_shapes()
    if shapes:  # hybrids' GDN layers: merged in_proj output, then the conv's input + fp32 sum + one tap
        conv, (hv, _, dv) = shapes["conv"][1], shapes["ssm"]
        gdn = T * (conv + hv * dv + 2 * hv) * act_bytes + T * conv * (2 * act_bytes + 8)
    return {
        "hidden": 2 * T * H * act_bytes,
        "layer": max(attn, mlp, gdn),
        "kv_store": 4 * T * hkv * D * 4,
        "decode": S * hq * DECODE_MAX_SPLITS * (D + 1) * 4,
        "logits": 6 * S * model.vocab_size * 4,
    }


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes captured as CUDA graphs: 1, 2, 4, 8, then every 16, and max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def _graph_pool_bytes(model: ModelConfig, act_bytes: int, max_num_seqs: int) -> int:
    """Decode graphs share one private pool sized by the largest batch: its activations (the
    workspace formula with T = S, without logits, which are computed outside the graph) plus a fixed
    allowance per captured size. The graphs' static block table is added per context page."""
    w = activation_workspace(model, max_num_seqs, act_bytes, max_num_seqs)
    pool = w["hidden"] + w["layer"] + w["kv_store"] + w["decode"]
    return pool + len(cuda_graph_batch_sizes(max_num_seqs)) * GRAPH_BYTES_PER_CAPTURE
