"""Tiny random transformers GlmMoeDsaForCausalLM models: the parity oracle for GLM-5.x.

Weights (and the router's correction-bias buffer) are re-randomised at O(1) scale: norms at 1 + 0.3 N(0, 1),
biases 0.3 N(0, 1), projections N(0, 1 / fan_in). Hooks on the indexers record every full layer's top-k selection
and the smallest gap between the k-th and (k+1)-th visible index score (how far the selection is from a tie).
"""
import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(2)


def glm_hf_config(**overrides):
    from transformers import GlmMoeDsaConfig

    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, index_topk=16, index_n_heads=16, index_head_dim=16,
        first_k_dense_replace=1, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="eager",
    )
    fields.update(overrides)
    return GlmMoeDsaConfig(**fields)


def rerandomise_(model, seed: int):
    """In place: every parameter and the correction-bias buffer to an O(1)-scale random value for its role."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + [
                (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]:
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                p.copy_(0.3 * r)
            elif p.ndim == 1:  # plain-w RMSNorm / LayerNorm weights
                p.copy_(1.0 + 0.3 * r)
            else:  # [out, in] projections, [E, out, in] experts
                p.copy_(r / np.sqrt(p.shape[-1]))
    return model


def make_glm_checkpoint(directory, seed=0, **overrides):
    """Build, re-randomise and save a GlmMoeDsaForCausalLM; returns the torch model (float32, eval)."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(glm_hf_config(**overrides)).float().eval()
    rerandomise_(model, seed)
    model.save_pretrained(directory)
    return model


def _index_scores(indexer, hidden, q_resid, cos, sin):
    """transformers' GlmMoeDsaIndexer score computation (before masking): [B, S, S] float32."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    b, s, _ = hidden.shape
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    rope = indexer.qk_rope_head_dim
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden.float()).float() * indexer.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def hf_logits_and_selection(model, tokens):
    """(logits [T, V], per full layer the set of visible selected positions per query, smallest top-k gap).

    The gap is min over full layers and rows with more than k visible keys of (k-th - (k+1)-th largest score).
    """
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    selections, gaps, handles = [], [], []
    k = model.config.index_topk

    def hook(module, args, kwargs, output):
        hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
        scores = _index_scores(module, hidden, q_resid, cos, sin)[0]
        t = scores.shape[0]
        visible = torch.tril(torch.ones(t, t, dtype=torch.bool))
        chosen = output[0].numpy()
        selections.append([set(int(u) for u in chosen[i] if u <= i) for i in range(t)])
        for i in range(k, t):  # rows with more than k visible keys
            top = torch.topk(scores[i][visible[i]], k + 1).values
            gaps.append(float(top[k - 1] - top[k]))

    for module in model.modules():
        if isinstance(module, GlmMoeDsaIndexer):
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None]).logits[0].float().numpy()
    finally:
        for h in handles:
            h.remove()
    return logits, selections, min(gaps) if gaps else float("inf")
