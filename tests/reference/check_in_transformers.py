#!/usr/bin/python3
"""A dstrain checkpoint is a Hugging Face model directory: transformers itself loads it.

  check_in_transformers.py DSTRAIN FIXTURE_DIR WORK_DIR

Trains the fixture (llama_tiny or qwen2_tiny, made by make_llama_reference.py) with the
dstrain binary DSTRAIN, on the CPU, with the training settings transformers used, into
WORK_DIR, the weights in shards (--save-shard-size 30K) so that the index is read too. Then,
in transformers:
  - AutoModelForCausalLM.from_pretrained(WORK_DIR/run/latest, the link to the final
    checkpoint) loads with no missing, unexpected or misshapen tensor, as the fixture's class
    (LlamaForCausalLM / Qwen2ForCausalLM);
  - its loss on every micro-batch of the run equals (1e-4 relative) the loss of transformers'
    own model after the same 10 steps (the fixture's final.safetensors);
  - its weights are within 2e-5 of those (the bound of hf_models_test.cpp);
and, fine-tuned again from a copy of the fixture holding a tokenizer (tokenizer.json,
tokenizer_config.json, special_tokens_map.json) with the defaults a user gets (--save-dtype
source: the fixture's own dtype), the checkpoint is a complete Hugging Face directory:
  - AutoTokenizer.from_pretrained(checkpoint) loads the tokenizer the run was given and encodes
    as it does;
  - AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype="auto") comes back in the
    fixture's dtype (config.json's torch_dtype: bfloat16 for qwen2_tiny, float32 for
    llama_tiny), with the weights of the fp32 checkpoint rounded to it.

WORK_DIR is emptied first. Exits 77 (ctest's "skipped") when torch or transformers cannot be imported: dstrain's tests
never need them, this check runs where they are installed (Debian's python3-torch and
transformers 4.41: see tests/reference/README.md).
"""
import json
import os
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True
try:
    import torch
    import transformers
except ImportError as error:
    print(f"skipped: {error} (install python3-torch and transformers to run this check)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_gpt2_reference import cross_entropy, micro_batch  # noqa: E402
from safetensors_io import read_safetensors  # noqa: E402


def train_with_dstrain(dstrain, fixture, expected, out_dir, save_dtype="fp32"):
    data = os.path.join(fixture, "train.bin")
    flags = {
        "model": fixture, "init-from": fixture, "data": data, "val-data": data,
        "save-dtype": save_dtype,
        "batch": expected["batch"], "seq-len": expected["seq_len"],
        "grad-accum": expected["grad_accum"], "steps": expected["steps"],
        "lr": expected["lr"], "min-lr": expected["min_lr"], "warmup": expected["warmup"],
        "lr-schedule": expected["lr_schedule"], "weight-decay": expected["weight_decay"],
        "beta1": expected["beta1"], "beta2": expected["beta2"], "eps": expected["eps"],
        "grad-clip": expected["grad_clip"], "eval-every": 0, "sample": 0, "device": "cpu",
        "out": out_dir, "save-shard-size": "30K",
    }
    command = [dstrain, "--quiet"] + [f"--{k}={v}" for k, v in flags.items()]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    latest = os.path.join(out_dir, "latest")  # a link to step-000010: what users load
    assert os.path.realpath(latest) == os.path.realpath(
        os.path.join(out_dir, "step-%06d" % expected["steps"])), latest
    return latest


def tokens_of(path):
    """The uint16 tokens of an llm.c shard (256 int32 header)."""
    with open(path, "rb") as f:
        raw = f.read()
    header = torch.frombuffer(bytearray(raw[:1024]), dtype=torch.int32)
    count = int(header[2])
    return torch.frombuffer(bytearray(raw[1024:1024 + 2 * count]), dtype=torch.int16).long() & 0xFFFF


def mean_loss(model, tokens, expected):
    B, T = expected["batch"], expected["seq_len"]
    windows = expected["steps"] * expected["grad_accum"]
    with torch.no_grad():
        losses = [cross_entropy(model(input_ids=x).logits, y).item()
                  for x, y in (micro_batch(tokens, w, B, T) for w in range(windows))]
    return sum(losses) / len(losses)


def compare_to_reference(ours, reference, fixture, expected, loss=mean_loss):
    """The model of dstrain's checkpoint against the reference holding the fixture's final
    weights: the same parameters, within 2e-5, and the same mean loss over the fixture's training
    windows within 1e-4 (`loss(model, tokens, expected)`). Returns (worst weight difference,
    our loss, the reference's)."""
    ours_params, params = dict(ours.named_parameters()), dict(reference.named_parameters())
    assert sorted(ours_params) == sorted(params), (sorted(ours_params), sorted(params))
    worst = max((ours_params[n] - params[n]).abs().max().item() for n in params)
    assert worst < 2e-5, f"weights differ by up to {worst}"
    tokens = tokens_of(os.path.join(fixture, "train.bin"))
    loss_ours, loss_ref = loss(ours.eval(), tokens, expected), loss(reference.eval(), tokens, expected)
    assert abs(loss_ours - loss_ref) <= 1e-4 * loss_ref, (loss_ours, loss_ref)
    return worst, loss_ours, loss_ref


def main():
    dstrain, fixture, work = sys.argv[1:4]
    torch.set_num_threads(1)
    expected = json.load(open(os.path.join(fixture, "expected.json")))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    checkpoint = train_with_dstrain(dstrain, fixture, expected, os.path.join(work, "run"))
    assert os.path.exists(os.path.join(checkpoint, "model.safetensors.index.json")), checkpoint

    ours, info = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, output_loading_info=True, torch_dtype=torch.float32,
        attn_implementation="eager")
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers loading {checkpoint}: {problems}"
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        fixture, torch_dtype=torch.float32, attn_implementation="eager")
    assert type(ours) is type(reference), (type(ours), type(reference))
    final = dict(read_safetensors(os.path.join(fixture, "final.safetensors")))
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, value in final.items():
            params[name].copy_(value)
    worst, loss_ours, loss_ref = compare_to_reference(ours, reference, fixture, expected)
    print(f"{os.path.basename(fixture)}: transformers {transformers.__version__} loads dstrain's "
          f"{checkpoint} as {type(ours).__name__}; loss {loss_ours:.7f} (transformers' own run: "
          f"{loss_ref:.7f}), weights within {worst:.2e}")
    check_complete_directory(dstrain, fixture, expected, work, checkpoint)


def with_tokenizer(fixture, work):
    """A copy of the fixture as the hub has models: a tokenizer beside the weights."""
    model = os.path.join(work, "model")
    shutil.copytree(fixture, model)
    # A byte-level BPE made here by the tokenizers library transformers runs with (the committed
    # fixtures may come from a newer one).
    import tokenizers
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(["dstrain trains transformers on the GPUs of one machine or several."] * 4,
                            tokenizers.trainers.BpeTrainer(
                                vocab_size=300, special_tokens=["<|endoftext|>"],
                                initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(os.path.join(model, "tokenizer.json"))
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "model_max_length": 32}, f)
    with open(os.path.join(model, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    return model


def check_complete_directory(dstrain, fixture, expected, work, fp32_checkpoint):
    model = with_tokenizer(fixture, work)
    checkpoint = train_with_dstrain(dstrain, model, expected, os.path.join(work, "tuned"),
                                    save_dtype="source")
    text = "Hello, world: dstrain's checkpoints are whole."
    given = transformers.AutoTokenizer.from_pretrained(model)
    loaded = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert loaded(text)["input_ids"] == given(text)["input_ids"], "the tokenizer changed"
    source = json.load(open(os.path.join(fixture, "config.json")))["torch_dtype"]
    auto = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype="auto")
    dtypes = {p.dtype for p in auto.parameters()}
    assert dtypes == {getattr(torch, source)}, (dtypes, source)
    fp32 = dict(transformers.AutoModelForCausalLM.from_pretrained(
        fp32_checkpoint, torch_dtype=torch.float32).named_parameters())
    for name, value in auto.named_parameters():
        assert torch.equal(value, fp32[name].to(value.dtype)), name
    print(f"{os.path.basename(fixture)}: AutoTokenizer and AutoModelForCausalLM(torch_dtype="
          f"'auto') load {checkpoint}: {source} weights, the tokenizer the run was given")


if __name__ == "__main__":
    main()
