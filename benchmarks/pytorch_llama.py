#!/usr/bin/env python3
"""The LLaMA family's training step in PyTorch, with transformers' own model: the baseline of
issue 34 for dstrain's bench_train on the same config (Llama, Qwen2, DeepSeek-LLM).

The model is transformers' AutoModelForCausalLM built from dstrain's preset (configs/models/,
the Hugging Face config.json of the model) or from a config.json path, attention through
PyTorch's scaled_dot_product_attention (attn_implementation "sdpa"), transformers' own
initialization. The step is the one of pytorch_gpt2.py (dstrain's defaults: AdamW 0.9/0.95,
weight decay 0.1 on matrices and embeddings, clipping at 1.0, LR warmup then cosine; fp32
parameters with torch.autocast to bf16/fp16; fused AdamW on a GPU; one batch of random tokens
reused): the loss is the cross-entropy of the fp32 logits, as dstrain's. With --compile-scope
blocks, each decoder layer and the head (final norm, LM head, loss) are torch.compile'd on their
own (regional compilation); with model, the whole model is one graph.

Model FLOPs as dstrain's planner counts them (src/parallel/model_flops.h): per token
3 x (L x (2 C (q + 2 kv) + 2 C q + 3 x 2 C I + 4 T q) + 2 C Vp), q the query width (heads x
head dim), kv the key/value width, I the MLP width, Vp the vocabulary padded to 64.

  pytorch_llama.py [--model qwen2.5-0.5b] [--device cuda|cpu] [--dtype fp32|fp16|bf16[,...]]
                   [--batch B] [--seq-len T] [--steps N] [--warmup N] [--mode eager|compile|both]
                   [--compile-scope model|blocks] [--peak-tflops X] [--json FILE]

Needs torch and transformers (any version with the config's model_type); the rows it writes
are summarized by `pytorch_gpt2.py summarize`.
"""
import json
import os
import sys

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_gpt2  # noqa: E402  (the step, the timing and the rows)

FAMILY_TYPES = ("llama", "qwen2")


def fail(message):
    print(f"pytorch_llama: {message}", file=sys.stderr)
    sys.exit(2)


def load_config(name):
    """A preset of configs/models/ or a config.json path: the Hugging Face config, plus the
    fields the benchmark reads."""
    models = os.path.join(pytorch_gpt2.REPO, "configs", "models")
    path = name if os.path.isfile(name) else os.path.join(models, name + ".json")
    if not os.path.isfile(path):
        presets = sorted(f[:-5] for f in os.listdir(models) if f.endswith(".json"))
        fail(f"unknown model '{name}': give a preset ({', '.join(presets)}) or a config.json path")
    with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type") not in FAMILY_TYPES:
        fail(f"{path} has model_type '{hf.get('model_type')}'; this benchmark times "
             f"{' and '.join(FAMILY_TYPES)} (pytorch_gpt2.py times gpt2)")
    C, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or C // heads
    config = {"hf": hf, "name": os.path.basename(path)[:-5] if path.endswith(".json") else name,
              "n_positions": hf.get("max_position_embeddings", 2048), "C": C,
              "L": hf["num_hidden_layers"], "I": hf["intermediate_size"],
              "q": heads * head_dim,
              "kv": hf.get("num_key_value_heads", heads) * head_dim,
              "vocab_size": hf["vocab_size"],
              "padded_vocab": (hf["vocab_size"] + 63) // 64 * 64,
              "tied": hf.get("tie_word_embeddings", False),
              # Qwen2 has q/k/v biases; Llama's attention_bias / mlp_bias say where it has them.
              "qkv_bias": hf["model_type"] == "qwen2" or hf.get("attention_bias", False),
              "o_bias": hf.get("attention_bias", False), "mlp_bias": hf.get("mlp_bias", False)}
    return config


def num_parameters(config):
    """As Hugging Face counts them (the real vocabulary; a tied head counted once)."""
    C, I, q, kv, V = config["C"], config["I"], config["q"], config["kv"], config["vocab_size"]
    attention = C * q + 2 * C * kv + q * C
    attention += (q + 2 * kv) * config["qkv_bias"] + C * config["o_bias"]
    mlp = 3 * C * I + (2 * I + C) * config["mlp_bias"]
    per_layer = 2 * C + attention + mlp  # two RMSNorms
    embeddings = V * C * (1 if config["tied"] else 2)
    return embeddings + config["L"] * per_layer + C


def step_model_flops(config, B, T):
    """dstrain's convention (model_flops.h): 3 x forward, recomputation not counted."""
    C, q, kv, I = config["C"], config["q"], config["kv"], config["I"]
    layer = 2.0 * C * (q + 2 * kv) + 2.0 * C * q + 3 * 2.0 * C * I + 4.0 * T * q
    return 3.0 * B * T * (config["L"] * layer + 2.0 * C * config["padded_vocab"])


def build_model(torch, config):
    """transformers' model of the config, wrapped as model(tokens, targets) -> mean loss."""
    try:
        import transformers
    except ImportError as error:
        raise RuntimeError(f"cannot import transformers ({error})") from error
    nn, F = torch.nn, torch.nn.functional
    fields = dict(config["hf"])
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf_config.use_cache = False
    try:
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        has_sdpa = True
    except (ImportError, ValueError):  # an old torch (transformers wants >= 2.1.1 for sdpa)
        hf = transformers.AutoModelForCausalLM.from_config(hf_config,
                                                           attn_implementation="eager")
        has_sdpa = False
    hf = hf.float()  # fp32 parameters, as pytorch_gpt2.py and dstrain's master weights

    class Head(nn.Module):
        """The final norm, the LM head and the loss: (B, T, C) -> the mean cross-entropy."""

        def __init__(self):
            super().__init__()
            self.norm = hf.model.norm
            self.lm_head = hf.lm_head

        def forward(self, hidden, targets):
            logits = self.lm_head(self.norm(hidden)).float()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    class CausalLm(nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf
            self.head = Head()
            hf.model.norm = nn.Identity()  # applied by the head, inside its compiled region

        def forward(self, tokens, targets):
            hidden = self.hf.model(input_ids=tokens, use_cache=False).last_hidden_state
            return self.head(hidden, targets)

    return CausalLm(), has_sdpa


LLAMA = pytorch_gpt2.Family(
    "pytorch_llama", "LLaMA-family (transformers)", load_config, build_model, num_parameters,
    step_model_flops, lambda model: list(model.hf.model.layers) + [model.head],
    "3 x (L x (2 C (q + 2 kv) + 2 C q + 6 C I + 4 T q) + 2 C Vp)")


if __name__ == "__main__":
    sys.exit(pytorch_gpt2.benchmark(sys.argv[1:], LLAMA, "qwen2.5-0.5b"))
