#!/usr/bin/python3
"""Chat training against the real thing: the committed llama_tiny/ and qwen2_tiny/ models
(make_llama_reference.py; their config.json and initial weights, unchanged) trained by Hugging
Face transformers' own LlamaForCausalLM / Qwen2ForCausalLM on chat data (loss masks), as
dstrain's DataLoader reads it unpacked. Writes tests/reference/chat_train/:

  train_000000.bin     the conversations' tokens, an llm.c shard (256 int32 header, uint16)
  train_000000.mask    its loss mask (src/data/loss_mask.h): 256 int32 header [20261127, 1,
                       token count, 0...], then one byte per token: bit 0 trained target,
                       bit 1 a conversation starts here
  llama_tiny/, qwen2_tiny/ (the model's run)
    grads0.safetensors gradient of every parameter of step 1's loss (every micro-batch), before
                       clipping
    final.safetensors  weights after `steps` AdamW steps (F32)
    expected.json      the settings, the data's counts (conversations kept, left out, truncated;
                       trained targets per step and per micro-batch) and per step the loss,
                       pre-clip gradient norm and learning rate

The data: random token ids in [0, vocab), each conversation one or two turns of an untrained
prompt and a trained reply; lengths 4..21 for T = 16 (short ones padded, long ones truncated at
T+1 tokens) and one conversation whose first T+1 tokens are all prompt (no trained target:
dstrain leaves it out) and, in step 1, one whose reply runs past T+1.

A row is what dstrain's loader builds from one conversation of n = min(length, T+1) tokens:
inputs tokens[0:n-1] padded with token 0, targets tokens[1:n] where trained, else -100. Here
the model reads the row's T+1 tokens (padded with 0) and the labels are the tokens with -100
where untrained or padding: transformers' shift (logits[:, :-1] against labels[:, 1:]) makes
logit i predict token i+1, dstrain's targets[i]; the logits of position T are dropped by it.
No attention mask: the padding follows the conversation and causal attention keeps it from it.

The loss of a step is the sum of the per-token cross-entropy over the trained targets of all
its micro-batches divided by the step's count of trained targets (not a mean per micro-batch);
each micro-batch backward uses its sum / that count. transformers' own loss (with labels, a mean
per micro-batch) times the micro-batch's count is checked against the sum. Clipping, schedule
and AdamW are make_llama_reference.py's (make_gpt2_reference.py's loop) with its
hyperparameters; only the batch geometry differs: B = 2, T = 16, 4 micro-batches per step.
Sequences are read in order, S = 8 per step; the steps of an epoch are floor(kept / S), the
rest skipped, then the data wraps (as dstrain's loader without --shuffle).

Run from the repository root, with Debian's python3-torch and transformers 4.41:
  /usr/bin/python3 tests/reference/make_chat_train_reference.py
Deterministic (fixed seeds, one CPU thread, deterministic algorithms).
"""
import json
import math
import os
import random
import shutil
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_gpt2_reference import adamw, learning_rate, save_tensors, write_llmc_tokens  # noqa: E402
from make_llama_reference import TRAINING as LLAMA_TRAINING, named  # noqa: E402

import transformers  # noqa: E402

TRAINING = dict(LLAMA_TRAINING, batch=2, seq_len=16, grad_accum=4, steps=10)
MODELS = ["llama_tiny", "qwen2_tiny"]
VOCAB = 97  # both models'
CONVERSATIONS = 44
UNTRAINED_CONVERSATION = 3  # its first T+1 tokens are all prompt: left out
TRUNCATED_CONVERSATION = 5  # its reply runs past T+1 tokens (step 1 holds it)
DATA_SEED = 2611
MASK_MAGIC = 20261127
MASK_VERSION = 1
TRAINED = 1  # mask bit 0
CONVERSATION_START = 2  # mask bit 1
IGNORE = -100
OUT_DIR = os.path.join(HERE, "chat_train")
SHARD = "train_000000.bin"


def make_conversations(T):
    """[(tokens, trained flags)]: one or two turns of prompt (untrained) and reply (trained)."""
    rng = random.Random(DATA_SEED)
    conversations = []
    for c in range(CONVERSATIONS):
        if c == UNTRAINED_CONVERSATION:
            turns = [(T + 3, False), (3, True)]
        elif c == TRUNCATED_CONVERSATION:
            turns = [(6, False), (T - 1, True)]
        else:
            length = rng.randint(4, 21)
            if rng.random() < 0.3 and length >= 8:  # two turns
                cut = rng.randint(4, length - 4)
                first, second = cut, length - cut
                turns = []
                for part in (first, second):
                    prompt = rng.randint(1, part - 1)
                    turns += [(prompt, False), (part - prompt, True)]
            else:
                prompt = rng.randint(1, min(length - 2, T - 1))  # a reply in the window
                turns = [(prompt, False), (length - prompt, True)]
        tokens, trained = [], []
        for count, is_reply in turns:
            tokens += [rng.randrange(VOCAB) for _ in range(count)]
            trained += [is_reply] * count
        conversations.append((tokens, trained))
    return conversations


def write_mask(path, flags):
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = MASK_MAGIC, MASK_VERSION, len(flags)
    with open(path, "wb") as out:
        out.write(header.tobytes())
        out.write(bytes(flags))


def write_shard(conversations):
    tokens, flags = [], []
    for conversation_tokens, trained in conversations:
        for i, (token, is_trained) in enumerate(zip(conversation_tokens, trained)):
            tokens.append(token)
            flags.append((CONVERSATION_START if i == 0 else 0) | (TRAINED if is_trained else 0))
    write_llmc_tokens(os.path.join(OUT_DIR, SHARD), tokens)
    write_mask(os.path.join(OUT_DIR, SHARD.replace(".bin", ".mask")), flags)
    return len(tokens)


def make_rows(conversations, T):
    """The loader's rows of the kept conversations: (ids (T+1,), labels (T+1,), trained count,
    truncated, padded), in dataset order."""
    rows, left_out = [], 0
    for tokens, trained in conversations:
        n = min(len(tokens), T + 1)
        ids = tokens[:n] + [0] * (T + 1 - n)
        # Label j is the target of logit j-1 (transformers shifts): dstrain's targets[j-1].
        labels = [IGNORE] + [tokens[j] if trained[j] else IGNORE for j in range(1, n)]
        labels += [IGNORE] * (T + 1 - n)
        count = sum(1 for label in labels if label != IGNORE)
        if count == 0:
            left_out += 1
            continue
        rows.append((ids, labels, count, len(tokens) > T + 1, n < T + 1))
    return rows, left_out


def step_rows(rows, step, S):
    """The S rows of a step: sequence positions in order, wrapping after floor(kept / S) steps."""
    per_epoch = (len(rows) // S) * S
    return [rows[(step * S + i) % per_epoch] for i in range(S)]


def micro_batches(rows, B):
    for m in range(0, len(rows), B):
        chunk = rows[m:m + B]
        ids = torch.tensor([r[0] for r in chunk], dtype=torch.long)
        labels = torch.tensor([r[1] for r in chunk], dtype=torch.long)
        yield ids, labels


def summed_cross_entropy(model, ids, labels):
    """The sum of the cross-entropy over the micro-batch's trained targets; checked against
    transformers' own loss (its mean over them)."""
    out = model(input_ids=ids, labels=labels)
    V = out.logits.shape[-1]
    logits = out.logits[:, :-1, :].reshape(-1, V)  # logit i predicts token i+1
    targets = labels[:, 1:].reshape(-1)
    total = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE,
                                              reduction="sum")
    count = int((targets != IGNORE).sum())
    assert torch.allclose(total, out.loss * count, rtol=1e-6, atol=0), (total, out.loss, count)
    return total


def train_model(name, rows):
    t = TRAINING
    B, S, steps = t["batch"], t["batch"] * t["grad_accum"], t["steps"]
    out_dir = os.path.join(OUT_DIR, name)
    os.makedirs(out_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(HERE, name), torch_dtype=torch.float32, attn_implementation="eager")
    model.train()
    params = named(model)
    names = list(params)
    optimizer = adamw(params, names, t)
    losses, grad_norms, lrs, step_trained, micro_trained = [], [], [], [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        rows_of_step = step_rows(rows, step, S)
        trained = sum(r[2] for r in rows_of_step)
        step_trained.append(trained)
        micro_trained.append([sum(r[2] for r in rows_of_step[m:m + B]) for m in range(0, S, B)])
        step_sum = 0.0
        for ids, labels in micro_batches(rows_of_step, B):
            total = summed_cross_entropy(model, ids, labels)
            (total / trained).backward()
            step_sum += total.item()
        if step == 0:
            grads0 = {n: params[n].grad.clone() for n in names}
            for n in names:
                assert grads0[n].abs().max() > 0, f"gradient of {n} is zero"
            save_tensors(os.path.join(out_dir, "grads0.safetensors"), names, grads0,
                         "gradients of step 1's loss (every micro-batch), before clipping")
        grad_norm = torch.nn.utils.clip_grad_norm_([params[n] for n in names], t["grad_clip"])
        lr = learning_rate(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        losses.append(step_sum / trained)
        grad_norms.append(grad_norm.item())
        lrs.append(lr)
        print(f"{name} step {step}: loss {losses[-1]:.6f} grad_norm {grad_norms[-1]:.6f} "
              f"trained {trained} {micro_trained[-1]}")
    save_tensors(os.path.join(out_dir, "final.safetensors"), names,
                 {n: params[n].detach() for n in names}, f"weights after {steps} steps")
    assert len(set(micro_trained[0])) > 1, micro_trained[0]  # a mean per micro-batch differs
    assert all(math.isfinite(x) for x in losses + grad_norms)
    assert abs(losses[0] - math.log(VOCAB)) < 0.5, losses[0]
    return {"model": name, "initial_loss": losses[0], "losses": losses, "grad_norms": grad_norms,
            "lrs": lrs, "step_trained_targets": step_trained,
            "micro_batch_trained_targets": micro_trained}


def main():
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    t = TRAINING
    T, S = t["seq_len"], t["batch"] * t["grad_accum"]
    shutil.rmtree(OUT_DIR, ignore_errors=True)
    os.makedirs(OUT_DIR)
    conversations = make_conversations(T)
    n_tokens = write_shard(conversations)
    rows, left_out = make_rows(conversations, T)
    first_step = step_rows(rows, 0, S)
    # Step 1 holds a truncated row and padded rows: the gradients of step 1 cover both.
    assert any(r[3] for r in first_step) and any(r[4] for r in first_step)
    assert left_out == 1
    data = {
        "data": SHARD,
        "tokens": n_tokens,
        "conversations": CONVERSATIONS,
        "kept": len(rows),
        "left_out": left_out,
        "left_out_conversation": UNTRAINED_CONVERSATION,
        "truncated": sum(1 for r in rows if r[3]) + 1,  # the left-out one is longer than T+1
        "padded_rows": sum(1 for r in rows if r[4]),
        "trained_targets": sum(r[2] for r in rows),
        "steps_per_epoch": len(rows) // S,
        "data_seed": DATA_SEED,
    }
    for name in MODELS:
        expected = dict(t)
        expected.update(data)
        expected.update(train_model(name, rows))
        expected.update({
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "notes": [
                "the model is tests/reference/" + name + " (config.json, initial weights)",
                "loss of a step: sum of the cross-entropy over the trained targets of its "
                "micro-batches / step_trained_targets; initial_loss is losses[0] and grads0 its "
                "gradient",
                "clipping, schedule and AdamW (decay on 2-D tensors) as make_llama_reference.py",
            ],
        })
        with open(os.path.join(OUT_DIR, name, "expected.json"), "w") as out:
            json.dump(expected, out, indent=2)
            out.write("\n")
    total = sum(os.path.getsize(os.path.join(root, f))
                for root, _, files in os.walk(OUT_DIR) for f in files)
    print(f"wrote {OUT_DIR} ({total} bytes): {data}")


if __name__ == "__main__":
    main()
