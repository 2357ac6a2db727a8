#!/usr/bin/python3
"""An independent GPT-2 reference in plain PyTorch (no `transformers`), written from the math,
that produces the committed fixture tests/reference/gpt2_tiny/:

  config.json           Hugging Face GPT-2 config of the tiny model
  model.safetensors     initial weights, Hugging Face GPT-2 names without prefix, F32
  train.bin             tokens in the llm.c format (256 int32 header, then uint16 tokens)
  grads0.safetensors    gradient of every parameter for micro-batch 0 alone (before training)
  logits0.safetensors   "logits" (B, T, V) of micro-batch 0 with the initial weights
  final.safetensors     weights after `steps` AdamW steps
  expected.json         the training settings, the initial loss and the per-step losses,
                        pre-clip gradient norms and learning rates

Run from the repository root:  /usr/bin/python3 tests/reference/make_gpt2_reference.py
dstrain never needs torch at run time: this script only produces the fixture.
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402

CONFIG = {
    "model_type": "gpt2",
    "vocab_size": 97,  # odd on purpose: no kernel may assume a round vocabulary
    "n_positions": 32,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new",
}
TRAINING = {
    "batch": 4,
    "seq_len": 16,
    "grad_accum": 2,
    "steps": 8,
    "lr": 1e-3,
    "min_lr": 1e-4,
    "warmup": 2,
    "lr_schedule": "cosine",
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "grad_clip": 1.0,
}
WEIGHT_SEED = 1234
TOKEN_SEED = 5678
LLMC_MAGIC = 20240520
LLMC_VERSION = 1  # uint16 tokens


def adamw(params, names, t):
    """torch's AdamW over params (name -> tensor) in `names` order: weight decay t["weight_decay"]
    on the 2-D tensors (embeddings and matrices), none on biases and norms; every fixture's."""
    decay = [params[n] for n in names if params[n].dim() == 2]
    no_decay = [params[n] for n in names if params[n].dim() != 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"], foreach=False)

def parameter_specs(config):
    """(name, shape, init kind) in the Hugging Face order; the generator draws in this order."""
    C, V, L = config["n_embd"], config["vocab_size"], config["n_layer"]
    specs = [("wte.weight", (V, C), "embedding"),
             ("wpe.weight", (config["n_positions"], C), "embedding")]
    for i in range(L):
        h = f"h.{i}."
        specs += [
            (h + "ln_1.weight", (C,), "ln_weight"),
            (h + "ln_1.bias", (C,), "ln_bias"),
            (h + "attn.c_attn.weight", (C, 3 * C), "matrix"),   # Conv1D: y = x @ W + b
            (h + "attn.c_attn.bias", (3 * C,), "bias"),
            (h + "attn.c_proj.weight", (C, C), "residual_matrix"),
            (h + "attn.c_proj.bias", (C,), "bias"),
            (h + "ln_2.weight", (C,), "ln_weight"),
            (h + "ln_2.bias", (C,), "ln_bias"),
            (h + "mlp.c_fc.weight", (C, 4 * C), "matrix"),
            (h + "mlp.c_fc.bias", (4 * C,), "bias"),
            (h + "mlp.c_proj.weight", (4 * C, C), "residual_matrix"),
            (h + "mlp.c_proj.bias", (C,), "bias"),
        ]
    specs += [("ln_f.weight", (C,), "ln_weight"), ("ln_f.bias", (C,), "ln_bias")]
    return specs


def init_parameters(config, seed):
    """Random weights; biases and LayerNorm parameters are not 0/1 so their gradients and
    updates are exercised."""
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * config["n_layer"])
    stds = {"embedding": 0.02, "matrix": 0.02, "residual_matrix": residual_std, "bias": 0.01,
            "ln_weight": 0.1, "ln_bias": 0.01}
    params = {}
    for name, shape, kind in parameter_specs(config):
        value = torch.randn(shape, generator=generator, dtype=torch.float32) * stds[kind]
        if kind == "ln_weight":
            value = value + 1.0
        params[name] = value.requires_grad_(True)
    return params


def layer_norm(x, weight, bias, eps):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased variance, as GPT-2
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def forward(config, p, inputs):
    """inputs (B, T) int64 -> logits (B, T, V)."""
    B, T = inputs.shape
    C, NH = config["n_embd"], config["n_head"]
    hd = C // NH
    eps = config["layer_norm_epsilon"]
    x = p["wte.weight"][inputs] + p["wpe.weight"][:T]  # (B, T, C)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(config["n_layer"]):
        h = f"h.{i}."
        a = layer_norm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"], eps)
        qkv = a @ p[h + "attn.c_attn.weight"] + p[h + "attn.c_attn.bias"]  # (B, T, 3C)
        q, k, v = qkv.split(C, dim=-1)
        q = q.reshape(B, T, NH, hd).transpose(1, 2)  # (B, NH, T, hd)
        k = k.reshape(B, T, NH, hd).transpose(1, 2)
        v = v.reshape(B, T, NH, hd).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # (B, NH, T, T)
        scores = scores.masked_fill(~causal, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v  # (B, NH, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[h + "attn.c_proj.weight"] + p[h + "attn.c_proj.bias"]
        m = layer_norm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"], eps)
        m = gelu_tanh(m @ p[h + "mlp.c_fc.weight"] + p[h + "mlp.c_fc.bias"])  # (B, T, 4C)
        x = x + m @ p[h + "mlp.c_proj.weight"] + p[h + "mlp.c_proj.bias"]
    x = layer_norm(x, p["ln_f.weight"], p["ln_f.bias"], eps)
    return x @ p["wte.weight"].t()  # tied head: (B, T, V)


def cross_entropy(logits, targets):
    """Mean over all B*T positions of -log softmax(logits)[target]."""
    log_probs = torch.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
    return -log_probs.gather(1, targets.reshape(-1, 1)).mean()


def micro_batch(tokens, window, B, T):
    """Window g covers tokens[g*B*T : g*B*T + B*T + 1]; targets are the inputs shifted by one."""
    chunk = tokens[window * B * T : window * B * T + B * T + 1]
    return chunk[:-1].reshape(B, T), chunk[1:].reshape(B, T)


def learning_rate(step, t):
    if step < t["warmup"]:
        return t["lr"] * (step + 1) / t["warmup"]
    progress = (step - t["warmup"]) / max(1, t["steps"] - t["warmup"])
    return t["min_lr"] + 0.5 * (t["lr"] - t["min_lr"]) * (1.0 + math.cos(math.pi * progress))


def write_llmc_tokens(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = LLMC_MAGIC, LLMC_VERSION, len(tokens)
    with open(path, "wb") as out:
        out.write(header.tobytes())
        out.write(np.asarray(tokens, dtype="<u2").tobytes())


def save_tensors(path, names, values, description):
    write_safetensors(path, [(name, values[name].detach().clone()) for name in names],
                      metadata={"format": "pt", "description": description})
    back = read_safetensors(path)
    for name in names:
        assert torch.equal(back[name], values[name].detach()), f"{path}: {name} differs"


def main():
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_tiny")
    os.makedirs(out_dir, exist_ok=True)
    config, t = CONFIG, TRAINING
    B, T, accum, steps = t["batch"], t["seq_len"], t["grad_accum"], t["steps"]
    V = config["vocab_size"]

    params = init_parameters(config, WEIGHT_SEED)
    names = [name for name, _, _ in parameter_specs(config)]
    n_tokens = steps * accum * B * T + 1
    tokens = torch.randint(0, V, (n_tokens,), generator=torch.Generator().manual_seed(TOKEN_SEED))

    with open(os.path.join(out_dir, "config.json"), "w") as out:
        json.dump(config, out, indent=2)
        out.write("\n")
    save_tensors(os.path.join(out_dir, "model.safetensors"), names, params, "initial weights")
    write_llmc_tokens(os.path.join(out_dir, "train.bin"), tokens.tolist())

    # Micro-batch 0 alone with the initial weights: logits, loss, every gradient.
    inputs, targets = micro_batch(tokens, 0, B, T)
    logits = forward(config, params, inputs)
    initial_loss = cross_entropy(logits, targets)
    initial_loss.backward()
    grads0 = {name: params[name].grad.clone() for name in names}
    for name in names:
        assert torch.isfinite(grads0[name]).all(), name
        assert grads0[name].abs().max() > 0, f"gradient of {name} is zero"
        params[name].grad = None
    save_tensors(os.path.join(out_dir, "grads0.safetensors"), names, grads0,
                 "gradients of micro-batch 0 (loss not divided by grad_accum)")
    save_tensors(os.path.join(out_dir, "logits0.safetensors"), ["logits"],
                 {"logits": logits.detach()}, "logits (B, T, V) of micro-batch 0")

    optimizer = adamw(params, names, t)
    all_params = [params[n] for n in names]

    losses, micro_losses, grad_norms, lrs = [], [], [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_micro_losses = []
        for micro in range(accum):
            inputs, targets = micro_batch(tokens, step * accum + micro, B, T)
            loss = cross_entropy(forward(config, params, inputs), targets)
            (loss / accum).backward()
            step_micro_losses.append(loss.item())
        grad_norm = torch.nn.utils.clip_grad_norm_(all_params, t["grad_clip"])
        lr = learning_rate(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        losses.append(sum(step_micro_losses) / accum)
        micro_losses.append(step_micro_losses)
        grad_norms.append(grad_norm.item())
        lrs.append(lr)
        print(f"step {step}: loss {losses[-1]:.6f} grad_norm {grad_norms[-1]:.6f} lr {lr:.3e}")

    save_tensors(os.path.join(out_dir, "final.safetensors"), names,
                 {n: params[n].detach() for n in names}, f"weights after {steps} steps")

    expected = dict(t)
    expected.update({
        "initial_loss": initial_loss.item(),
        "losses": losses,
        "micro_losses": micro_losses,
        "grad_norms": grad_norms,
        "lrs": lrs,
        "weight_seed": WEIGHT_SEED,
        "token_seed": TOKEN_SEED,
        "n_tokens": n_tokens,
        "torch_version": torch.__version__,
        "notes": [
            "micro-batch g = step * grad_accum + micro reads train.bin tokens "
            "[g*B*T, g*B*T + B*T + 1): inputs are the first B*T as (B, T), targets the next "
            "B*T (shifted by one)",
            "losses[s] is the mean of the grad_accum micro-batch losses; each micro-batch "
            "backward uses loss / grad_accum",
            "grad_norms[s] is the global L2 norm before clipping; gradients are then multiplied "
            "by min(1, grad_clip / (grad_norms[s] + 1e-6)) as torch.nn.utils.clip_grad_norm_ does",
            "AdamW as torch.optim.AdamW: p *= 1 - lr*wd; m, v updated; "
            "p -= lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)",
            "weight decay applies to 2-D tensors only (wte, wpe, c_attn, c_proj, c_fc weights)",
            "lrs[s] = lr*(s+1)/warmup for s < warmup, else min_lr + 0.5*(lr-min_lr)*"
            "(1+cos(pi*(s-warmup)/max(1, steps-warmup)))",
        ],
    })
    with open(os.path.join(out_dir, "expected.json"), "w") as out:
        json.dump(expected, out, indent=2)
        out.write("\n")

    # Sanity: a near-uniform start, finite gradients, a moving loss.
    assert abs(initial_loss.item() - math.log(V)) < 0.1, initial_loss.item()
    assert all(math.isfinite(x) for x in losses + grad_norms)
    assert losses[-1] != losses[0]
    print(f"initial loss {initial_loss.item():.6f} (ln V = {math.log(V):.6f})")
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"wrote {out_dir} ({total} bytes)")


if __name__ == "__main__":
    main()
