// Training-step throughput: forward + backward + clip + AdamW of one rank on random tokens, the
// way the trainer runs a step (src/train/trainer.cpp): the rank's backend and memory from
// train/devices.h, a ShardedModel with the working dtype, the fp16 loss scaler, the default
// AdamW settings and LR warmup. Prints a table of ms/step, tokens/s, achieved model FLOP/s and
// MFU against a peak, one row per (model, dtype); --json writes the same rows.
//
//   bench_train [--device cpu|cuda] [--dtype fp32|fp16|bf16|fp8[,...]] [--recompute
//   none|selective|full]
//               [--models tiny,gpt2-124m] [--batch B] [--seq-len T] [--steps N] [--warmup N]
//               [--threads N] [--peak-tflops X] [--attention-warp-rows 16|32] [--json FILE]
//
// Defaults: cpu: fp32, tiny at 16 x 64 and gpt2-124m at 4 x 128, 1 warm-up and 3 timed steps;
// cuda: gpt2-124m, 8 x 1024, 3 warm-up and 10 timed steps. The warm-up steps are not timed;
// each timed step ends with a synchronize of the device before the clock is read, and the
// table reports the median step. The peak (MFU) is --peak-tflops, else on cuda the dense
// fp16/bf16 tensor peak of the detected GPU in topology/gpu_table.cpp; otherwise left blank.
// --attention-warp-rows 32 (cuda) runs the tensor-core attention with 32 rows per warp where it
// has that form (set_cuda_attention_warp_rows in kernels/cuda/cuda_backend.h), to time a whole
// step both ways.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_main.h"
#include "comm/communicator.h"
#include "core/allocator.h"
#include "core/check.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/architecture.h"
#include "model/layout.h"
#include "model/stage.h"
#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "optim/schedule.h"
#include "parallel/cost_model.h"
#include "parallel/sharded_model.h"
#include "topology/gpu_table.h"
#include "topology/probe.h"
#include "train/devices.h"
#include "train/options.h"
#include "train/weights_io.h"
#ifdef DSTRAIN_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

using namespace dstrain;

namespace {

constexpr const char* kUsage =
    "usage: bench_train [--device cpu|cuda] [--dtype fp32|fp16|bf16|fp8[,...]] "
    "[--recompute none|selective|full] [--models a,b] [--batch B] [--seq-len T] [--steps N] "
    "[--warmup N] [--threads N] [--peak-tflops X] [--attention-warp-rows 16|32] [--json FILE]";

struct Options {
  std::string device = "cpu";
  std::vector<std::string> dtypes;  // empty: fp32
  std::string recompute = "none";
  std::vector<std::string> models;  // empty: the device's default
  int64_t batch = 0, seq_len = 0;   // 0: the default of the model and device
  int steps = -1, warmup = -1;      // -1: the device's default
  int threads = 0;                  // 0: all cores
  double peak_tflops = 0;           // 0: from the GPU table (cuda), else none
  int attention_warp_rows = 16;     // the CUDA attention's rows per warp: 16 or 32
  std::string json;
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      DSTRAIN_USER_CHECK(i + 1 < argc) << arg << " needs a value; " << kUsage;
      return argv[++i];
    };
    if (arg == "--device") {
      o.device = value();
      DSTRAIN_USER_CHECK(o.device == "cpu" || o.device == "cuda")
          << "--device must be cpu or cuda, not '" << o.device << "'";
    } else if (arg == "--dtype") {
      o.dtypes = split_list(value());
      DSTRAIN_USER_CHECK(!o.dtypes.empty()) << "--dtype needs fp32, fp16, bf16 or fp8";
      for (const std::string& d : o.dtypes) {
        DSTRAIN_USER_CHECK(d == "fp32" || d == "fp16" || d == "bf16" || d == "fp8")
            << "--dtype takes fp32, fp16, bf16 or fp8 (or a comma list of them), not '" << d << "'";
      }
    } else if (arg == "--recompute") {
      o.recompute = value();
      (void)parse_recompute(o.recompute);  // a UserError naming the choices
    } else if (arg == "--models") {
      o.models = split_list(value());
      DSTRAIN_USER_CHECK(!o.models.empty()) << "--models needs at least one model";
    } else if (arg == "--batch") {
      o.batch = parse_int(arg, value(), 1);
    } else if (arg == "--seq-len") {
      o.seq_len = parse_int(arg, value(), 1);
    } else if (arg == "--steps") {
      o.steps = static_cast<int>(parse_int(arg, value(), 1));
    } else if (arg == "--warmup") {
      o.warmup = static_cast<int>(parse_int(arg, value(), 0));
    } else if (arg == "--threads") {
      o.threads = static_cast<int>(parse_int(arg, value(), 1));
    } else if (arg == "--peak-tflops") {
      const std::string text = value();
      char* end = nullptr;
      o.peak_tflops = std::strtod(text.c_str(), &end);
      DSTRAIN_USER_CHECK(end != text.c_str() && *end == '\0' && o.peak_tflops > 0)
          << "--peak-tflops takes a positive number (TFLOP/s), not '" << text << "'";
    } else if (arg == "--attention-warp-rows") {
      const std::string text = value();
      DSTRAIN_USER_CHECK(text == "16" || text == "32")
          << "--attention-warp-rows takes 16 or 32, not '" << text << "'";
      o.attention_warp_rows = text == "32" ? 32 : 16;
    } else if (arg == "--json") {
      o.json = value();
    } else {
      DSTRAIN_USER_ERROR() << "unknown argument '" << arg << "'; " << kUsage;
    }
  }
  const bool cuda = o.device == "cuda";
  DSTRAIN_USER_CHECK(cuda || o.attention_warp_rows == 16)
      << "--attention-warp-rows sets the CUDA attention kernels: it needs --device cuda";
  if (o.dtypes.empty()) o.dtypes = {"fp32"};
  if (o.models.empty())
    o.models = cuda ? std::vector<std::string>{"gpt2-124m"}
                    : std::vector<std::string>{"tiny", "gpt2-124m"};
  if (o.steps < 0) o.steps = cuda ? 10 : 3;
  if (o.warmup < 0) o.warmup = cuda ? 3 : 1;
  if (o.threads <= 0)
    o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return o;
}

// The model FLOPs of one training step, in the planner's convention (parallel/cost_model.h,
// model_flops): forward + backward = 3 x forward; recomputation is not counted.
double step_model_flops(const ModelConfig& config, int64_t B, int64_t T) {
  const ModelFlops f = model_flops(config, T);
  return 3.0 * static_cast<double>(B * T) *
         (static_cast<double>(config.n_layer) * f.layer_forward + f.head_forward);
}

// What the peak of --dtype on this device is, and where it comes from.
struct Peak {
  double tflops = 0;  // 0: unknown
  std::string source;
};

Peak find_peak(const Options& o, const std::string& dtype, const std::string& gpu_name) {
  if (o.peak_tflops > 0) return {o.peak_tflops, "--peak-tflops"};
  if (o.device != "cuda" || dtype == "fp32") return {};
  const KnownGpu* known = find_known_gpu(gpu_name);
  if (known == nullptr) return {};
  // fp8: MFU against the bf16 peak, as for the bf16 run of the same model (its model FLOPs are
  // the same; only the layers' GEMMs run at the FP8 rate).
  const double tflops = dtype == "fp16" ? known->fp16_tflops : known->bf16_tflops;
  if (tflops <= 0) return {};
  return {tflops, "dense " + std::string(dtype == "fp16" ? "fp16" : "bf16") +
                      " tensor peak of the " + known->key + " in topology/gpu_table.cpp"};
}

struct Result {
  std::string model, dtype;
  int64_t params = 0, batch = 0, seq_len = 0;
  double median_s = 0, mean_s = 0, tokens_per_s = 0, flops_per_s = 0, peak_tflops = 0;
  int timed_steps = 0, skipped_steps = 0;
  size_t peak_device_bytes = 0;
  double final_loss = 0;
  double init_s = 0, setup_s = 0;  // host init of the weights; the rank's state and buffers
  std::string error;               // non-empty: the case failed
};

// Runs warmup + steps training steps of `config` on one rank of `devices`, starting from
// `initial` (host F32 blocks), and times the last `steps`.
Result run_case(const Options& o, const RunDevices& devices, const ModelConfig& config,
                const HostBlocks& initial, const std::string& dtype_name, int64_t B, int64_t T,
                std::string* backend_name) {
  Result r;
  r.model = config.name;
  r.dtype = dtype_name;
  r.params = config.num_parameters();
  r.batch = B;
  r.seq_len = T;
  // fp8: bf16 with the layers' GEMMs in FP8 (--precision fp8, model/fp8_linear.h).
  const bool fp8 = dtype_name == "fp8";
  const DType dtype = fp8 ? DType::BF16 : parse_dtype(dtype_name);
  std::vector<double> times;
  const auto setup_start = std::chrono::steady_clock::now();
  launch_ranks(devices, 3600.0, [&](Communicator& launched) {
    RankDevices rank = make_rank_devices(devices, launched, o.threads);
    Backend& backend = *rank.backend;
    *backend_name = backend.name();
    ShardingConfig sharding;
    sharding.param_dtype = dtype;
    sharding.host_threads = o.threads;
    const Stream compute = rank.compute.get();
    ShardedModel state(config, sharding, *rank.comm, backend, *rank.device, *rank.host, compute);
    state.set_full_params(initial.tensors());
    const std::unique_ptr<Architecture> arch =
        make_architecture(config, {}, {}, Fp8Options{fp8, fp8});
    ModelStage model(*arch, whole_model(config), backend, *rank.device, B, T, dtype, true,
                     parse_recompute(o.recompute), 1);

    // Random tokens (B*T + 1 of them: targets are the inputs shifted by one), in the device
    // memory the model reads, uploaded once: every step trains on the same batch.
    std::vector<int32_t> tokens(static_cast<size_t>(B * T + 1));
    Rng rng(2);
    for (int32_t& token : tokens)
      token = static_cast<int32_t>(rng.below(uint64_t(config.vocab_size)));
    const size_t batch_bytes = 2 * static_cast<size_t>(B * T) * sizeof(int32_t);
    Buffer batch = rank.device->allocate(MemCategory::Data, batch_bytes);
    backend.copy_bytes(batch.data(), tokens.data(), batch_bytes / 2, compute);
    backend.copy_bytes(static_cast<int32_t*>(batch.data()) + B * T, tokens.data() + 1,
                       batch_bytes / 2, compute);
    backend.synchronize(compute);
    Tensor inputs = batch.view(DType::I32, {B, T});
    Tensor targets = inputs;
    targets.data = static_cast<int32_t*>(batch.data()) + B * T;

    // The trainer's defaults (train/options.h): AdamW, peak LR, warmup; cosine over the run.
    const TrainOptions defaults;
    const AdamWConfig adam{defaults.beta1, defaults.beta2, defaults.eps, defaults.weight_decay,
                           defaults.grad_clip};
    const int total = o.warmup + o.steps;
    const LrScheduleConfig schedule{parse_lr_schedule(defaults.lr_schedule), defaults.lr,
                                    defaults.lr / 10, defaults.warmup, total};
    GradScaler scaler(dtype == DType::F16);
    int64_t adam_step = 0;
    r.setup_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();
    for (int step = 0; step < total; ++step) {
      const auto start = std::chrono::steady_clock::now();
      const double loss_scale = scaler.scale();
      state.begin_step();
      const double loss = model.forward(state, 0, B, T, inputs, targets,
                                        static_cast<float>(loss_scale / double(B * T)), compute);
      state.last_micro_batch();
      model.backward(state, 0, inputs, compute);
      const StepStats stats =
          state.finish_step(adam, learning_rate(schedule, step), adam_step + 1, loss_scale);
      const bool skipped = scaler.update(stats.found_inf);
      if (!skipped) ++adam_step;
      backend.synchronize(compute);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      DSTRAIN_CHECK(std::isfinite(loss)) << "the loss became " << loss << " at step " << step + 1;
      DSTRAIN_CHECK(!stats.found_inf || scaler.enabled())
          << "the gradients hold inf or NaN at step " << step + 1;
      if (step < o.warmup) continue;
      times.push_back(seconds);
      if (skipped) ++r.skipped_steps;
      r.final_loss = loss;
    }
    r.peak_device_bytes = rank.device->stats().peak_total;
  });
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  r.timed_steps = static_cast<int>(times.size());
  r.median_s = sorted[sorted.size() / 2];
  for (double t : times) r.mean_s += t / static_cast<double>(times.size());
  r.tokens_per_s = static_cast<double>(B * T) / r.median_s;
  r.flops_per_s = step_model_flops(config, B, T) / r.median_s;
  return r;
}

std::string format_fixed(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", decimals, value);
  return text;
}

nlohmann::json to_json(const Result& r, const Options& o) {
  nlohmann::json j{{"impl", "dstrain"}, {"device", o.device},       {"model", r.model},
                   {"dtype", r.dtype},  {"recompute", o.recompute}, {"params", r.params},
                   {"batch", r.batch},  {"seq_len", r.seq_len}};
  if (o.device == "cuda") j["attention_warp_rows"] = o.attention_warp_rows;
  if (!r.error.empty()) {
    j["error"] = r.error;
    return j;
  }
  j["timed_steps"] = r.timed_steps;
  j["skipped_steps"] = r.skipped_steps;
  j["ms_per_step"] = r.median_s * 1e3;
  j["mean_ms_per_step"] = r.mean_s * 1e3;
  j["tokens_per_s"] = r.tokens_per_s;
  j["tflops"] = r.flops_per_s / 1e12;
  j["peak_memory_bytes"] = r.peak_device_bytes;
  j["final_loss"] = r.final_loss;
  j["init_s"] = r.init_s;
  j["setup_s"] = r.setup_s;
  if (r.peak_tflops > 0) {
    j["peak_tflops"] = r.peak_tflops;
    j["mfu"] = r.flops_per_s / 1e12 / r.peak_tflops;
  }
  return j;
}

int run(const Options& o) {
  // --device cuda without the backend or a GPU: one sentence (UserError) before anything runs.
  const RunDevices devices = choose_devices(o.device, 1);
  const bool cuda = devices.cuda;
  std::string gpu_name;
#ifdef DSTRAIN_WITH_CUDA
  if (cuda) set_cuda_attention_warp_rows(o.attention_warp_rows);
#endif
  if (cuda) {
    std::string report;
    const NodeTopology topology = probe_local_topology(&report);
    if (topology.gpu_count() > 0) gpu_name = topology.gpus[0].name;
  }
  // The FLOP/s column: TFLOP/s on a GPU, GFLOP/s on the CPU (where TFLOP/s round to 0.0).
  const double unit = cuda ? 1e12 : 1e9;
  const char* unit_name = cuda ? "TFLOP/s" : "GFLOP/s";

  std::vector<Result> results;
  std::vector<std::string> peak_sources;
  std::string backend_name = cuda ? "cuda" : "cpu";
  bool header_printed = false;
  for (const std::string& model_name : o.models) {
    const ModelConfig config = load_model_config(model_name);
    const bool small = config.num_parameters() < 1000000;  // tiny, llama-tiny
    const int64_t B = o.batch ? o.batch : (cuda ? 8 : (small ? 16 : 4));
    const int64_t T = o.seq_len
                          ? o.seq_len
                          : std::min<int64_t>(config.n_positions, cuda ? 1024 : (small ? 64 : 128));
    DSTRAIN_USER_CHECK(T <= config.n_positions)
        << "--seq-len " << T << " is longer than " << config.name << "'s n_positions "
        << config.n_positions;
    // The starting weights, on the host, once per model (every dtype starts from them).
    const ParamLayout layout(config);
    const auto init_start = std::chrono::steady_clock::now();
    HostBlocks initial(layout);
    init_model_parameters(layout, config, 1, initial.tensors());
    const double init_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - init_start).count();
    for (const std::string& dtype : o.dtypes) {
      Result r;
      try {
        r = run_case(o, devices, config, initial, dtype, B, T, &backend_name);
      } catch (const std::exception& e) {
        r.model = config.name;
        r.dtype = dtype;
        r.params = config.num_parameters();
        r.batch = B;
        r.seq_len = T;
        r.error = e.what();
      }
      r.init_s = init_s;
      const Peak peak = find_peak(o, dtype, gpu_name);
      r.peak_tflops = peak.tflops;
      if (!peak.source.empty() &&
          std::find(peak_sources.begin(), peak_sources.end(), peak.source) == peak_sources.end()) {
        peak_sources.push_back(peak.source);
      }
      if (!header_printed) {
        std::printf("bench_train: 1 rank on %s (%s), recompute %s, %d warm-up + %d timed steps%s\n",
                    devices.describe().c_str(), backend_name.c_str(), o.recompute.c_str(), o.warmup,
                    o.steps, o.attention_warp_rows == 32 ? ", attention 32 rows per warp" : "");
        std::printf(
            "| model | params | dtype | batch x seq | ms/step | tokens/s | %s | peak %s "
            "| MFU | fp16 skipped | peak memory |\n",
            unit_name, unit_name);
        std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
        header_printed = true;
      }
      if (!r.error.empty()) {
        std::printf("| %s | %.1fM | %s | %lld x %lld | failed: %s |\n", r.model.c_str(),
                    double(r.params) / 1e6, r.dtype.c_str(), (long long)B, (long long)T,
                    r.error.c_str());
      } else {
        const std::string peak_text =
            r.peak_tflops > 0 ? format_fixed(r.peak_tflops * 1e12 / unit, 1) : "";
        const std::string mfu_text =
            r.peak_tflops > 0
                ? format_fixed(100.0 * r.flops_per_s / (r.peak_tflops * 1e12), 1) + "%"
                : "";
        std::printf(
            "| %s | %.1fM | %s | %lld x %lld | %.1f | %.0f | %.1f | %s | %s | %d of %d | %s |\n",
            r.model.c_str(), double(r.params) / 1e6, r.dtype.c_str(), (long long)B, (long long)T,
            r.median_s * 1e3, r.tokens_per_s, r.flops_per_s / unit, peak_text.c_str(),
            mfu_text.c_str(), r.skipped_steps, r.timed_steps,
            format_bytes(r.peak_device_bytes).c_str());
      }
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  std::printf(
      "\nms/step: median of the timed steps (each ends with a device synchronize). Model FLOPs "
      "(src/parallel/model_flops.h, PaLM's convention): per token 3 x (L x (2 x the multiply-adds "
      "of a layer's matrices + 4 T C) + 2 C Vp) (GPT-2: 24 C^2 + 4 T C a layer), attention without the causal halving, recomputation not counted. MFU = "
      "achieved / peak; peak: %s. Peak memory: the allocator's (parameters, optimizer state, "
      "activations, workspace), without the backend's scratch pool.\n",
      peak_sources.empty() ? "none known (give --peak-tflops)" : [&] {
        std::string text;
        for (const std::string& s : peak_sources) text += (text.empty() ? "" : "; ") + s;
        return text;
      }().c_str());

  bool failed = false;
  for (const Result& r : results) failed = failed || !r.error.empty();
  if (!o.json.empty()) {
    nlohmann::json out{{"program", "bench_train"},
                       {"backend", backend_name},
                       {"devices", devices.describe()},
                       {"gpu", gpu_name},
                       {"warmup", o.warmup},
                       {"steps", o.steps},
                       {"flops_convention",
                        "per token 3 x (L x (2 x the multiply-adds of a layer's matrices + 4 T C) + 2 C Vp) "
                        "(model_flops.h)"},
                       {"rows", nlohmann::json::array()}};
    for (const Result& r : results) out["rows"].push_back(to_json(r, o));
    std::ofstream file(o.json);
    file << out.dump(2) << "\n";
    DSTRAIN_USER_CHECK(file.good()) << "cannot write --json " << o.json;
  }
  if (failed) std::fprintf(stderr, "bench_train: a case failed; its row above says why\n");
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int cases_status = 0;
  const int status =
      benchmark_main("bench_train", [&] { cases_status = run(parse_options(argc, argv)); });
  return status != 0 ? status : cases_status;
}
