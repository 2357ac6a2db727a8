#!/usr/bin/python3
"""A dstrain DeepSeekMoE, DeepSeek-V2 or DeepSeek-V3 checkpoint is a Hugging Face model directory
of DeepSeek's model.

  check_deepseek_checkpoint.py DSTRAIN FIXTURE_DIR WORK_DIR

The DeepSeek counterpart of check_in_transformers.py. transformers 4.41 has none of DeepSeek's
models (DeepSeek's modeling_deepseek.py ships with its checkpoints on the hub,
trust_remote_code), so the checkpoint is loaded into the PyTorch model that made the fixture
instead: make_deepseek_reference.py's (DeepSeekMoE) or make_deepseek_v2_reference.py's (V2, V3:
multi-head latent attention; V3's selection biases are buffers of it, its multi-token
prediction layer not built, as DeepSeek's model does not build it).

Trains the fixture (deepseek_moe_tiny, deepseek_moe_aux_tiny, deepseek_v2_tiny or
deepseek_v3_tiny) with the dstrain binary DSTRAIN, on the CPU, with the training
settings the reference used, into WORK_DIR, the weights in shards (--save-shard-size 30K) so
that the index is read too. Then:
  - WORK_DIR/run/latest, the link to the final checkpoint, has a config.json of DeepSeek's
    model (the fixture's model_type and architectures) whose DeepSeek fields equal the
    fixture's;
  - the reference model built from that config.json (not the fixture's) loads every tensor of
    the sharded checkpoint, as model.safetensors.index.json maps them, with no missing,
    unexpected or misshapen tensor;
  - its loss on every micro-batch of the run (eval mode: the cross-entropy, no aux loss) equals
    (1e-4 relative) the loss of the reference's own model after the same 10 steps (the
    fixture's final.safetensors);
  - its weights are within 2e-5 of those (the bound of hf_models_test.cpp).

WORK_DIR is emptied first. Exits 77 (ctest's "skipped") when torch (or transformers, which
make_llama_reference.py imports) cannot be imported: dstrain's tests never need them, this
check runs where they are installed (Debian's python3-torch and transformers 4.41: see
tests/reference/README.md).
"""
import json
import os
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True
try:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_deepseek_reference import DeepseekForCausalLM  # noqa: E402
    from make_deepseek_v2_reference import DeepseekV2ForCausalLM  # noqa: E402
    # The same run of dstrain and the same data as the transformers check.
    from check_in_transformers import compare_to_reference, train_with_dstrain  # noqa: E402
    from make_gpt2_reference import cross_entropy, micro_batch  # noqa: E402
except ImportError as error:
    print(f"skipped: {error} (install python3-torch and transformers to run this check)")
    sys.exit(77)

from safetensors_io import read_safetensors  # noqa: E402

# The fields of DeepSeek's config.json (configuration_deepseek.py's DeepseekConfig) that decide
# the model: the checkpoint's must be the fixture's.
DEEPSEEK_FIELDS = [
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
    "intermediate_size", "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob",
    "scoring_func", "aux_loss_alpha", "seq_aux", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta",
    "tie_word_embeddings",
]
# DeepSeek-V2/V3's (DeepseekV2Config, DeepseekV3Config): multi-head latent attention, the
# routers, the rotary scaling; V3's multi-token prediction layers.
LATENT_FIELDS = [
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_group", "topk_group", "topk_method", "routed_scaling_factor", "rope_scaling",
]
MODELS = {  # model_type: the reference's class, extra fields
    "deepseek": (DeepseekForCausalLM, []),
    "deepseek_v2": (DeepseekV2ForCausalLM, LATENT_FIELDS),
    "deepseek_v3": (DeepseekV2ForCausalLM, LATENT_FIELDS + ["num_nextn_predict_layers"]),
}
# DeepseekConfig's defaults for the other fields the reference model reads, as DeepSeek's own
# model would take them from a config.json that leaves them out.
DEEPSEEK_DEFAULTS = {
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "rope_scaling": None, "pretraining_tp": 1, "initializer_range": 0.02,
}


def mean_loss(model, tokens, expected):
    B, T = expected["batch"], expected["seq_len"]
    windows = expected["steps"] * expected["grad_accum"]
    with torch.no_grad():
        losses = []
        for x, y in (micro_batch(tokens, w, B, T) for w in range(windows)):
            logits, aux = model(x)
            assert not aux, "an aux loss in eval mode"
            losses.append(cross_entropy(logits, y).item())
    return sum(losses) / len(losses)


def same(a, b):
    """Equal JSON values, a boolean only equal to a boolean (not to 0 or 1)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def checked_config(checkpoint, fixture):
    """The checkpoint's config.json, checked against the fixture's."""
    config = json.load(open(os.path.join(checkpoint, "config.json")))
    source = json.load(open(os.path.join(fixture, "config.json")))
    assert config.get("model_type") == source["model_type"], config.get("model_type")
    assert config.get("architectures") == source["architectures"], config.get("architectures")
    fields = DEEPSEEK_FIELDS + MODELS[source["model_type"]][1]
    wrong = {k: (config.get(k, "<missing>"), source[k])
             for k in fields if k not in config or not same(config[k], source[k])}
    assert not wrong, f"{checkpoint}/config.json differs from the fixture's: {wrong}"
    return config


def read_sharded(checkpoint):
    """{name: tensor} of a sharded checkpoint, following model.safetensors.index.json; every
    shard of the index holds exactly the tensors the index maps to it. Also the shard count."""
    index = json.load(open(os.path.join(checkpoint, "model.safetensors.index.json")))
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    tensors = {}
    for shard in shards:
        held = read_safetensors(os.path.join(checkpoint, shard))
        mapped = sorted(n for n, s in weight_map.items() if s == shard)
        assert sorted(held) == mapped, (shard, sorted(held), mapped)
        tensors.update(held)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    total = index.get("metadata", {}).get("total_size")
    assert total == size, f"the index's total_size {total}, the tensors' {size} bytes"
    return tensors, len(shards)


def reference_model(config, tensors):
    """make_deepseek_reference.py's model for `config` holding `tensors`: every parameter,
    nothing else (load_state_dict strict), each of its shape."""
    model = MODELS[config["model_type"]][0](dict(DEEPSEEK_DEFAULTS, **config))
    state = model.state_dict()
    missing = sorted(set(state) - set(tensors))
    unexpected = sorted(set(tensors) - set(state))
    misshapen = sorted(n for n in set(state) & set(tensors) if state[n].shape != tensors[n].shape)
    assert not (missing or unexpected or misshapen), \
        f"missing {missing}, unexpected {unexpected}, misshapen {misshapen}"
    for name, value in tensors.items():
        assert value.dtype == torch.float32, (name, value.dtype)  # --save-dtype fp32
    model.load_state_dict(tensors, strict=True)
    return model


def main():
    dstrain, fixture, work = sys.argv[1:4]
    torch.set_num_threads(1)
    expected = json.load(open(os.path.join(fixture, "expected.json")))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    checkpoint = train_with_dstrain(dstrain, fixture, expected, os.path.join(work, "run"))
    assert os.path.exists(os.path.join(checkpoint, "model.safetensors.index.json")), checkpoint

    config = checked_config(checkpoint, fixture)
    tensors, shards = read_sharded(checkpoint)
    ours = reference_model(config, tensors)
    final = dict(read_safetensors(os.path.join(fixture, "final.safetensors")))
    reference = reference_model(json.load(open(os.path.join(fixture, "config.json"))), final)
    worst, loss_ours, loss_ref = compare_to_reference(ours, reference, fixture, expected,
                                                      mean_loss)
    print(f"{os.path.basename(fixture)}: the reference's {type(ours).__name__} "
          f"loads dstrain's {checkpoint} ({len(tensors)} tensors in {shards} shards, "
          f"model_type {config['model_type']}); loss {loss_ours:.7f} (the reference's own run: "
          f"{loss_ref:.7f}), weights within {worst:.2e}")


if __name__ == "__main__":
    main()
