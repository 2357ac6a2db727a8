#!/usr/bin/python3
"""DeepSeekMoE fixtures (Hugging Face model_type "deepseek", the model of
deepseek-ai/deepseek-moe-16b-base), from an independent PyTorch implementation written here,
for dstrain's tests of the DeepSeekMoE architecture and of its load-balancing loss:

  deepseek_moe_tiny/     3 layers: layer 0 a dense SwiGLU MLP (first_k_dense_replace 1), layers
                         1-2 DeepSeekMoE: 4 routed experts, top 2, not renormalized, plus a
                         shared expert of 2 x moe_intermediate_size; untied head; F32, one file;
                         aux_loss_alpha 0 (no load-balancing loss)
  deepseek_moe_aux_tiny/ the same with aux_loss_alpha 0.05, seq_aux true

transformers 4.41 has no DeepSeekMoE (its modeling_deepseek.py ships with the checkpoint on
the Hugging Face hub, trust_remote_code), so the model is written here from the facts of
DeepSeek's modeling_deepseek.py / configuration_deepseek.py:

  * DeepseekRMSNorm: w * x * rsqrt(mean(x^2) + rms_norm_eps), variance in fp32; llama rotary
    embedding (rotate_half, inv_freq = 1 / rope_theta^(2i/head_dim), no scaling);
    DeepseekAttention = LlamaAttention (q/k/v/o_proj, no bias, grouped-query repeat_kv, softmax
    in fp32); pre-norm blocks x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x));
    final model.norm, untied lm_head; the returned loss is the cross-entropy only.
  * DeepseekMLP: down_proj(silu(gate_proj(x)) * up_proj(x)).
  * Layer i is DeepseekMoE if n_routed_experts is set and i >= first_k_dense_replace and
    i % moe_layer_freq == 0, else a DeepseekMLP of intermediate_size.
  * DeepseekMoE: MoEGate `gate.weight` (n_routed_experts, hidden): scores = softmax(x W^T)
    (scoring_func "softmax"), top num_experts_per_tok; the weights are the top-k scores, divided
    by (their sum + 1e-20) only if norm_topk_prob (and k > 1); y = sum_k w_k expert_k(x) with
    experts DeepseekMLPs of moe_intermediate_size; plus `shared_experts`, ONE DeepseekMLP of
    n_shared_experts * moe_intermediate_size added with no gate.
  * MoEGate's auxiliary loss, computed only when training and aux_loss_alpha > 0 from the
    scores and the chosen experts (the choices are constants):
      seq_aux:  ce[b, e] = #(token, choice) of sequence b choosing e / (seq_len * k / E);
                aux = alpha * mean_b sum_e ce[b, e] * mean_t scores[b, t, e]
      else:     fi = E * one_hot(choices).float().mean(0); Pi = scores.mean(0);
                aux = alpha * sum_e Pi_e fi_e
  * AddAuxiliaryLoss: the MoE output passes through an autograd function whose forward returns
    it unchanged and whose backward passes the output's gradient through and gives aux a
    gradient of exactly 1. So the aux loss is never part of the reported loss, and every MoE
    layer's aux gradient enters with weight 1 per forward/backward: not scaled by the outer
    loss, so with gradient accumulation (loss / grad_accum).backward() it is NOT divided by
    grad_accum, and grads0 (micro-batch 0, loss not divided) holds the CE gradient plus the aux
    gradient with weight 1.
  * DeepseekPreTrainedModel._init_weights: nn.Linear and nn.Embedding weights normal(0,
    initializer_range), RMSNorm weights 1, MoEGate's weight left at its kaiming_uniform(a=sqrt(5))
    (MoEGate.reset_parameters). The modules here are built in DeepSeek's order from the same
    torch modules, so with the same seed the initial weights are those of DeepSeek's own
    DeepseekForCausalLM(config), bit for bit; then the perturbation of make_llama_reference.py.
  * Parameter names: model.embed_tokens.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight,
    model.layers.N.mlp.{gate,up,down}_proj.weight (dense), model.layers.N.mlp.gate.weight,
    model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight,
    model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight,
    model.layers.N.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight.

With aux_loss_alpha 0 MoEGate computes no aux loss (None), and DeepSeek's own DeepseekMoE then
fails in training mode (AddAuxiliaryLoss.apply(y, None) raises on None.numel()); here, as
DeepSeek evidently means, alpha 0 is simply no load-balancing loss.

When these fixtures were made, DeepSeek's modeling_deepseek.py itself (under transformers
4.41, with a DeepseekConfig carrying the fixture's config.json) gave, with the same seed, the
same initial weights bit for bit; from model.safetensors the same logits (eval and training),
initial loss and aux loss; every gradient of micro-batch 0 within 4e-7 (relative to the
tensor's largest); and over the 10 steps the same losses, aux_losses and grad norms within
2e-7 and final weights within 3e-6 (for alpha 0 with AddAuxiliaryLoss.apply(y, None) -> y).

Each directory holds config.json (DeepSeek's fields), model.safetensors (F32, one file) and, as
make_llama_reference.py's fixtures:

  train.bin            tokens in the llm.c format (256 int32 header, then uint16 tokens)
  grads0.safetensors   gradient of every parameter for micro-batch 0 alone (before training),
                       cross-entropy not divided by grad_accum, plus the aux gradient (weight 1)
  final.safetensors    weights after `steps` AdamW steps (F32)
  expected.json        the training settings, the initial loss and the per-step losses (the
                       cross-entropy only), pre-clip gradient norms, learning rates and
                       aux_losses (per step, the sum over MoE layers, mean over micro-batches)

The training loop, data, seeds, settings and perturbation are make_llama_reference.py's (its
TRAINING, WEIGHT_SEED, TOKEN_SEED and perturb(); make_gpt2_reference.py's data windows,
cross-entropy, schedule and llm.c writer; the AdamW with decay on 2-D tensors).

Run from the repository root, with Debian's python3-torch (torch 1.13) and transformers 4.41
(only because make_llama_reference.py imports it; the model here does not use it):
  /usr/bin/python3 tests/reference/make_deepseek_reference.py [NAME ...]
dstrain never needs torch at run time: this script only makes fixtures.
"""
import json
import math
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_gpt2_reference import (adamw, cross_entropy, learning_rate, micro_batch,  # noqa: E402
                                 save_tensors, write_llmc_tokens)
from make_llama_reference import TOKEN_SEED, TRAINING, WEIGHT_SEED, perturb  # noqa: E402

# DeepSeek's config.json fields (configuration_deepseek.py's DeepseekConfig).
CONFIG = {
    "architectures": ["DeepseekForCausalLM"],
    "model_type": "deepseek",
    "vocab_size": 97,  # odd on purpose
    "hidden_size": 32,
    "intermediate_size": 56,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "aux_loss_alpha": 0.0,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 32,
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
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FIXTURES = {
    "deepseek_moe_tiny": dict(CONFIG, aux_loss_alpha=0.0, seq_aux=True),
    "deepseek_moe_aux_tiny": dict(CONFIG, aux_loss_alpha=0.05, seq_aux=True),
}


# ----------------------------------------------------------------------------- the model

class RMSNorm(nn.Module):
    """DeepseekRMSNorm (llama's): the variance in fp32, then the weight."""

    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(T, head_dim, theta):
    """cos, sin (T, head_dim) of llama's rotary embedding (halves, not interleaved pairs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """DeepseekAttention: causal multi-head attention with rotary q/k, grouped-query k/v."""

    def __init__(self, c):
        super().__init__()
        assert c["rope_scaling"] is None
        C, H, KV = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.H, self.KV, self.hd, self.theta = H, KV, C // H, c["rope_theta"]
        bias = c["attention_bias"]
        self.q_proj = nn.Linear(C, H * self.hd, bias=bias)
        self.k_proj = nn.Linear(C, KV * self.hd, bias=bias)
        self.v_proj = nn.Linear(C, KV * self.hd, bias=bias)
        self.o_proj = nn.Linear(H * self.hd, C, bias=bias)

    def forward(self, x):
        B, T, _ = x.shape
        H, KV, hd = self.H, self.KV, self.hd
        q = self.q_proj(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, KV, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KV, hd).transpose(1, 2)
        cos, sin = rotary(T, hd, self.theta)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Grouped-query: query head h reads key/value head h // (H / KV) (repeat_kv).
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        scores = (q @ k.transpose(2, 3)) / math.sqrt(hd)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))


class MLP(nn.Module):
    """DeepseekMLP: SwiGLU, down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden, width):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AddAuxiliaryLoss(torch.autograd.Function):
    """DeepSeek's way of training the aux loss: forward is the identity on x; backward passes
    x's gradient through and gives `aux` the gradient 1, whatever scales the outer loss."""

    @staticmethod
    def forward(ctx, x, aux):
        return x.clone()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, torch.ones((), dtype=grad_output.dtype)


class Gate(nn.Module):
    """MoEGate's parameter: `weight` (n_routed_experts, hidden), kaiming_uniform(a=sqrt(5)) as
    MoEGate.reset_parameters (DeepSeek's _init_weights does not touch it)."""

    def __init__(self, experts, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))


class MoE(nn.Module):
    """DeepseekMoE: top-k of E routed experts, softmax router, plus the shared experts."""

    def __init__(self, c):
        super().__init__()
        C, E = c["hidden_size"], c["n_routed_experts"]
        self.E, self.k = E, c["num_experts_per_tok"]
        self.norm_topk_prob, self.alpha, self.seq_aux = (
            c["norm_topk_prob"], c["aux_loss_alpha"], c["seq_aux"])
        self.scoring_func = c["scoring_func"]
        # DeepSeek's order (and so named_parameters' order): experts, gate, shared_experts.
        self.experts = nn.ModuleList(MLP(C, c["moe_intermediate_size"]) for _ in range(E))
        self.gate = Gate(E, C)
        self.shared_experts = MLP(C, c["n_shared_experts"] * c["moe_intermediate_size"])
        self.aux = None  # this forward's aux loss (a tensor) where it was computed
        self.last_logits = None  # this forward's router logits (N, E), for topk_margin

    def margin(self):
        """The smallest gap, over the last forward's tokens, between the k-th and the (k+1)-th
        router logit (the log of the ratio of their scores): where it is far above fp32
        rounding, the choices are the same in any fp32 implementation."""
        top = torch.topk(self.last_logits, self.k + 1, dim=-1).values
        return (top[:, self.k - 1] - top[:, self.k]).min().item()

    def aux_loss(self, scores, chosen, B, T):
        E, k = self.E, self.k
        if self.seq_aux:
            # Per sequence: how often each expert was chosen, relative to the uniform T*k/E,
            # times its mean score over the sequence; summed over experts, mean over sequences.
            counts = torch.zeros(B, E).scatter_add_(1, chosen.view(B, T * k), torch.ones(B, T * k))
            ce = counts / (T * k / E)
            return (ce * scores.view(B, T, E).mean(dim=1)).sum(dim=1).mean() * self.alpha
        fi = F.one_hot(chosen.view(-1), num_classes=E).float().mean(0) * E
        Pi = scores.mean(0)
        return (Pi * fi).sum() * self.alpha

    def route(self, flat):
        """MoEGate: scores (N, E), the weights (N, k) and experts (N, k) chosen for the tokens
        flat (N, hidden)."""
        assert self.scoring_func == "softmax"
        logits = flat @ self.gate.weight.t()  # (N, E)
        scores = torch.softmax(logits, dim=-1)
        weights, chosen = torch.topk(scores, self.k, dim=-1)  # (N, k)
        if self.k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        self.last_logits = logits.detach()
        return scores, weights, chosen

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        scores, weights, chosen = self.route(flat)
        # Each (token, slot) runs its expert; the k results are weighted and summed.
        routed = flat.new_zeros(B * T, self.k, C)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                routed = routed.index_put((token, slot), expert(flat[token]))
        y = (routed * weights.unsqueeze(-1)).sum(dim=1).view(B, T, C)
        self.aux = None
        if self.training and self.alpha > 0.0:
            self.aux = self.aux_loss(scores, chosen, B, T)
            y = AddAuxiliaryLoss.apply(y, self.aux)
        return y + self.shared_experts(x)


class DecoderLayer(nn.Module):
    """A pre-norm block; `attention` and `moe` are the classes of its attention and MoE (the
    DeepSeek-V2/V3 fixtures give theirs)."""

    def __init__(self, c, layer_idx, attention=Attention, moe=MoE):
        super().__init__()
        self.self_attn = attention(c)
        is_moe = (c["n_routed_experts"] is not None and layer_idx >= c["first_k_dense_replace"]
                  and layer_idx % c["moe_layer_freq"] == 0)
        self.mlp = moe(c) if is_moe else MLP(c["hidden_size"], c["intermediate_size"])
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def init_weights(module, std):
    """DeepseekPreTrainedModel._init_weights (module.apply order: children first)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.data.normal_(mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            module.bias.data.zero_()


class Body(nn.Module):
    """DeepseekModel: embed_tokens, layers, norm."""

    def __init__(self, c, attention=Attention, moe=MoE):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c, i, attention, moe)
                                    for i in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, inputs):
        x = self.embed_tokens(inputs)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, c, attention=Attention, moe=MoE):
        super().__init__()
        assert not c["tie_word_embeddings"]
        assert c["hidden_act"] == "silu" and c["pretraining_tp"] == 1
        # Built and initialized in DeepSeek's order: its DeepseekModel runs post_init (and so
        # _init_weights on all its modules) before DeepseekForCausalLM creates lm_head.
        self.model = Body(c, attention, moe)
        self.model.apply(lambda m: init_weights(m, c["initializer_range"]))
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        init_weights(self.lm_head, c["initializer_range"])

    def forward(self, inputs):
        """logits (B, T, V) and the list of this forward's aux losses (one per MoE layer,
        empty where none is computed)."""
        logits = self.lm_head(self.model(inputs)).float()
        return logits, [m.aux for m in self.moe_layers() if m.aux is not None]

    def moe_layers(self):
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]


# ----------------------------------------------------------------------------- fixtures

def topk_margin(model):
    """The smallest routing margin (MoE.margin) over the MoE layers of the last forward."""
    return min((moe.margin() for moe in model.moe_layers()), default=math.inf)


def training_loss(model, inputs, targets):
    """The cross-entropy (what DeepSeek's model returns as its loss) and the sum of the MoE
    layers' aux losses, which only enter the gradient (AddAuxiliaryLoss)."""
    logits, aux = model(inputs)
    return cross_entropy(logits, targets), sum((a.item() for a in aux), 0.0)


def write_config(config, out_dir):
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


NOTES = [
    "the training loop of make_gpt2_reference.py (see tests/reference/README.md)",
    "weight decay applies to 2-D tensors only (the embedding, the head, every "
    "projection matrix and the routers), not to RMSNorm weights",
    "losses and initial_loss are the cross-entropy only: DeepSeek's aux loss enters the "
    "gradient only (AddAuxiliaryLoss: identity forward, gradient 1 for aux in backward), "
    "never the loss",
    "each MoE layer's aux gradient enters with weight 1 per micro-batch forward/backward, "
    "not divided by grad_accum (the cross-entropy's backward is of loss / grad_accum); "
    "grads0 is the cross-entropy's gradient (not divided) plus the aux gradients",
    "aux_losses[s]: the sum over MoE layers of aux (alpha included), mean over the "
    "step's micro-batches; 0 where aux_loss_alpha is 0 (MoEGate computes none); "
    "initial_aux_loss: the same for micro-batch 0 with the initial weights",
    "aux with seq_aux: alpha * mean_b sum_e (count_{b,e} / (seq_len * k / E)) * "
    "mean_t scores[b, t, e], count_{b,e} the (token, choice) pairs of sequence b that "
    "chose e",
    "min_topk_margin: the smallest gap between the k-th and (k+1)-th router logit over "
    "all tokens, MoE layers and forwards (the routing is not a near tie)",
]


def make_fixture(name, config):
    torch.manual_seed(WEIGHT_SEED)
    model = DeepseekForCausalLM(config)
    perturb(model, WEIGHT_SEED + 1)  # norms 1 + 0.1 N(0, 1), routers (mlp.gate.weight) 0.5 N(0, 1)
    train_fixture(name, config, model, NOTES)


def train_fixture(name, config, model, notes, buffers=None, unused=None, extra_expected=None,
                  margin_floor=1e-5):
    """Writes the fixture directory `name` (emptied first) of `model`, built and perturbed:
    config.json, model.safetensors (the parameters, then `buffers`, then `unused`), train.bin,
    grads0.safetensors (the parameters' gradients of micro-batch 0), final.safetensors (the
    parameters after the TRAINING steps, then `buffers`) and expected.json (TRAINING, the
    results, then `extra_expected`, then `notes`).

    buffers: name -> tensor of the model that the training reads but does not change; unused:
    name -> tensor that the model does not read (the checkpoint's tensors a loader skips)."""
    buffers, unused, extra_expected = buffers or {}, unused or {}, extra_expected or {}
    t = TRAINING
    B, T, accum, steps = t["batch"], t["seq_len"], t["grad_accum"], t["steps"]
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    params = dict(model.named_parameters())
    names = list(params)
    write_config(config, out_dir)
    save_tensors(os.path.join(out_dir, "model.safetensors"), names + list(buffers) + list(unused),
                 dict(params, **buffers, **unused), "initial weights")
    model.train()
    V = config["vocab_size"]
    n_tokens = steps * accum * B * T + 1
    tokens = torch.randint(0, V, (n_tokens,), generator=torch.Generator().manual_seed(TOKEN_SEED))
    write_llmc_tokens(os.path.join(out_dir, "train.bin"), tokens.tolist())

    # Micro-batch 0 alone: the cross-entropy's gradient plus each aux loss's with weight 1.
    inputs, targets = micro_batch(tokens, 0, B, T)
    initial_loss, initial_aux = training_loss(model, inputs, targets)
    initial_loss.backward()
    margin = topk_margin(model)
    grads0 = {n: params[n].grad.clone() for n in names}
    for n in names:
        assert torch.isfinite(grads0[n]).all(), n
        assert grads0[n].abs().max() > 0, f"gradient of {n} is zero"
        params[n].grad = None
    save_tensors(os.path.join(out_dir, "grads0.safetensors"), names, grads0,
                 "gradients of micro-batch 0 (cross-entropy not divided by grad_accum, plus "
                 "each MoE layer's aux loss with gradient 1)")

    optimizer = adamw(params, names, t)
    losses, aux_losses, grad_norms, lrs = [], [], [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss, step_aux = 0.0, 0.0
        for micro in range(accum):
            inputs, targets = micro_batch(tokens, step * accum + micro, B, T)
            loss, aux = training_loss(model, inputs, targets)
            # The aux gradients come in with weight 1 whatever divides the loss.
            (loss / accum).backward()
            margin = min(margin, topk_margin(model))
            step_loss += loss.item() / accum
            step_aux += aux / accum
        grad_norm = torch.nn.utils.clip_grad_norm_([params[n] for n in names], t["grad_clip"])
        lr = learning_rate(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        losses.append(step_loss)
        aux_losses.append(step_aux)
        grad_norms.append(grad_norm.item())
        lrs.append(lr)
        print(f"{name} step {step}: loss {step_loss:.6f} aux {step_aux:.6f} "
              f"grad_norm {grad_norm.item():.6f}")
    save_tensors(os.path.join(out_dir, "final.safetensors"), names + list(buffers),
                 dict({n: params[n].detach() for n in names}, **buffers),
                 f"weights after {steps} steps")

    expected = dict(t)
    expected.update({
        "initial_loss": initial_loss.item(),
        "initial_aux_loss": initial_aux,
        "losses": losses,
        "aux_losses": aux_losses,
        "grad_norms": grad_norms,
        "lrs": lrs,
        "min_topk_margin": margin,
        "weight_seed": WEIGHT_SEED,
        "token_seed": TOKEN_SEED,
        "torch_version": torch.__version__,
    })
    expected.update(extra_expected)
    expected["notes"] = notes
    with open(os.path.join(out_dir, "expected.json"), "w") as out:
        json.dump(expected, out, indent=2)
        out.write("\n")
    assert abs(initial_loss.item() - math.log(V)) < 0.5, initial_loss.item()
    assert all(math.isfinite(x) for x in losses + grad_norms + aux_losses)
    assert margin > margin_floor, margin
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"wrote {out_dir} ({total} bytes), min top-k margin {margin:.3g}")


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
