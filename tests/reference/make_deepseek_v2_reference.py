#!/usr/bin/python3
"""DeepSeek-V2 and DeepSeek-V3 fixtures (Hugging Face model_type "deepseek_v2", the model of
deepseek-ai/DeepSeek-V2 and DeepSeek-V2-Lite, and "deepseek_v3", of deepseek-ai/DeepSeek-V3 and
DeepSeek-R1), from an independent PyTorch implementation written here, for dstrain's tests of
multi-head latent attention (MLA) and of DeepSeek's routers:

  deepseek_v2_tiny/  V2-Lite-shaped: no q_lora_rank (q_proj), kv_lora_rank 16, qk_nope_head_dim
                     8, qk_rope_head_dim 4, v_head_dim 6 (not the qk head dim 12), 4 heads,
                     hidden 32, 3 layers (layer 0 dense), 8 routed experts top 2 of softmax
                     scores, "group_limited_greedy" (4 groups, 2 kept), not renormalized, times
                     routed_scaling_factor 1.5, 2 shared experts; plain rotary (rope_scaling
                     null); aux_loss_alpha 0; untied head; F32
  deepseek_v3_tiny/  V3-shaped: q_lora_rank 12 (q_a_proj, q_a_layernorm, q_b_proj), kv_lora_rank
                     16, qk_nope 8, qk_rope 4, v_head_dim 8; 16 routed experts top 4 of sigmoid
                     scores, "noaux_tc" with a non-zero e_score_correction_bias (4 groups of 4,
                     2 kept), renormalized, times 2.5, 1 shared expert; yarn rotary (factor 16,
                     original_max_position_embeddings 1024, beta_fast 32, beta_slow 1, mscale
                     and mscale_all_dim 1); num_nextn_predict_layers 1, with the multi-token
                     prediction layer's tensors model.layers.3.* in model.safetensors, as the
                     hub's V3 checkpoint holds model.layers.61.*, which the model does not read

transformers 4.41 has neither (the model code ships with the checkpoints on the Hugging Face hub,
trust_remote_code), so the model is written here from the facts of DeepSeek's
modeling_deepseek.py and configuration_deepseek.py. Where they were read (GitHub copies of the
hub files; three or more copies of each agree):
  V3: ramanuja-ganesh-k/Create-Bot-V1 modeling_deepseek.py (its configuration_deepseek.py says
      "Copy from https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/..."); the same file,
      but for one line (the torch.fx condition), in 1nl00k/inspectR1 ("original R1 files", with
      R1's config.json) and zhangbo2008/hf_deepseek_annotated aaa/ (also its import and an
      appended test); intel/auto-round modeling_deepseek.py (commit 3fc2c52) is it patched for
      cuda.
  V2: dawson-chen/mla-fuse, JerryYin777/DeepSeek-v2-MoE-MLA-DLB_and_CB-Loss-Implementation and
      Chenaldo/carvekv_code modeling_deepseek.py, each modified by its owner in other places:
      dawson-chen's with its attention (changed for a weight-fusion experiment) replaced by V3's
      file's, which is V2-Lite's (Chenaldo's commented copy), differs from JerryYin's copy of
      DeepSeek-V2's only by that copy's additions (device and communication losses) and by the
      q_lora_rank null branch of V2-Lite. V2-Lite's config.json: Chenaldo/carvekv_code at
      commit 17be753.
  The MTP tensor names: deepseek-ai/DeepSeek-V3 README_WEIGHTS.md and the hub's
      model.safetensors.index.json as quoted by several loaders.

The facts (V2 and V3 alike unless said):
  * Blocks, RMSNorm (variance in fp32, eps rms_norm_eps), SwiGLU MLPs, the dense/MoE layer rule
    (MoE where n_routed_experts is set and i >= first_k_dense_replace and i % moe_layer_freq ==
    0), final model.norm, untied lm_head, logits in fp32, the cross-entropy loss, the
    initialization (nn.Linear/nn.Embedding normal(0, initializer_range), RMSNorm 1, MoEGate's
    weight left at kaiming_uniform(a=sqrt(5)), DeepseekV2Model initialized before lm_head is
    made): DeepSeekMoE's, so make_deepseek_reference.py's classes serve (its DecoderLayer, Body,
    DeepseekForCausalLM with this file's attention and MoE).
  * MLA (DeepseekV2Attention / DeepseekV3Attention, the same code), H heads, q_head_dim =
    qk_nope_head_dim + qk_rope_head_dim:
      q = q_proj(x) (q_lora_rank null) or q_b_proj(q_a_layernorm(q_a_proj(x))), viewed
        (B, T, H, q_head_dim), each head split [nope | rope];
      kv_a_proj_with_mqa(x) (hidden -> kv_lora_rank + qk_rope_head_dim) split [c | k_pe]: k_pe
        (qk_rope_head_dim) is ONE rotary key shared by all heads and is not normalized;
      kv_b_proj(kv_a_layernorm(c)) (kv_lora_rank -> H * (qk_nope_head_dim + v_head_dim)),
        viewed (B, T, H, nope + v), each head split [k_nope | v];
      query = [q_nope | rope(q_pe)], key = [k_nope | rope(k_pe)] (q_head_dim each);
      softmax(query key^T * softmax_scale + causal mask) in fp32, times v (v_head_dim), heads
      concatenated (H * v_head_dim) into o_proj.
      q_a_layernorm and kv_a_layernorm are DeepseekV2RMSNorm(size) with the default eps 1e-6,
      NOT rms_norm_eps. attention_bias gives q_a_proj, kv_a_proj_with_mqa and o_proj a bias
      (q_proj, q_b_proj and kv_b_proj never have one). num_key_value_heads is in the config but
      MLA does not read it.
      Module order (and so the initial draws): q_proj | q_a_proj, q_a_layernorm, q_b_proj; then
      kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj.
  * The rotary interleave: apply_rotary_pos_emb(q, k, ...) first permutes the last dim of q_pe
    and k_pe, x.view(..., d/2, 2).transpose(-1, -2).reshape(..., d), so that x'[j] = x[2j] and
    x'[d/2 + j] = x[2j+1] (interleaved pairs to halves), then applies llama's
    x' * cos + rotate_half(x') * sin with cos = cat(cos(p f), cos(p f)) over the d/2
    frequencies f. So the pair (x[2j], x[2j+1]) is rotated by the angle p * f[j], and the
    result stays in the halves order (out[j], out[d/2 + j]); q and k alike, so the scores are
    those of the interleaved rotation of the paper. The inv_freq are 1 / rope_theta^(2j/d),
    d = qk_rope_head_dim.
  * softmax_scale = q_head_dim^-0.5; where rope_scaling is set (any type) and its mscale_all_dim
    is non-zero, times mscale^2 with mscale = yarn_get_mscale(factor, mscale_all_dim) =
    0.1 * mscale_all_dim * ln(factor) + 1 (1 where factor <= 1).
  * Yarn rotary (rope_scaling.type "yarn", DeepseekV2YarnRotaryEmbedding), always applied, at
    any sequence length: extra_j = 1 / theta^(2j/d), inter_j = extra_j / factor;
    corr(r) = d * ln(original_max_position_embeddings / (2 pi r)) / (2 ln theta);
    low = max(floor(corr(beta_fast)), 0), high = min(ceil(corr(beta_slow)), d - 1) (high +=
    0.001 where equal); ramp_j = clamp((j - low) / (high - low), 0, 1), mask = 1 - ramp;
    inv_freq = inter * (1 - mask) + extra * mask; cos and sin are both multiplied by
    yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) (1 here, as in
    V3's and V2's configs where the two are equal). Here d = 4, so the ramp is [0, 0.5]:
    inv_freq = [1, (1/100 + 1/1600) / 2].
  * MoE layers: experts (DeepseekV2MLP of moe_intermediate_size), MoEGate `gate`, and one
    `shared_experts` MLP of n_shared_experts * moe_intermediate_size added with no gate (in
    that order). MoEGate: logits = x W^T in fp32.
    V2 (softmax only): scores = softmax(logits). topk_method "greedy" (V2-Lite's config; the
    hub's V2 copies spell it "gready" or "greedy") = top-k of scores; "group_limited_greedy"
    (DeepSeek-V2's): the E experts in n_group groups of consecutive experts, a group's score is
    its largest score, the topk_group best groups are kept, the others' scores set to 0.0, then
    top-k. The weights are the chosen scores; if k > 1 and norm_topk_prob they are divided by
    (their sum + 1e-20) and NOT scaled, else (only then) multiplied by routed_scaling_factor.
    V3 (sigmoid only, topk_method "noaux_tc" only): scores = sigmoid(logits); the choice uses
    scores + e_score_correction_bias (E): a group's score is the sum of its top 2 biased scores,
    the topk_group best groups kept, the other groups' biased scores set to 0.0, top-k of the
    biased scores; the weights are the UNBIASED scores of the chosen experts, divided by (their
    sum + 1e-20) if k > 1 and norm_topk_prob, then ALWAYS multiplied by routed_scaling_factor.
    Masking with 0.0 equals leaving the group out only while every (biased) score is > 0: the
    softmax scores are, and the bias here is positive, so here it does (checked).
    torch.topk(..., sorted=False) in both: the order of the k chosen is the library's.
  * The routed output is sum_k w_k expert_k(x) (the training path of DeepseekV2MoE: each token
    repeated k times, each expert on its rows, weighted sum over k); V2 in training passes it
    through AddAuxiliaryLoss with MoEGate's aux loss, the formula of DeepSeekMoE (seq_aux: per
    sequence, count of choices of e / (seq_len * k / E) times the mean score of e, summed over
    e, mean over sequences, times aux_loss_alpha; computed from the full softmax scores and
    the group-limited choices, only when training and aux_loss_alpha > 0; its gradient enters
    with weight 1 per micro-batch, make_deepseek_reference.py). With alpha 0 none is computed
    (and DeepSeek's own training path then fails on AddAuxiliaryLoss.apply(y, None), as
    DeepSeekMoE's). seq_aux would only choose the per-sequence form; with alpha 0 it does not
    matter.
  * V3's published code is inference-only: MoEGate asserts `not self.training` under noaux_tc,
    DeepseekV3MoE.forward computes the routed output only when not training (moe_infer, under
    torch.no_grad), and nothing reads aux_loss_alpha or seq_aux (V3's config has 0.001 and
    true; kept in the fixture's config as the hub writes them; no aux loss is computed here).
    e_score_correction_bias is an nn.Parameter(torch.empty(E)) of MoEGate there, left
    uninitialized (the checkpoint gives it), never given a gradient (it only picks experts).
    So training here is the inference computation with gradients: the bias is a constant
    (a buffer; in grads0 it has no entry, in final.safetensors it is the initial value), and
    the routed output is the DeepSeek-V2 training path's weighted sum. (DeepSeek's V3 training
    updated the bias outside the gradient, by its load-balancing rule; that is not in the
    published code and not done here.)
  * V3's DeepseekV3Model builds num_hidden_layers layers only: the MTP module (model.layers.{n}
    for n = num_hidden_layers: embed_tokens, enorm, hnorm, eh_proj (hidden, 2 hidden),
    shared_head.norm, shared_head.head, and a full MoE decoder layer) is in the checkpoint and
    unused (from_pretrained reports its tensors as not used). Here its tensors are random,
    embed_tokens and shared_head.head copies of the model's embed_tokens and lm_head (the hub
    says they share them).

Weights: torch.manual_seed(WEIGHT_SEED), the modules built in DeepSeek's order, so the initial
weights are those of DeepSeek's own DeepseekV2ForCausalLM / DeepseekV3ForCausalLM(config) with
that seed (checked bit for bit); then make_llama_reference.py's perturb (norms, q_a_layernorm
and kv_a_layernorm included, 1 + 0.1 N(0, 1); routers 0.5 N(0, 1)); V3's biases
0.05 + 0.2 U(0, 1) (Generator(WEIGHT_SEED + 2)), the MTP tensors from the seeds WEIGHT_SEED + 3
to + 5 (mtp_tensors).

When these fixtures were made, DeepSeek's own modeling_deepseek.py was run on them outside the
repository, under transformers 4.41 from a package in /tmp (V3's file as published, V2's as
put together above), each configuration_deepseek.py given the fixture's config.json:
  * from the seed, the same initial weights bit for bit (V3's bias aside: its code leaves it
    uninitialized);
  * model.safetensors loads with nothing missing (V3: the 68 MTP tensors the only unexpected);
  * eval logits: V2 identical, V3 within 1.5e-8; the initial loss equal to 1e-9, and DeepSeek's
    own returned loss (labels shifted inside) equal to the reference's cross-entropy;
  * training mode: every gradient of micro-batch 0 within 4.2e-7 of the tensor's largest (V2
    and V3), no gradient for V3's bias; over the 10 steps losses within 2.4e-7, grad norms
    within 6e-8, final weights within 2.8e-7, the biases unchanged.
Shims: V2 training with alpha 0: AddAuxiliaryLoss.apply(y, None) -> y. V3 training: its
MoEGate and DeepseekV3MoE modules kept in eval mode (so the assert passes and moe_infer runs)
and moe_infer without its torch.no_grad, the rest in training mode (no dropout: the same
computation). The comparison sees the details: in V3, leaving out mscale^2, the interleave
permutation or the bias moves the logits by 1.6e-3, 1.4e-3 and 1.5e-2; plain instead of yarn
frequencies moves them by 2.1e-5 and the gradients by 2.3%.

Each directory holds config.json (DeepSeek's fields, as the hub's config.json writes them,
without auto_map and quantization_config), model.safetensors (F32, one file) and, as
make_deepseek_reference.py's fixtures: train.bin, grads0.safetensors, final.safetensors and
expected.json (the same settings, keys and training loop: make_llama_reference.py's TRAINING,
seeds and perturb, make_gpt2_reference.py's data, cross-entropy, schedule and AdamW), plus
`buffers` (tensors read but not trained) and `unused_tensors` (tensors a loader must skip).

Run from the repository root, with Debian's python3-torch (torch 1.13) and transformers 4.41
(only because make_llama_reference.py imports it; the model here does not use it):
  /usr/bin/python3 tests/reference/make_deepseek_v2_reference.py [NAME ...]
dstrain never needs torch at run time: this script only makes fixtures.
"""
import math
import os
import sys

import torch
from torch import nn

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_deepseek_reference import (MoE, DecoderLayer, DeepseekForCausalLM,  # noqa: E402
                                     RMSNorm, init_weights, rotate_half, train_fixture)
from make_gpt2_reference import micro_batch  # noqa: E402
from make_llama_reference import TOKEN_SEED, TRAINING, WEIGHT_SEED, perturb  # noqa: E402

# The fields of DeepSeek-V2-Lite's config.json (configuration_deepseek.py's DeepseekV2Config).
V2_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 67,  # odd on purpose
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 12,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # not read by MLA
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "n_shared_experts": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.5,
    "topk_method": "group_limited_greedy",
    "n_group": 4,
    "topk_group": 2,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "aux_loss_alpha": 0.0,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 64,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "pretraining_tp": 1,
    "use_cache": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# DeepSeek-V3's config.json fields (its DeepseekV3Config), scaled down.
V3_CONFIG = dict(
    V2_CONFIG,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    q_lora_rank=12,
    v_head_dim=8,
    n_shared_experts=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=8,
    routed_scaling_factor=2.5,
    topk_method="noaux_tc",
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    aux_loss_alpha=0.001,  # as V3's config; V3's code never reads it
    ep_size=1,
    num_nextn_predict_layers=1,
    max_position_embeddings=16384,  # factor * original_max_position_embeddings, as V3's
    rope_scaling={
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
FIXTURES = {"deepseek_v2_tiny": V2_CONFIG, "deepseek_v3_tiny": V3_CONFIG}


# ----------------------------------------------------------------------------- rotary

def yarn_get_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_tables(c, T):
    """cos, sin (T, qk_rope_head_dim) in the halves layout, llama's or yarn's (see above)."""
    d, theta, scaling = c["qk_rope_head_dim"], c["rope_theta"], c["rope_scaling"]
    exponents = torch.arange(0, d, 2, dtype=torch.float32) / d
    magnitude = 1.0
    if scaling is None:
        inv_freq = 1.0 / (theta ** exponents)
    else:
        assert scaling["type"] == "yarn", scaling
        factor = scaling["factor"]
        original = scaling.get("original_max_position_embeddings", 4096)
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

        def correction_dim(rotations):
            return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolated = 1.0 / (theta ** exponents)
        interpolated = 1.0 / (factor * theta ** exponents)
        keep = 1.0 - ramp  # the share of the original (extrapolated) frequency
        inv_freq = interpolated * (1 - keep) + extrapolated * keep
        magnitude = float(yarn_get_mscale(factor, scaling.get("mscale", 1))
                          / yarn_get_mscale(factor, scaling.get("mscale_all_dim", 0)))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    if scaling is None:
        return angles.cos(), angles.sin()
    return angles.cos() * magnitude, angles.sin() * magnitude


def apply_rotary(x, cos, sin):
    """DeepSeek's apply_rotary_pos_emb on x (..., T, d): interleaved pairs to halves, then
    llama's rotation; the result stays in the halves order."""
    d = x.shape[-1]
    x = x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(x.shape)
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------- attention

class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepseekV2Attention / DeepseekV3Attention)."""

    def __init__(self, c):
        super().__init__()
        C, H = c["hidden_size"], c["num_attention_heads"]
        self.c, self.H = c, H
        self.nope, self.rope, self.v_dim = (c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                            c["v_head_dim"])
        self.q_dim = self.nope + self.rope
        self.rank = c["kv_lora_rank"]
        bias = c["attention_bias"]
        # DeepSeek's order, and its eps: the latent norms use the default 1e-6.
        if c["q_lora_rank"] is None:
            self.q_proj = nn.Linear(C, H * self.q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(C, c["q_lora_rank"], bias=bias)
            self.q_a_layernorm = RMSNorm(c["q_lora_rank"], 1e-6)
            self.q_b_proj = nn.Linear(c["q_lora_rank"], H * self.q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(C, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, C, bias=bias)
        self.softmax_scale = self.q_dim ** -0.5
        scaling = c["rope_scaling"]
        if scaling is not None and scaling.get("mscale_all_dim", 0):
            mscale = yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"])
            self.softmax_scale = self.softmax_scale * mscale * mscale

    def forward(self, x):
        B, T, _ = x.shape
        H = self.H
        if self.c["q_lora_rank"] is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, self.q_dim).transpose(1, 2)  # (B, H, T, q_dim)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        latent, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [self.rank, self.rope], dim=-1)
        k_pe = k_pe.view(B, T, 1, self.rope).transpose(1, 2)  # (B, 1, T, rope): all heads'
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(B, T, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)  # (B, H, T, .)
        cos, sin = rotary_tables(self.c, T)
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin)
        query = torch.cat((q_nope, q_pe), dim=-1)  # (B, H, T, q_dim)
        key = torch.cat((k_nope, k_pe.expand(B, H, T, self.rope)), dim=-1)
        scores = (query @ key.transpose(2, 3)) * self.softmax_scale
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * self.v_dim))


# ----------------------------------------------------------------------------- routers

class RoutedMoE(MoE):
    """DeepseekV2MoE / DeepseekV3MoE: make_deepseek_reference.py's MoE (experts, gate, shared
    experts; dispatch, V2's aux loss) with V2's or V3's MoEGate routing."""

    def __init__(self, c):
        super().__init__(c)
        self.v3 = c["model_type"] == "deepseek_v3"
        self.method, self.scale = c["topk_method"], c["routed_scaling_factor"]
        self.n_group, self.topk_group = c["n_group"], c["topk_group"]
        if self.v3:
            assert self.scoring_func == "sigmoid" and self.method == "noaux_tc"
            self.alpha = 0.0  # V3's code computes no aux loss, whatever aux_loss_alpha says
            # A buffer here (a Parameter without gradient there): chooses, never weighs.
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(self.E))
        else:
            assert self.scoring_func == "softmax"
            assert self.method in ("greedy", "group_limited_greedy"), self.method
        self.last_margin = math.inf
        self.last_chosen = None  # this forward's experts (N, k)

    def route(self, flat):
        N, E, k = flat.shape[0], self.E, self.k
        logits = flat.float() @ self.gate.weight.float().t()  # (N, E)
        if self.v3:
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias.unsqueeze(0)
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            choice = scores
        assert (choice > 0).all(), "a 0.0 mask would not leave the groups out"
        allowed = torch.ones(N, E, dtype=torch.bool)
        self.last_margin = math.inf
        if self.method != "greedy":
            per_group = choice.view(N, self.n_group, E // self.n_group)
            if self.v3:  # the sum of the group's two best biased scores
                group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
            else:  # the group's best score
                group_scores = per_group.max(dim=-1).values
            kept = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
            groups = torch.zeros(N, self.n_group, dtype=torch.bool).scatter_(1, kept, True)
            allowed = groups.repeat_interleave(E // self.n_group, dim=1)
            if self.topk_group < self.n_group:
                top = self.gap_scale(
                    torch.topk(group_scores, self.topk_group + 1, dim=-1).values.detach())
                self.last_margin = (top[:, -2] - top[:, -1]).min().item()
        chosen = torch.topk(choice.masked_fill(~allowed, 0.0), k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)  # (N, k), unbiased
        if k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            if self.v3:
                weights = weights * self.scale
        else:
            weights = weights * self.scale
        top = self.gap_scale(
            torch.topk(choice.masked_fill(~allowed, -math.inf), k + 1, dim=-1).values.detach())
        self.last_margin = min(self.last_margin, (top[:, k - 1] - top[:, k]).min().item())
        self.last_chosen = chosen.detach()
        return scores, weights, chosen

    def gap_scale(self, scores):
        """Where margins are measured: V2's softmax scores as their logs (a gap is then a gap of
        router logits, whatever the scores' size, as make_deepseek_reference.py's margin),
        V3's biased sigmoid scores (in (0.05, 1.25)) as they are."""
        return scores if self.v3 else scores.log()

    def margin(self):
        """The smallest gap, over the last forward's tokens, between the topk_group-th and the
        next group score and between the k-th and the (k+1)-th (biased) score of the kept
        groups (gap_scale): where it is far above fp32 rounding, the choices are the same in
        any fp32 implementation."""
        return self.last_margin


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM (the MTP layer not built)."""

    def __init__(self, c):
        super().__init__(c, LatentAttention, RoutedMoE)


# ----------------------------------------------------------------------------- fixtures

def correction_biases(model, c, seed):
    """V3's e_score_correction_bias of each MoE layer: 0.05 + 0.2 U(0, 1), positive so that every
    biased score is > 0, large enough to change choices."""
    generator = torch.Generator().manual_seed(seed)
    biases = {}
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.mlp, MoE):
            continue
        gate = layer.mlp.gate
        gate.e_score_correction_bias.copy_(
            0.05 + 0.2 * torch.rand(c["n_routed_experts"], generator=generator))
        biases[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = gate.e_score_correction_bias
    return biases


def mtp_tensors(model, c, seed):
    """The multi-token prediction module's tensors, model.layers.{num_hidden_layers}.*, as the
    hub's V3 checkpoint holds them (dstrain's loader must skip them)."""
    n, C = c["num_hidden_layers"], c["hidden_size"]
    prefix = f"model.layers.{n}."
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layer = DecoderLayer(c, n, LatentAttention, RoutedMoE)
    layer.apply(lambda m: init_weights(m, c["initializer_range"]))
    perturb(layer, seed + 1)
    generator = torch.Generator().manual_seed(seed + 2)
    layer.mlp.gate.e_score_correction_bias.copy_(
        0.05 + 0.2 * torch.rand(c["n_routed_experts"], generator=generator))
    torch.random.set_rng_state(state)
    tensors = {prefix + "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone()}
    for norm in ("enorm", "hnorm"):
        tensors[prefix + norm + ".weight"] = 1 + 0.1 * torch.randn(C, generator=generator)
    tensors[prefix + "eh_proj.weight"] = 0.02 * torch.randn(C, 2 * C, generator=generator)
    tensors.update({prefix + name: t.detach().clone() for name, t in layer.state_dict().items()})
    tensors[prefix + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(C, generator=generator)
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return tensors


NOTES = [
    "the training loop of make_gpt2_reference.py (see tests/reference/README.md)",
    "weight decay applies to 2-D tensors only (the embedding, the head, every "
    "projection matrix and the routers), not to RMSNorm weights (q_a_layernorm and "
    "kv_a_layernorm included)",
    "losses and initial_loss are the cross-entropy only",
    "min_topk_margin: the smallest gap over all tokens, MoE layers and forwards between the "
    "topk_group-th and the next group score and between the k-th and (k+1)-th (biased) "
    "expert score of the kept groups (the routing is not a near tie); V2: gaps of the "
    "scores' logs (= of router logits), V3: of the biased sigmoid scores",
]
V2_NOTES = NOTES + [
    "aux_loss_alpha 0: no aux loss (aux_losses 0); with alpha > 0 it would be "
    "DeepSeekMoE's (see deepseek_moe_aux_tiny), on the full softmax scores and the "
    "group-limited choices",
    "routed weights: the chosen softmax scores times routed_scaling_factor (V2 scales only "
    "where norm_topk_prob is false)",
]
V3_NOTES = NOTES + [
    "no aux loss: DeepSeek-V3's code never reads aux_loss_alpha or seq_aux (aux_losses 0)",
    "routed weights: the chosen unbiased sigmoid scores, divided by their sum + 1e-20, "
    "times routed_scaling_factor (V3 always scales)",
    "buffers: e_score_correction_bias of each MoE layer: chooses experts only, never "
    "trained; not in grads0, unchanged in final.safetensors",
    "unused_tensors: the MTP layer model.layers.{num_hidden_layers}.* "
    "(num_nextn_predict_layers 1): in model.safetensors only; the model does not read them",
]


def make_fixture(name, config):
    torch.manual_seed(WEIGHT_SEED)
    model = DeepseekV2ForCausalLM(config)
    perturb(model, WEIGHT_SEED + 1)  # norms 1 + 0.1 N(0, 1), routers (mlp.gate.weight) 0.5 N(0, 1)
    buffers, unused = {}, {}
    notes = V2_NOTES
    if config["model_type"] == "deepseek_v3":
        with torch.no_grad():
            buffers = correction_biases(model, config, WEIGHT_SEED + 2)
            unused = mtp_tensors(model, config, WEIGHT_SEED + 3)
        notes = V3_NOTES
        check_bias_matters(model, config)
    extra = {"buffers": list(buffers), "unused_tensors": list(unused)}
    train_fixture(name, config, model, notes, buffers, unused, extra)


def check_bias_matters(model, config):
    """The correction bias must change some choices of the first micro-batch, else the fixture
    would not test it."""
    t = TRAINING
    n_tokens = t["steps"] * t["grad_accum"] * t["batch"] * t["seq_len"] + 1
    tokens = torch.randint(0, config["vocab_size"], (n_tokens,),
                           generator=torch.Generator().manual_seed(TOKEN_SEED))
    inputs, _ = micro_batch(tokens, 0, t["batch"], t["seq_len"])
    moes = model.moe_layers()
    biases = [m.gate.e_score_correction_bias.clone() for m in moes]
    chosen = {}
    with torch.no_grad():
        for biased in (True, False):
            for m, bias in zip(moes, biases):
                m.gate.e_score_correction_bias.copy_(bias if biased else torch.zeros_like(bias))
            model(inputs)
            chosen[biased] = torch.stack([m.last_chosen.sort(dim=-1).values for m in moes])
        for m, bias in zip(moes, biases):
            m.gate.e_score_correction_bias.copy_(bias)
    changed = (chosen[True] != chosen[False]).any(dim=-1).float().mean().item()
    print(f"the correction bias changes {changed:.0%} of the (token, layer) choices")
    assert changed > 0.1, changed


def main():
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    only = sys.argv[1:]  # fixture names, or every fixture
    for name, config in FIXTURES.items():
        if not only or name in only:
            make_fixture(name, config)


if __name__ == "__main__":
    main()
