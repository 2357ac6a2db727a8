#!/usr/bin/env python3
"""The same GPT-2 training step as dstrain's bench_train, in PyTorch: the baseline of issue 5.

An independent implementation written from the math (no `transformers`, no dstrain code):
pre-LN blocks, GELU with the tanh approximation, learned positions, the LM head tied to the
token embedding, biases everywhere, LayerNorm eps from the config, the vocabulary padded to a
multiple of 64 as dstrain pads it (src/model/config.h, padded_vocab), the padded columns masked
out of the softmax as dstrain masks them. Its logits match tests/reference/gpt2_tiny (the
fixture dstrain is tested against) when given those weights. Initialization as dstrain's:
N(0, 0.02) matrices and embeddings, N(0, 0.02/sqrt(2L)) for the residual projections, zero
biases, unit LayerNorm, zero padded rows.

Training as dstrain's defaults (src/train/options.h): AdamW (betas 0.9/0.95, eps 1e-8, weight
decay 0.1 on matrices and embeddings only), global-norm clipping at 1.0, LR 3e-3 with 20 warmup
steps then cosine to LR/10 over the run. Mixed precision the PyTorch way: fp32 parameters and
optimizer, torch.autocast to fp16/bf16 for forward and loss; fp16 with a GradScaler (PyTorch's
defaults are the ones dstrain's scaler copies). Attention is F.scaled_dot_product_attention
(causal) when this torch has it. Random tokens, one batch reused every step.

Each mode times --steps steps after --warmup untimed ones (torch.compile compiles during the
first warm-up step); every step ends with torch.cuda.synchronize() before the clock is read,
and the table reports the median step. Model FLOPs as dstrain's planner counts them
(src/parallel/cost_model.h, model_flops): per token 3 x (L x (24 C^2 + 4 T C) + 2 C Vp).

  pytorch_gpt2.py [--model gpt2-124m] [--device cuda|cpu] [--dtype fp32|fp16|bf16[,...]]
                  [--batch B] [--seq-len T] [--steps N] [--warmup N] [--mode eager|compile|both]
                  [--compile-scope model|blocks] [--peak-tflops X] [--json FILE]
  pytorch_gpt2.py summarize --out summary.md [--commit C] [--date D] [--status TSV] FILE.json...

`summarize` needs no torch: it reads the JSON of bench_cuda_ops, bench_train and this script
and writes the markdown summary of benchmarks/gpu_session.sh (dstrain / PyTorch ratios).
"""
import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# dstrain's training defaults (src/train/options.h, TrainOptions).
DEFAULTS = {"lr": 3e-3, "min_lr_fraction": 0.1, "warmup": 20, "weight_decay": 0.1,
            "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0}


def fail(message):
    """A user's mistake: one sentence, exit 2 (as dstrain's programs do)."""
    print(f"pytorch_gpt2: {message}", file=sys.stderr)
    sys.exit(2)


def load_config(name):
    """A preset of configs/models/ or the path of a Hugging Face style config.json."""
    path = name if os.path.isfile(name) else os.path.join(REPO, "configs", "models", name + ".json")
    if not os.path.isfile(path):
        presets = sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "configs", "models"))
                         if f.endswith(".json"))
        fail(f"unknown model '{name}': give a preset ({', '.join(presets)}) or a config.json path")
    with open(path) as f:
        c = json.load(f)
    config = {k: c[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    config["layer_norm_epsilon"] = c.get("layer_norm_epsilon", 1e-5)
    config["name"] = name
    config["padded_vocab"] = (config["vocab_size"] + 63) // 64 * 64
    return config


def num_parameters(config):
    """As Hugging Face counts them (real vocabulary, tied head), like ModelConfig."""
    C, L = config["n_embd"], config["n_layer"]
    per_layer = (2 * C + (3 * C * C + 3 * C) + (C * C + C)  # ln_1, c_attn, c_proj
                 + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C))  # ln_2, c_fc, c_proj
    return config["vocab_size"] * C + config["n_positions"] * C + L * per_layer + 2 * C


def step_model_flops(config, B, T):
    """dstrain's convention (cost_model.h model_flops): 3 x forward, no recompute counted."""
    C, L, Vp = config["n_embd"], config["n_layer"], config["padded_vocab"]
    return 3.0 * B * T * (L * (24.0 * C * C + 4.0 * T * C) + 2.0 * C * Vp)


def learning_rate(step, total):
    """dstrain's schedule (src/optim/schedule.h) with its defaults: warmup, then cosine."""
    lr, warmup = DEFAULTS["lr"], DEFAULTS["warmup"]
    min_lr = lr * DEFAULTS["min_lr_fraction"]
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_model(torch, config):
    """GPT-2 as an nn.Module (defined here so that `summarize` needs no torch)."""
    nn = torch.nn
    F = torch.nn.functional
    has_sdpa = hasattr(F, "scaled_dot_product_attention")
    C, NH, L = config["n_embd"], config["n_head"], config["n_layer"]
    eps = config["layer_norm_epsilon"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=eps)
            self.c_attn = nn.Linear(C, 3 * C)
            self.attn_proj = nn.Linear(C, C)
            self.ln_2 = nn.LayerNorm(C, eps=eps)
            self.c_fc = nn.Linear(C, 4 * C)
            self.mlp_proj = nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)  # (B, T, C) each
            q = q.view(B, T, NH, C // NH).transpose(1, 2)  # (B, NH, T, hd)
            k = k.view(B, T, NH, C // NH).transpose(1, 2)
            v = v.view(B, T, NH, C // NH).transpose(1, 2)
            if has_sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // NH))  # (B, NH, T, T)
                causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                y = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            x = x + self.attn_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Head(nn.Module):
        """ln_f, the tied LM head and the loss: (B, T, C) -> the mean cross-entropy."""

        def __init__(self):
            super().__init__()
            self.ln_f = nn.LayerNorm(C, eps=eps)
            # The padded columns of the logits leave the softmax, as in dstrain: a bias of -inf
            # there (0 elsewhere), which the head's GEMM adds in its epilogue.
            V, Vp = config["vocab_size"], config["padded_vocab"]
            mask = torch.zeros(Vp)
            mask[V:] = float("-inf")
            self.register_buffer("vocab_mask", mask if Vp > V else None, persistent=False)

        def forward(self, x, wte, targets):
            logits = F.linear(self.ln_f(x), wte, self.vocab_mask)  # (B, T, Vp)
            # Under autocast, cross_entropy runs in fp32 (autocast's list), as dstrain's softmax.
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    class Gpt2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(config["padded_vocab"], C)  # (Vp, C), also the LM head
            self.wpe = nn.Embedding(config["n_positions"], C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.head = Head()

        def forward(self, tokens, targets):
            T = tokens.shape[1]
            x = self.wte(tokens) + self.wpe.weight[:T]
            for block in self.h:
                x = block(x)
            return self.head(x, self.wte.weight, targets)

    model = Gpt2()
    residual_std = 0.02 / math.sqrt(2 * L)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, residual_std if name.endswith("proj.weight") else 0.02)
        model.wte.weight[config["vocab_size"]:].zero_()  # padded rows: never a token
    return model, has_sdpa


class Family:
    """What the benchmark asks of a model family: its program name (the JSON's "program"), the
    config loader, the model builder ((model, uses_sdpa); model(tokens, targets) is the mean
    loss), the parameter count, a step's model FLOPs, the modules torch.compile'd one by one
    under --compile-scope blocks, and the FLOPs formula as text."""

    def __init__(self, program, title, load, build, params, flops, regions, flops_text):
        self.program, self.title, self.load, self.build = program, title, load, build
        self.params, self.flops, self.regions, self.flops_text = params, flops, regions, flops_text


GPT2 = Family("pytorch_gpt2", "GPT-2", load_config, build_model, num_parameters,
              step_model_flops, lambda model: list(model.h) + [model.head],
              "3 x (L x (24 C^2 + 4 T C) + 2 C Vp)")


def sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def first_line(error):
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def run_mode(torch, args, config, dtype_name, mode, family):
    """One (dtype, mode) case of `family`. Returns a result dict; never raises for a failed case."""
    B, T, device = args.batch, args.seq_len, args.device
    row = {"impl": "pytorch", "mode": mode, "device": device, "model": config["name"],
           "dtype": dtype_name, "params": family.params(config), "batch": B, "seq_len": T}
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    if mode == "compile" and not hasattr(torch, "compile"):
        row["unavailable"] = f"torch {torch.__version__} has no torch.compile (needs torch >= 2.0)"
        return row
    use_autocast = dtype_name != "fp32"
    if use_autocast:
        # Some builds ignore an autocast dtype they do not support (torch 1.13 on the CPU runs
        # fp16 as fp32, with a warning): check that it takes effect before timing anything.
        import warnings
        reason = ""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                probe = torch.ones(2, 2, device=device)
                with torch.autocast(device_type=device, dtype=dtype):
                    got = (probe @ probe).dtype
            if got != dtype:
                reason = f"it computes in {got}"
        except RuntimeError as error:
            reason = first_line(error)
        if reason:
            row["unavailable"] = (f"torch {torch.__version__} autocast on {device} does not "
                                  f"support {dtype_name}: {reason}")
            return row
    model = optimizer = step_model = None
    try:
        torch.manual_seed(1337)
        # Made where it trains (torch >= 2.0: the device as a context), not made and copied.
        where = torch.device(device)
        with where if hasattr(where, "__enter__") else contextlib.nullcontext():
            model, has_sdpa = family.build(torch, config)
        model = model.to(device)
        row["sdpa"] = has_sdpa
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": DEFAULTS["weight_decay"]},
                  {"params": no_decay, "weight_decay": 0.0}]
        import inspect
        kwargs = {}
        if device == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters:
            kwargs["fused"] = True  # PyTorch's fastest AdamW on a GPU
        optimizer = torch.optim.AdamW(groups, lr=DEFAULTS["lr"], eps=DEFAULTS["eps"],
                                      betas=(DEFAULTS["beta1"], DEFAULTS["beta2"]), **kwargs)
        row["adamw"] = "fused" if kwargs else "default (foreach where available)"
        scaler = None
        if dtype_name == "fp16":
            if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
                scaler = torch.amp.GradScaler(device)
            else:
                scaler = torch.cuda.amp.GradScaler()
        step_model = model
        if mode == "compile":
            import torch._dynamo
            torch._dynamo.reset()  # a fresh compilation for each case
            row["compile_scope"] = args.compile_scope
            if args.compile_scope == "model":
                step_model = torch.compile(model)
            else:
                # Regional compilation: each block and the head compiled on their own. The blocks
                # are alike, so one compilation serves all of them (torch >= 2.5 inlines module
                # parameters as inputs): the cold start of one block, not of L.
                for module in family.regions(model):
                    module.compile()
        generator = torch.Generator(device="cpu").manual_seed(2)
        tokens = torch.randint(0, config["vocab_size"], (B, T + 1), generator=generator)
        inputs = tokens[:, :-1].contiguous().to(device)
        targets = tokens[:, 1:].contiguous().to(device)
        params = list(model.parameters())
        total = args.warmup + args.steps
        times, losses, skipped = [], [], 0
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for step in range(total):
            start = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total)
            with (torch.autocast(device_type=device, dtype=dtype) if use_autocast
                  else contextlib.nullcontext()):
                loss = step_model(inputs, targets)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, DEFAULTS["grad_clip"])
                scale_before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, DEFAULTS["grad_clip"])
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(torch, device)
            seconds = time.perf_counter() - start
            if step == 0:
                row["first_step_s"] = seconds  # with torch.compile: the compilation
            if step >= args.warmup:
                times.append(seconds)
                losses.append(loss.item())
                if scaler is not None and scaler.get_scale() < scale_before:
                    skipped += 1
        if not all(math.isfinite(x) for x in losses):
            raise RuntimeError(f"the loss is not finite: {losses}")
        median = statistics.median_high(times)  # the upper median, as bench_train's
        flops = family.flops(config, B, T)
        row.update({"timed_steps": len(times), "skipped_steps": skipped,
                    "ms_per_step": median * 1e3, "mean_ms_per_step": statistics.mean(times) * 1e3,
                    "tokens_per_s": B * T / median, "tflops": flops / median / 1e12,
                    "final_loss": losses[-1]})
        if device == "cuda":
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        if args.peak_tflops:
            row["peak_tflops"] = args.peak_tflops
            row["mfu"] = row["tflops"] / args.peak_tflops
    except Exception as error:  # noqa: BLE001 -- a failed case is a row, not a crash
        key = "unavailable" if mode == "compile" and "first_step_s" not in row else "error"
        row[key] = (("torch.compile failed: " if key == "unavailable" else "") + first_line(error))
    finally:
        del model, optimizer, step_model
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def format_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def print_row(row):
    shape = f"{row['batch']} x {row['seq_len']}"
    mode = row["mode"] + (f" ({row['compile_scope']})" if "compile_scope" in row else "")
    head = (f"| pytorch {mode} | {row['model']} | {row['params'] / 1e6:.1f}M | "
            f"{row['dtype']} | {shape} |")
    if "unavailable" in row or "error" in row:
        what = "unavailable" if "unavailable" in row else "failed"
        print(f"{head} {what}: {row.get('unavailable', row.get('error'))} |", flush=True)
        return
    peak = f"{row['peak_tflops']:.1f}" if "peak_tflops" in row else ""
    mfu = f"{100 * row['mfu']:.1f}%" if "mfu" in row else ""
    memory = format_bytes(row["peak_memory_bytes"]) if "peak_memory_bytes" in row else ""
    print(f"{head} {row['ms_per_step']:.1f} | {row['tokens_per_s']:.0f} | {row['tflops']:.2f} | "
          f"{peak} | {mfu} | {row['skipped_steps']} of {row['timed_steps']} | {memory} | "
          f"{row['first_step_s']:.1f} |", flush=True)


def benchmark(argv, family=GPT2, default_model="gpt2-124m"):
    parser = argparse.ArgumentParser(description=f"{family.title} training throughput in "
                                     "PyTorch (eager and torch.compile), dstrain's FLOPs "
                                     "convention.")
    parser.add_argument("--model", default=default_model)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="fp32", help="fp32, fp16, bf16, or a comma list")
    parser.add_argument("--batch", type=int, default=0, help="default: as bench_train's")
    parser.add_argument("--seq-len", type=int, default=0, help="default: as bench_train's")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (cuda 10, cpu 3)")
    parser.add_argument("--warmup", type=int, default=-1, help="untimed steps (cuda 3, cpu 1)")
    parser.add_argument("--mode", default="both", choices=["eager", "compile", "both"])
    parser.add_argument("--compile-scope", default="model", choices=["model", "blocks"],
                        help="torch.compile the whole model, or each block and the head "
                        "(regional compilation: far shorter compile of deep models)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="the peak for MFU (TFLOP/s); none: no MFU")
    parser.add_argument("--json", default="", help="write the rows to this file")
    parser.add_argument("--threads", type=int, default=0,
                        help="--device cpu: torch's intra-op threads (default: torch's own)")
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtype.split(",") if d]
    for d in dtypes:
        if d not in ("fp32", "fp16", "bf16"):
            fail(f"--dtype takes fp32, fp16 or bf16 (or a comma list of them), not '{d}'")
    if not dtypes:
        fail("--dtype needs fp32, fp16 or bf16")
    config = family.load(args.model)
    cuda = args.device == "cuda"
    small = config["name"] == "tiny"
    args.batch = args.batch or (8 if cuda else (16 if small else 4))
    args.seq_len = args.seq_len or min(config["n_positions"],
                                       1024 if cuda else (64 if small else 128))
    args.steps = args.steps or (10 if cuda else 3)
    args.warmup = args.warmup if args.warmup >= 0 else (3 if cuda else 1)
    if args.batch < 1 or args.seq_len < 1 or args.steps < 1:
        fail("--batch, --seq-len and --steps must be at least 1")
    if args.seq_len > config["n_positions"]:
        fail(f"--seq-len {args.seq_len} is longer than {args.model}'s n_positions "
             f"{config['n_positions']}")
    if args.peak_tflops < 0:
        fail("--peak-tflops must be positive")
    try:
        import torch
    except ImportError as error:
        fail(f"cannot import torch ({error}); install PyTorch to run the baseline")
    if cuda and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device here (no GPU, no driver, or a CPU-only "
             "torch); use --device cpu")
    if args.threads < 0:
        fail("--threads must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    device_name = (torch.cuda.get_device_name(0) if cuda
                   else f"cpu ({torch.get_num_threads()} threads)")
    print(f"{family.program}: torch {torch.__version__}, {device_name}, {args.warmup} warm-up + "
          f"{args.steps} timed steps")
    print("| impl | model | params | dtype | batch x seq | ms/step | tokens/s | TFLOP/s | "
          "peak TFLOP/s | MFU | fp16 skipped | peak memory | first step s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    modes = ["eager", "compile"] if args.mode == "both" else [args.mode]
    rows = []
    for dtype_name in dtypes:
        for mode in modes:
            row = run_mode(torch, args, config, dtype_name, mode, family)
            print_row(row)
            rows.append(row)
    print("\nms/step: median of the timed steps, each ending with a synchronize. Model FLOPs as "
          f"dstrain's planner counts them: per token {family.flops_text}. MFU = "
          "achieved / --peak-tflops. First step: the untimed first warm-up step (with "
          "torch.compile, the compilation). Peak memory: torch.cuda.max_memory_allocated.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"program": family.program, "torch": torch.__version__,
                       "device": device_name, "warmup": args.warmup, "steps": args.steps,
                       "rows": rows}, f, indent=2)
            f.write("\n")
    return 1 if any("error" in r for r in rows) else 0


# ---- summarize: the markdown of a GPU session (no torch needed) ----------------------------

def fmt(value, digits=1, suffix=""):
    return "" if value is None else f"{value:.{digits}f}{suffix}"


def dstrain_row(row):
    """A bench_train row; one run with another attention form than the default (bench_train
    --attention-warp-rows) gets a line of its own, named after the form."""
    rows = row.get("attention_warp_rows", 16)
    if rows == 16:
        return row
    return dict(row, model=f"{row['model']} (attention {rows} rows per warp)")


# llmq's published single-GPU numbers (its README, an H100; tokens/s), as issue 34 quotes them.
LLMQ_H100 = {"qwen2.5-0.5b": {"bf16": 149e3, "fp8": 164e3},
             "qwen2.5-7b": {"bf16": 14e3, "fp8": 19e3}}


def trainer_row(path):
    """A dstrain training log (--log) of gpu_session.sh's BIG_MODELS, trainer_<model>.jsonl, as a
    throughput row: tokens/s the median over the steps after the second (the first ones load
    cuBLAS and fill the allocator), the plan the trainer chose, its peak memory."""
    name = os.path.basename(path)[len("trainer_"):-len(".jsonl")]
    config, steps, memory, summary = {}, [], None, None
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("type") == "config":
                config = record
            elif "peak_bytes" in record and memory is None:
                # The device's allocator alone (with parameter offload the parameters'
                # category is in both); logs of earlier versions: the categories not on the host.
                if "device_peak_bytes" in record:
                    memory = sum(record["device_peak_bytes"].values())
                else:
                    memory = sum(v for k, v in record["peak_bytes"].items()
                                 if not k.endswith("_host"))
            elif record.get("type") == "summary":
                summary = record
            elif "step" in record and "tokens_per_s" in record:
                steps.append(record["tokens_per_s"])
    plan, run = config.get("plan", {}), config.get("run", {})
    row = {"impl": "dstrain trainer", "model": name, "dtype": plan.get("precision", "?"),
           "batch": run.get("global_batch", 0), "seq_len": run.get("seq_len", 0),
           "plan": (f"dp {plan.get('dp')} x tp {plan.get('tp')} x pp {plan.get('pp')}, ZeRO-"
                    f"{plan.get('zero')}, offload {plan.get('offload')}"
                    f"{' (and the parameters)' if plan.get('offload_params') else ''}, recompute "
                    f"{plan.get('recompute')}, micro-batch {plan.get('micro_batch')} x "
                    f"{plan.get('grad_accum')} accumulation") if plan else "unknown"}
    timed = steps[2:] or steps
    if summary is None or not timed:
        row["error"] = "the run did not finish (see session.log)"
        return row
    row["tokens_per_s"] = statistics.median_high(timed)
    row["timed_steps"] = len(timed)
    if memory is not None:
        row["peak_memory_bytes"] = memory
    return row


def kernel_shares(path):
    """Nsight Compute's CSV of one step (gpu__time_duration of every launch, base units): the
    total time of each kernel, largest first, and their sum in ms."""
    import csv
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    totals, launches = {}, {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(row["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        name = row.get("Kernel Name", "?")
        totals[name] = totals.get(name, 0.0) + ns
        launches[name] = launches.get(name, 0) + 1
    ordered = sorted(totals.items(), key=lambda item: -item[1])
    return [(name, ns / 1e6, launches[name]) for name, ns in ordered], sum(totals.values()) / 1e6


def trace_spans(path):
    """A dstrain --trace file: per traced step, the mean milliseconds of each kind of span on
    rank 0's compute track ("forward layer 3" counts as "forward layers"), and of the step."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    totals, steps = {}, 0
    for e in events:
        if e.get("ph") != "X" or e.get("pid", 0) != 0 or e.get("tid", 0) != 0:
            continue
        name = e["name"]
        if name.startswith("step "):
            steps += 1
            name = "step"
        elif name.startswith(("forward layer", "backward layer")):
            name = name.split(" layer")[0] + " layers"
        totals[name] = totals.get(name, 0.0) + e.get("dur", 0.0) / 1e3
    steps = max(steps, 1)
    return {name: ms / steps for name, ms in totals.items()}


def trace_lines(model, spans):
    step = spans.get("step", 0.0)
    inside = sum(ms for name, ms in spans.items() if name != "step")
    lines = ["", f"## A traced {model} step (dstrain --trace, rank 0's compute track)", "",
             f"Step {step:.1f} ms; its spans {inside:.1f} ms "
             f"({100 * inside / step:.0f}%)." if step else "No step span.", "",
             "| span | ms per step | share of the step |", "|---|---|---|"]
    for name, ms in sorted(spans.items(), key=lambda item: -item[1]):
        if name != "step":
            lines.append(f"| {name} | {ms:.2f} | {100 * ms / step:.1f}% |" if step else
                         f"| {name} | {ms:.2f} | |")
    lines.append("")
    return lines


def kernel_group(name):
    """A kernel's family for the shares: cuBLAS's GEMMs under one name."""
    lowered = name.lower()
    if "gemm" in lowered or lowered.startswith(("nvjet", "sm90_", "sm80_", "cutlass")):
        return "GEMM (cuBLAS)"
    return name


def summarize(argv):
    parser = argparse.ArgumentParser(prog="pytorch_gpt2.py summarize",
                                     description="markdown summary of a GPU benchmark session")
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="")
    parser.add_argument("--date", default="")
    parser.add_argument("--gpu", default="", help="the GPU's name (else from the results)")
    parser.add_argument("--status", default="",
                        help="TSV: step, exit status, seconds[, a test binary's tally]")
    parser.add_argument("--merged", default="", help="also write every input in one JSON file")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args(argv)
    ops, dstrain, pytorch, profiles, traces = [], [], [], [], []
    torch_version, gpu = "", args.gpu
    for path in args.files:
        base = os.path.basename(path)
        if base.startswith("trainer_") and base.endswith(".jsonl"):
            dstrain.append(trainer_row(path))
            continue
        if base.startswith("trace_") and base.endswith(".json"):
            try:
                traces.append((base[len("trace_"):-len(".json")], trace_spans(path)))
            except (OSError, ValueError, KeyError):
                pass  # a run that failed before writing it: its status says so
            continue
        if base.startswith("kernels_") and base.endswith(".csv"):
            profiles.append((base[len("kernels_"):-len(".csv")], *kernel_shares(path)))
            continue
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue  # a step that failed before writing its JSON: its status says so
        program = data.get("program")
        if program == "bench_cuda_ops":
            ops.append(data)
            gpu = gpu or data.get("device", "")
        elif program == "bench_train":
            dstrain += [dstrain_row(r) for r in data.get("rows", [])]
            gpu = gpu or data.get("gpu", "")
        elif program in ("pytorch_gpt2", "pytorch_llama"):
            pytorch += data.get("rows", [])
            torch_version = data.get("torch", "")
            gpu = gpu or data.get("device", "")
    if args.merged:
        with open(args.merged, "w") as f:
            json.dump({"commit": args.commit, "date": args.date, "bench_cuda_ops": ops,
                       "bench_train": dstrain, "pytorch": pytorch,
                       "kernel_profiles": [{"model": m, "kernel_ms": k, "total_ms": t}
                                           for m, k, t in profiles]}, f, indent=2)
            f.write("\n")
    lines = ["# dstrain GPU benchmarks", ""]
    lines.append(f"GPU: {gpu or 'unknown'}; date: {args.date or 'unknown'}; commit: "
                 f"{args.commit or 'unknown'}; PyTorch: {torch_version or 'not run'}.")
    lines.append("")
    if args.status and os.path.isfile(args.status):
        lines += ["## Steps", "", "| step | exit status | seconds | tests |", "|---|---|---|---|"]
        with open(args.status) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t") + [""]
                if len(parts) >= 4:
                    lines.append(f"| {parts[0]} | {parts[1]} | {parts[2]} | {parts[3]} |")
        lines.append("")

    if ops:
        lines += ["## Kernels (bench_cuda_ops) against the peaks measured in the same run", ""]
        for run in ops:
            p, s = run.get("peaks", {}), run.get("shape", {})
            gemms = ", ".join(f"{k[len('gemm_tflops_'):]} {v:.1f} TFLOP/s"
                              for k, v in p.items() if k.startswith("gemm_tflops_"))
            lines.append(f"- {run.get('dtype')} at B={s.get('B')} T={s.get('T')} C={s.get('C')} "
                         f"NH={s.get('NH')}: copy {fmt(p.get('copy_gb_per_s'))} GB/s; "
                         f"{p.get('gemm_n')}^3 cuBLAS GEMM {gemms}")
        lines.append("")
        header = "| op |" + "".join(f" {r.get('dtype')} C={r.get('shape', {}).get('C')} |"
                                     for r in ops)
        lines += [header, "|---|" + "---|" * len(ops)]
        names = []
        for run in ops:
            for row in run.get("ops", []):
                if row["op"] not in names:
                    names.append(row["op"])
        for name in names:
            cells = []
            for run in ops:
                row = next((r for r in run.get("ops", []) if r["op"] == name), None)
                if row is None:
                    cells.append("")
                elif "tflops" in row:
                    share = 100 * row["fraction_of_peak"]
                    cells.append(f"{row['tflops']:.1f} TFLOP/s ({share:.0f}%)")
                else:
                    share = 100 * row["fraction_of_peak"]
                    cells.append(f"{row['gb_per_s']:.0f} GB/s ({share:.0f}%)")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "Percentages: of the copy peak (GB/s rows) or of the run's dtype's GEMM "
                  "peak (TFLOP/s rows).", ""]

    if dstrain or pytorch:
        lines += ["## Training throughput, one GPU (tokens/s; MFU against the datasheet dense "
                  "peak)", ""]
        lines += ["| model | dtype | batch x seq | dstrain tokens/s | dstrain MFU | PyTorch eager "
                  "tokens/s | PyTorch compile tokens/s | PyTorch compile MFU | dstrain / eager | "
                  "dstrain / compile |", "|---|---|---|---|---|---|---|---|---|---|"]
        keys = []
        for r in dstrain + pytorch:
            key = (r["model"], r["dtype"], r["batch"], r["seq_len"])
            if key not in keys:
                keys.append(key)
        for key in keys:
            def find(rows, mode=None):
                for r in rows:
                    if (r["model"], r["dtype"], r["batch"], r["seq_len"]) == key and \
                            (mode is None or r.get("mode") == mode):
                        return r
                return None
            d, e, c = find(dstrain), find(pytorch, "eager"), find(pytorch, "compile")
            peak = next((r.get("peak_tflops") for r in (d, e, c) if r and r.get("peak_tflops")),
                        None)

            def tps(r):
                if r is None:
                    return "not run"
                if "tokens_per_s" not in r:
                    return "unavailable" if "unavailable" in r else "failed"
                return f"{r['tokens_per_s']:.0f}"

            def mfu(r):
                if r is None or "tflops" not in r or not peak:
                    return ""
                return f"{100 * r['tflops'] / peak:.1f}%"

            def ratio(a, b):
                if not a or not b or "tokens_per_s" not in a or "tokens_per_s" not in b:
                    return ""
                return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}"
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} x {key[3]} | {tps(d)} | {mfu(d)} | "
                         f"{tps(e)} | {tps(c)} | {mfu(c)} | {ratio(d, e)} | {ratio(d, c)} |")
        lines.append("")
        scopes = sorted({r["compile_scope"] for r in pytorch if "compile_scope" in r})
        if scopes:
            lines.append(f"torch.compile scope: {', '.join(scopes)} (model: the whole model in "
                         "one graph; blocks: each block and the head compiled on their own).")
        lines.append("Model FLOPs per token (src/parallel/model_flops.h): 3 x (L x (2 x the "
                     "multiply-adds of a layer's matrices + 4 T q) + 2 C Vp); GPT-2: 3 x (L x "
                     "(24 C^2 + 4 T C) + 2 C Vp). A `dstrain trainer` row is the dstrain binary "
                     "with the plan it chose (below).")
        for r in dstrain:
            if r.get("impl") == "dstrain trainer":
                lines.append(f"- {r['model']}: {r.get('plan')}; peak "
                             f"{format_bytes(r['peak_memory_bytes']) if 'peak_memory_bytes' in r else 'unknown'}.")
        lines += goals_lines(dstrain, pytorch, gpu)
        failures = [r for r in dstrain + pytorch if "error" in r or "unavailable" in r]
        if failures:
            lines += ["", "Failed or unavailable:"]
            for r in failures:
                who = "dstrain" if r.get("impl") == "dstrain" else f"PyTorch {r.get('mode')}"
                lines.append(f"- {who} {r['model']} {r['dtype']}: "
                             f"{r.get('error') or r.get('unavailable')}")
        lines.append("")
    for model, kernels, total in profiles:
        lines += profile_lines(model, kernels, total, dstrain)
    for model, spans in traces:
        lines += trace_lines(model, spans)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    return 0


def find_row(rows, model, dtype, mode=None):
    for r in rows:
        if r["model"] == model and r["dtype"] == dtype and (mode is None or r.get("mode") == mode):
            return r
    return None


def goals_lines(dstrain, pytorch, gpu):
    """Issue 34's goals against this run, and llmq's published numbers beside dstrain's."""
    lines = ["", "### Against llmq's published numbers (llmq's README, one H100) and issue 34's "
             f"goals (this run: {gpu or 'this GPU'})", "",
             "| model | dtype | dstrain tokens/s | llmq (H100, published) | dstrain / llmq |",
             "|---|---|---|---|---|"]
    for model, numbers in LLMQ_H100.items():
        for dtype, published in numbers.items():
            d = find_row(dstrain, model, dtype)
            ours = d.get("tokens_per_s") if d else None
            lines.append(f"| {model} | {dtype} | {fmt(ours, 0) or 'not run'} | {published:.0f} | "
                         f"{fmt(ours / published if ours else None, 2)} |")
    lines.append("")

    def ratio(model, dtype):
        d, c = find_row(dstrain, model, dtype), find_row(pytorch, model, dtype, "compile")
        if d and c and "tokens_per_s" in d and "tokens_per_s" in c:
            return d["tokens_per_s"] / c["tokens_per_s"]
        return None
    q = find_row(dstrain, "qwen2.5-0.5b", "bf16")
    q_tps = q.get("tokens_per_s") if q else None
    g = find_row(dstrain, "gpt2-1.5b", "bf16")
    g_mfu = g["tflops"] / g["peak_tflops"] if g and g.get("peak_tflops") and "tflops" in g else None
    goals = [("qwen2.5-0.5b bf16 >= 1.1 x llmq's 149k (H100)",
              q_tps / 149e3 if q_tps else None, 1.1),
             ("qwen2.5-0.5b bf16 >= 1.2 x torch.compile", ratio("qwen2.5-0.5b", "bf16"), 1.2),
             ("gpt2-1.5b bf16 >= 1.15 x torch.compile", ratio("gpt2-1.5b", "bf16"), 1.15),
             ("gpt2-1.5b bf16 MFU >= 55%", g_mfu, 0.55)]
    for text, value, goal in goals:
        state = "not measured" if value is None else ("met" if value >= goal else "not met")
        lines.append(f"- {text}: {fmt(value, 3) or '-'} ({state})")
    lines.append("")
    return lines


def profile_lines(model, kernels, total_ms, dstrain):
    """Each kernel's share of one step (cuBLAS's GEMMs together), and the step's time outside
    the kernels (launch gaps, host work) against bench_train's median step."""
    groups = {}
    for name, ms, launches in kernels:
        group = kernel_group(name)
        ms_before, launches_before = groups.get(group, (0.0, 0))
        groups[group] = (ms_before + ms, launches_before + launches)
    d = find_row(dstrain, model, "bf16")
    step_ms = d.get("ms_per_step") if d else None
    lines = ["", f"## Kernel shares of one {model} bf16 step (Nsight Compute, each launch timed "
             "alone)", ""]
    if step_ms:
        lines.append(f"Kernels {total_ms:.1f} ms of bench_train's median step {step_ms:.1f} ms: "
                     f"{100 * total_ms / step_ms:.0f}% (the rest: gaps between launches, the "
                     "host).")
    else:
        lines.append(f"Kernels {total_ms:.1f} ms in all.")
    lines += ["", "| kernel | ms | share of the kernels | launches |", "|---|---|---|---|"]
    for group, (ms, launches) in sorted(groups.items(), key=lambda item: -item[1][0]):
        lines.append(f"| {group} | {ms:.2f} | {100 * ms / total_ms:.1f}% | {launches} |")
    lines.append("")
    return lines


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "summarize":
        sys.exit(summarize(sys.argv[2:]))
    sys.exit(benchmark(sys.argv[1:]))
