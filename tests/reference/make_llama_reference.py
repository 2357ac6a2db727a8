#!/usr/bin/python3
"""LLaMA-family fixtures from Hugging Face transformers itself (LlamaForCausalLM,
Qwen2ForCausalLM), for dstrain's tests of the Llama / Qwen2 architecture, of loading Hugging
Face model directories and of training against the real thing:

  llama_tiny/  grouped-query attention (4 heads, 2 kv heads), untied head, no biases, saved as
               F32 in 3 shards with model.safetensors.index.json
  qwen2_tiny/  Qwen2 (q/k/v biases), tied head, saved as BF16 in one model.safetensors
  mixtral_tiny/ Mixtral: a mixture of 4 SwiGLU experts, top 2, in every layer; grouped-query
               attention, untied head; F32 in shards with an index
  qwen2_moe_tiny/ Qwen2-MoE: a dense first layer (mlp_only_layers [0]), then 4 experts, top 2,
               not renormalized, and a shared expert behind a sigmoid gate; q/k/v biases, tied
               head; F32 in one file
  mixtral_aux_tiny/, qwen2_moe_aux_tiny/ the two with the load-balancing loss
               (output_router_logits, router_aux_loss_coef 0.05): the training loss is the
               cross-entropy plus 0.05 x transformers' aux_loss

Each directory holds what `save_pretrained` wrote (config.json, the weights), and:

  train.bin            tokens in the llm.c format (256 int32 header, then uint16 tokens)
  grads0.safetensors   gradient of every parameter for micro-batch 0 alone (before training)
  final.safetensors    weights after `steps` AdamW steps (F32)
  expected.json        the training settings, the initial loss and the per-step losses,
                       pre-clip gradient norms and learning rates

The training loop is make_gpt2_reference.py's (the same data windows, clipping, schedule and
AdamW with decay on 2-D tensors), around the transformers model with eager attention in fp32.
The weights start from the model's own initialization plus noise (norm weights 1 + N(0, 0.1),
biases N(0, 0.02)) so that nothing is 0 or 1; a BF16 checkpoint's model trains from the
BF16-rounded weights, which is what dstrain reads.

Run from the repository root, with Debian's python3-torch and transformers 4.41:
  PYTHONPATH=<transformers> /usr/bin/python3 tests/reference/make_llama_reference.py [NAME ...]
dstrain never needs torch or transformers at run time: this script only makes fixtures.
"""
import json
import math
import os
import shutil
import sys

import torch

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_gpt2_reference import (adamw, cross_entropy, learning_rate, micro_batch,  # noqa: E402
                                 save_tensors, write_llmc_tokens)

import transformers  # noqa: E402

TRAINING = {
    "batch": 4,
    "seq_len": 16,
    "grad_accum": 2,
    "steps": 10,
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
COMMON = {
    "vocab_size": 97,  # odd on purpose
    "max_position_embeddings": 32,
    "hidden_size": 32,
    "intermediate_size": 56,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attn_implementation": "eager",
}
FIXTURES = {
    "llama_tiny": dict(kind="llama", dtype=torch.float32, shard="40KB",
                       config=dict(COMMON, tie_word_embeddings=False)),
    "qwen2_tiny": dict(kind="qwen2", dtype=torch.bfloat16, shard=None,
                       config=dict(COMMON, tie_word_embeddings=True, use_sliding_window=False)),
    "mixtral_tiny": dict(kind="mixtral", dtype=torch.float32, shard="100KB",
                         config=dict(COMMON, tie_word_embeddings=False, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=None)),
    "qwen2_moe_tiny": dict(kind="qwen2_moe", dtype=torch.float32, shard=None,
                           config=dict(COMMON, tie_word_embeddings=True, use_sliding_window=False,
                                       num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=24,
                                       shared_expert_intermediate_size=40, norm_topk_prob=False,
                                       decoder_sparse_step=1, mlp_only_layers=[0])),
}
# The load-balancing loss (output_router_logits): the training loss is the cross-entropy plus
# router_aux_loss_coef times the model's aux_loss, as transformers adds it with labels.
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.05)
FIXTURES["mixtral_aux_tiny"] = dict(FIXTURES["mixtral_tiny"],
                                    config=dict(FIXTURES["mixtral_tiny"]["config"], **AUX))
FIXTURES["qwen2_moe_aux_tiny"] = dict(FIXTURES["qwen2_moe_tiny"],
                                      config=dict(FIXTURES["qwen2_moe_tiny"]["config"], **AUX))
WEIGHT_SEED = 4321
TOKEN_SEED = 8765


def make_model(kind, config):
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**config))
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**config))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))


def perturb(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
            elif name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight")):
                # A router whose logits differ by more than rounding: the choices are the same
                # in any fp32 implementation.
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))


def save_checkpoint(model, out_dir, dtype, shard):
    """save_pretrained with the weights in `dtype`; the fp32 model then holds exactly the saved
    values. (Not model.to(dtype): that would also round the rotary buffers, inv_freq and the
    cos/sin caches, which stay fp32 in a model loaded from the checkpoint.)"""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))
    state = {name: tensor.to(dtype) for name, tensor in model.state_dict().items()}
    kwargs = {"safe_serialization": True, "state_dict": state}
    if shard:
        kwargs["max_shard_size"] = shard
    model.save_pretrained(out_dir, **kwargs)
    # save_pretrained records the parameters' dtype (fp32 here); say what the files hold.
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["torch_dtype"] = str(dtype).split(".")[1]
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def training_loss(model, inputs, targets):
    """The cross-entropy, plus the load-balancing loss where the config asks for it."""
    out = model(input_ids=inputs)
    loss = cross_entropy(out.logits, targets)
    if getattr(model.config, "output_router_logits", False):
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


def named(model):
    """Parameters by their checkpoint names (a tied head appears once, as the embedding)."""
    return dict(model.named_parameters())


def make_fixture(name, spec):
    t = TRAINING
    B, T, accum, steps = t["batch"], t["seq_len"], t["grad_accum"], t["steps"]
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    torch.manual_seed(WEIGHT_SEED)
    model = make_model(spec["kind"], spec["config"])
    perturb(model, WEIGHT_SEED + 1)
    save_checkpoint(model, out_dir, spec["dtype"], spec["shard"])
    model.train()
    params = named(model)
    names = list(params)
    V = spec["config"]["vocab_size"]
    n_tokens = steps * accum * B * T + 1
    tokens = torch.randint(0, V, (n_tokens,), generator=torch.Generator().manual_seed(TOKEN_SEED))
    write_llmc_tokens(os.path.join(out_dir, "train.bin"), tokens.tolist())

    inputs, targets = micro_batch(tokens, 0, B, T)
    initial_loss = training_loss(model, inputs, targets)
    initial_loss.backward()
    grads0 = {n: params[n].grad.clone() for n in names}
    for n in names:
        assert grads0[n].abs().max() > 0, f"gradient of {n} is zero"
        params[n].grad = None
    save_tensors(os.path.join(out_dir, "grads0.safetensors"), names, grads0,
                 "gradients of micro-batch 0 (loss not divided by grad_accum)")

    optimizer = adamw(params, names, t)
    losses, grad_norms, lrs = [], [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for micro in range(accum):
            inputs, targets = micro_batch(tokens, step * accum + micro, B, T)
            loss = training_loss(model, inputs, targets)
            (loss / accum).backward()
            step_loss += loss.item() / accum
        grad_norm = torch.nn.utils.clip_grad_norm_([params[n] for n in names], t["grad_clip"])
        lr = learning_rate(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        losses.append(step_loss)
        grad_norms.append(grad_norm.item())
        lrs.append(lr)
        print(f"{name} step {step}: loss {step_loss:.6f} grad_norm {grad_norm.item():.6f}")
    save_tensors(os.path.join(out_dir, "final.safetensors"), names,
                 {n: params[n].detach() for n in names}, f"weights after {steps} steps")

    expected = dict(t)
    expected.update({
        "initial_loss": initial_loss.item(),
        "losses": losses,
        "grad_norms": grad_norms,
        "lrs": lrs,
        "weight_seed": WEIGHT_SEED,
        "token_seed": TOKEN_SEED,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "notes": ["the training loop of make_gpt2_reference.py (see tests/reference/README.md)",
                  "weight decay applies to 2-D tensors only (the embedding, the head and every "
                  "projection matrix), not to biases and RMSNorm weights"],
    })
    with open(os.path.join(out_dir, "expected.json"), "w") as out:
        json.dump(expected, out, indent=2)
        out.write("\n")
    assert abs(initial_loss.item() - math.log(V)) < 0.5, initial_loss.item()
    assert all(math.isfinite(x) for x in losses + grad_norms)


def main():
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    only = sys.argv[1:]  # fixture names, or every fixture
    for name, spec in FIXTURES.items():
        if not only or name in only:
            make_fixture(name, spec)


if __name__ == "__main__":
    main()
