// Training-step throughput on the CPU backend: forward + backward + clip + AdamW, one rank,
// fp32, random tokens. Prints a table of tokens/s and achieved GFLOP/s per model.
//
//   bench_train [--threads N] [--steps N] [--models tiny,gpt2-124m] [--batch B] [--seq-len T]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/allocator.h"
#include "core/rng.h"
#include "model/gpt2.h"
#include "comm/communicator.h"
#include "parallel/sharded_model.h"

using namespace dstrain;

namespace {

struct Case {
  std::string model;
  int64_t batch, seq_len;
};

// Model FLOPs of one training step (forward + backward = 3x forward): 6 per parameter per
// token for the matmuls (the tied head counted once, as a matmul), plus causal attention
// scores and values, 6 * L * T * C per token (half of the non-causal 12 L T C).
double step_flops(const ModelConfig& config, int64_t B, int64_t T) {
  const double C = double(config.n_embd), L = double(config.n_layer);
  const double matmul_params = L * 12.0 * C * C + double(config.vocab_size) * C;
  const double tokens = double(B * T);
  return tokens * (6.0 * matmul_params + 6.0 * L * double(T) * C);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0, steps = 3;
  int64_t batch = 0, seq_len = 0;
  std::string models = "tiny,gpt2-124m";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_train: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--threads") threads = std::atoi(next().c_str());
    else if (arg == "--steps") steps = std::atoi(next().c_str());
    else if (arg == "--models") models = next();
    else if (arg == "--batch") batch = std::atoll(next().c_str());
    else if (arg == "--seq-len") seq_len = std::atoll(next().c_str());
    else {
      std::fprintf(stderr, "usage: bench_train [--threads N] [--steps N] [--models a,b] "
                           "[--batch B] [--seq-len T]\n");
      return 2;
    }
  }
  if (threads <= 0) threads = int(std::thread::hardware_concurrency());
  std::vector<Case> cases;
  std::stringstream list(models);
  for (std::string name; std::getline(list, name, ',');) {
    const bool small = name == "tiny";
    cases.push_back({name, batch ? batch : (small ? 16 : 4), seq_len ? seq_len : (small ? 64 : 128)});
  }

  std::printf("CPU backend training step, fp32, 1 rank, %d threads, %d timed steps after 1 warm-up\n",
              threads, steps);
  std::printf("| model | params | batch x seq | ms/step | tokens/s | GFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    const ModelConfig config = load_model_config(c.model);
    std::vector<double> times;
    run_local_ranks(1, 600.0, [&](Communicator& comm) {
      auto backend = make_cpu_backend(threads);
      auto allocator = make_cpu_allocator();
      ShardedModel state(config, ShardingConfig{}, comm, *backend, *allocator, *allocator);
      const ParamLayout layout(config);
      std::vector<std::vector<float>> storage;
      std::vector<Tensor> flats;
      for (int block = 0; block < layout.num_blocks(); ++block) {
        storage.emplace_back(size_t(layout.block_numel(block)));
        flats.emplace_back(storage.back().data(), DType::F32,
                           std::initializer_list<int64_t>{layout.block_numel(block)});
      }
      init_gpt2_parameters(layout, config, 1, flats);
      state.set_full_params(flats);
      Gpt2 model(config, *backend, *allocator, c.batch, c.seq_len, DType::F32, true);
      std::vector<int32_t> tokens(size_t(c.batch * c.seq_len + 1));
      Rng rng(2);
      for (int32_t& token : tokens) token = int32_t(rng.below(uint64_t(config.vocab_size)));
      Tensor inputs(tokens.data(), DType::I32, {c.batch, c.seq_len});
      Tensor targets(tokens.data() + 1, DType::I32, {c.batch, c.seq_len});
      const AdamWConfig adam;
      for (int step = 0; step <= steps; ++step) {
        const auto start = std::chrono::steady_clock::now();
        state.begin_step();
        model.forward(state, inputs, targets, 1.0f / float(c.batch * c.seq_len), nullptr);
        model.backward(state, inputs, nullptr);
        state.finish_step(adam, 1e-4, step + 1, 1.0);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (step > 0) times.push_back(seconds);  // step 0 warms up
      }
    });
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    const double tokens_per_s = double(c.batch * c.seq_len) / median;
    std::printf("| %s | %.1fM | %lld x %lld | %.1f | %.0f | %.1f |\n", c.model.c_str(),
                double(config.num_parameters()) / 1e6, (long long)c.batch, (long long)c.seq_len,
                median * 1e3, tokens_per_s, step_flops(config, c.batch, c.seq_len) / median / 1e9);
    std::fflush(stdout);
  }
  return 0;
}
