// Host AdamW (ZeRO-Offload) against the CPU backend's Backend::adamw: bitwise equal for every
// ISA level this CPU runs, thread counts 1..3, fp32/fp16/bf16 gradients and fp16/bf16 copies.
#include "optim/host_adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"

namespace dstrain {
namespace {

// Values of mixed magnitude, |x| in 1e-6..1e3 (log-uniform), random sign, and about
// `zero_fraction` exact zeros.
std::vector<float> mixed_values(Rng& rng, int64_t n, double zero_fraction, bool positive) {
  std::vector<float> values(static_cast<size_t>(n));
  for (float& value : values) {
    if (rng.uniform() < zero_fraction) {
      value = 0.0f;
      continue;
    }
    const float magnitude = static_cast<float>(std::pow(10.0, -6.0 + 9.0 * rng.uniform()));
    value = (positive || rng.uniform() < 0.5) ? magnitude : -magnitude;
  }
  return values;
}

// A host buffer with guard regions on both sides that must come back untouched. The guard
// length is odd so the data starts unaligned.
template <class T>
class Guarded {
 public:
  static constexpr int64_t kGuard = 67;
  explicit Guarded(const std::vector<T>& values)
      : n_(static_cast<int64_t>(values.size())), storage_(values.size() + 2 * kGuard) {
    std::memset(storage_.data(), 0xA5, storage_.size() * sizeof(T));
    // (memcpy from an empty vector's null data() is undefined, even for 0 bytes: UBSan)
    if (!values.empty()) std::memcpy(data(), values.data(), values.size() * sizeof(T));
  }
  T* data() { return storage_.data() + kGuard; }
  bool guards_intact() const {
    const auto* bytes = reinterpret_cast<const unsigned char*>(storage_.data());
    const size_t guard_bytes = kGuard * sizeof(T);
    const size_t tail = (kGuard + n_) * sizeof(T);
    for (size_t i = 0; i < guard_bytes; ++i) {
      if (bytes[i] != 0xA5 || bytes[tail + i] != 0xA5) return false;
    }
    return true;
  }

 private:
  int64_t n_;
  std::vector<T> storage_;
};

struct State {
  std::vector<float> param, m, v;  // (n) each
};

// fresh: the first step of a run (m = v = 0); else moments as after many steps.
State random_state(Rng& rng, int64_t n, bool fresh) {
  State state;
  state.param = mixed_values(rng, n, 0.01, false);
  state.m = fresh ? std::vector<float>(n, 0.0f) : mixed_values(rng, n, 0.01, false);
  state.v = fresh ? std::vector<float>(n, 0.0f) : mixed_values(rng, n, 0.01, true);
  return state;
}

std::vector<uint16_t> to_16bit(const std::vector<float>& values, DType dtype) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] = dtype == DType::F16 ? fp32_to_fp16_bits(values[i]) : fp32_to_bf16_bits(values[i]);
  }
  return bits;
}

std::string hex_bits(float value) {
  char text[16];
  std::snprintf(text, sizeof(text), "%08x", float_bits(value));
  return text;
}
std::string hex_bits(uint16_t value) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04x", value);
  return text;
}

// Bitwise comparison; on failure names the first mismatches and dumps them, with `inputs(i)`
// describing element i's inputs, to a file named after the case.
template <class T, class Inputs>
::testing::AssertionResult bitwise_equal(const std::string& case_name, const char* what,
                                         const T* expected, const T* actual, int64_t n,
                                         Inputs inputs) {
  if (std::memcmp(expected, actual, static_cast<size_t>(n) * sizeof(T)) == 0) {
    return ::testing::AssertionSuccess();
  }
  const std::string path = ::testing::TempDir() + "host_adamw_" + case_name + ".txt";
  FILE* dump = std::fopen(path.c_str(), "w");
  std::string first;
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(&expected[i], &actual[i], sizeof(T)) == 0) continue;
    const std::string line = std::string(what) + "[" + std::to_string(i) + "]: reference " +
                             hex_bits(expected[i]) + " (" + std::to_string(float(expected[i])) +
                             "), host " + hex_bits(actual[i]) + " (" +
                             std::to_string(float(actual[i])) + "); inputs " + inputs(i);
    if (dump != nullptr && mismatches < 1000) std::fprintf(dump, "%s\n", line.c_str());
    if (mismatches < 3) first += "\n  " + line;
    ++mismatches;
  }
  if (dump != nullptr) std::fclose(dump);
  return ::testing::AssertionFailure()
         << case_name << ": " << mismatches << " of " << n << " elements of " << what
         << " differ (dump: " << path << "):" << first;
}

struct Case {
  HostAdamWIsa isa = HostAdamWIsa::Auto;
  int threads = 1;
  int64_t n = 100003;  // not a multiple of 16: every vector level has a tail
  DType grad_dtype = DType::F32;
  bool copy = false;
  DType copy_dtype = DType::F16;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float weight_decay = 0.0f;
  float grad_scale = 1.0f;
  bool fresh = true;       // start from m = v = 0
  int64_t first_step = 1;  // 1-based
  int steps = 4;
  bool copy_aliases_grad = false;  // host side writes the copy over its 16-bit grad buffer

  std::string name() const {
    std::string text = std::string(host_adamw_isa_name(isa)) + "_t" + std::to_string(threads) +
                       "_n" + std::to_string(n) + "_g" + dtype_name(grad_dtype);
    if (copy) text += std::string("_copy") + dtype_name(copy_dtype);
    if (copy_aliases_grad) text += "_aliased";
    if (weight_decay != 0.0f) text += "_wd";
    if (grad_scale != 1.0f) text += "_scaled";
    if (beta1 != 0.9f) text += "_beta1_" + std::to_string(beta1);
    text += "_step" + std::to_string(first_step);
    return text;
  }
};

// Runs `c.steps` AdamW steps on the reference backend and on host_adamw from the same random
// state and gradients, requiring every output bit to agree after every step.
void expect_matches_reference(const Case& c) {
  const std::string name = c.name();
  SCOPED_TRACE(name);
  Rng rng(hash_name(name));
  const int64_t n = c.n;
  State reference = random_state(rng, n, c.fresh);
  const State initial = reference;
  Guarded<float> param(reference.param), m(reference.m), v(reference.v);
  std::vector<uint16_t> reference_copy(static_cast<size_t>(n), 0);
  Guarded<uint16_t> host_copy(reference_copy);
  auto backend = make_cpu_backend(1);
  for (int s = 0; s < c.steps; ++s) {
    AdamWStep step;
    step.lr = c.lr;
    step.beta1 = c.beta1;
    step.weight_decay = c.weight_decay;
    step.grad_scale = c.grad_scale;
    step.step = c.first_step + s;
    const std::vector<float> grad_values = mixed_values(rng, n, 0.05, false);
    std::vector<float> grad_f32 = grad_values;
    std::vector<uint16_t> grad_16 =
        c.grad_dtype == DType::F32 ? std::vector<uint16_t>() : to_16bit(grad_values, c.grad_dtype);
    void* reference_grad = c.grad_dtype == DType::F32 ? static_cast<void*>(grad_f32.data())
                                                      : static_cast<void*>(grad_16.data());
    Guarded<float> host_grad_f32(grad_f32);
    Guarded<uint16_t> host_grad_16(grad_16);
    void* host_grad = c.grad_dtype == DType::F32 ? static_cast<void*>(host_grad_f32.data())
                                                 : static_cast<void*>(host_grad_16.data());
    uint16_t* host_copy_data = c.copy_aliases_grad ? host_grad_16.data() : host_copy.data();
    const State before = reference;

    backend->adamw(
        Tensor(reference.param.data(), DType::F32, {n}), Tensor(reference_grad, c.grad_dtype, {n}),
        Tensor(reference.m.data(), DType::F32, {n}), Tensor(reference.v.data(), DType::F32, {n}),
        c.copy ? Tensor(reference_copy.data(), c.copy_dtype, {n}) : Tensor(), step, nullptr);
    host_adamw_with(c.isa, param.data(), host_grad, c.grad_dtype, m.data(), v.data(),
                    c.copy ? host_copy_data : nullptr, c.copy_dtype, n, step, c.threads);

    auto inputs = [&](int64_t i) {
      const float g = c.grad_dtype == DType::F32   ? grad_f32[i]
                      : c.grad_dtype == DType::F16 ? fp16_bits_to_fp32(grad_16[i])
                                                   : bf16_bits_to_fp32(grad_16[i]);
      return "param " + hex_bits(before.param[i]) + " grad " + hex_bits(g) + " m " +
             hex_bits(before.m[i]) + " v " + hex_bits(before.v[i]) + " step " +
             std::to_string(step.step);
    };
    const std::string step_name = name + "_s" + std::to_string(step.step);
    ASSERT_TRUE(bitwise_equal(step_name, "param", reference.param.data(), param.data(), n, inputs));
    ASSERT_TRUE(bitwise_equal(step_name, "m", reference.m.data(), m.data(), n, inputs));
    ASSERT_TRUE(bitwise_equal(step_name, "v", reference.v.data(), v.data(), n, inputs));
    if (c.copy) {
      ASSERT_TRUE(
          bitwise_equal(step_name, "param_copy", reference_copy.data(), host_copy_data, n, inputs));
    }
    ASSERT_TRUE(param.guards_intact() && m.guards_intact() && v.guards_intact() &&
                host_copy.guards_intact() && host_grad_f32.guards_intact() &&
                host_grad_16.guards_intact())
        << "a write outside [0, n)";
  }
  // The test must not pass on a no-op: most weights moved, and the state is not all zero.
  int64_t moved = 0;
  double norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    moved += reference.param[i] != initial.param[i];
    norm += double(reference.v[i]) * reference.v[i];
  }
  EXPECT_GT(moved, n / 2);
  EXPECT_GT(norm, 0.0);
}

class HostAdamWLevel : public ::testing::TestWithParam<HostAdamWIsa> {
 protected:
  void SetUp() override {
    if (!host_adamw_isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU lacks the " << host_adamw_isa_name(GetParam())
                   << " level (best: " << host_adamw_isa() << ")";
    }
  }
};

TEST_P(HostAdamWLevel, F32BitwiseEqualsCpuBackend) {
  for (int threads : {1, 2, 3}) {
    for (float weight_decay : {0.0f, 0.1f}) {
      for (float grad_scale : {1.0f, 0.37f}) {
        for (bool fresh : {true, false}) {
          Case c;
          c.isa = GetParam();
          c.threads = threads;
          c.weight_decay = weight_decay;
          c.grad_scale = grad_scale;
          c.fresh = fresh;
          c.first_step = fresh ? 1 : 1000;
          c.steps = fresh ? 4 : 2;
          expect_matches_reference(c);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST_P(HostAdamWLevel, F32OddSizesAndTails) {
  for (int64_t n : {1, 5, 8, 15, 16, 17, 31, 33, 37, 16384 * 2 + 9}) {
    Case c;
    c.isa = GetParam();
    c.threads = 3;
    c.n = n;
    c.weight_decay = 0.1f;
    c.grad_scale = 0.5f;
    expect_matches_reference(c);
    if (HasFatalFailure()) return;
  }
}

// 1 - beta1 >= 0.5 takes ATen's other lerp formula (0.5 itself included).
TEST_P(HostAdamWLevel, F32MirroredLerpBranch) {
  for (float beta1 : {0.3f, 0.5f}) {
    Case c;
    c.isa = GetParam();
    c.threads = 2;
    c.beta1 = beta1;
    c.weight_decay = 0.1f;
    expect_matches_reference(c);
    if (HasFatalFailure()) return;
  }
}

TEST_P(HostAdamWLevel, SixteenBitGradsAndCopies) {
  for (DType grad_dtype : {DType::F32, DType::F16, DType::BF16}) {
    for (int copy : {0, 1, 2}) {
      for (int threads : {1, 3}) {
        Case c;
        c.isa = GetParam();
        c.threads = threads;
        c.grad_dtype = grad_dtype;
        c.copy = copy != 0;
        c.copy_dtype = copy == 2 ? DType::BF16 : DType::F16;
        c.weight_decay = 0.1f;
        c.grad_scale = 0.37f;
        c.steps = 3;
        expect_matches_reference(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_P(HostAdamWLevel, CopyMayAliasSixteenBitGrad) {
  for (DType dtype : {DType::F16, DType::BF16}) {
    Case c;
    c.isa = GetParam();
    c.threads = 3;
    c.grad_dtype = dtype;
    c.copy = true;
    c.copy_dtype = dtype;
    c.copy_aliases_grad = true;
    c.weight_decay = 0.1f;
    expect_matches_reference(c);
    if (HasFatalFailure()) return;
  }
}

// With lr = 0 the update leaves each weight as it was, so the copy is the rounding of the
// weight itself: this sweeps fp16/bf16 rounding over bit patterns of every exponent, ties,
// subnormals, overflow to inf, infinities and NaNs (quiet and signalling, both signs).
TEST_P(HostAdamWLevel, CopyRoundingOverBitPatterns) {
  std::vector<float> weights;
  for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 4093) {
    weights.push_back(bits_float(static_cast<uint32_t>(bits)));
  }
  for (uint32_t special :
       {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
        0x7f800001u, 0xff812345u, 0x7fffffffu, 0x477fe000u, 0x477fefffu, 0x477ff000u,
        0xc77ff000u, 0x33000000u, 0x33000001u, 0x32ffffffu, 0x387fc000u, 0x3f808000u,
        0x3f818000u, 0x7f7fffffu, 0x00000001u, 0x807fffffu}) {
    weights.push_back(bits_float(special));
  }
  // Every fp16 value and its neighbourhood (halfway points included).
  for (uint32_t half = 0; half < 0x10000u; half += 7) {
    const float value = fp16_bits_to_fp32(static_cast<uint16_t>(half));
    weights.push_back(value);
    weights.push_back(bits_float(float_bits(value) + 0x1000u));
    weights.push_back(bits_float(float_bits(value) + 0x0fffu));
  }
  const int64_t n = static_cast<int64_t>(weights.size());
  std::vector<float> grad(static_cast<size_t>(n), 1.0f);
  auto backend = make_cpu_backend(1);
  AdamWStep step;
  step.lr = 0.0f;
  for (DType dtype : {DType::F16, DType::BF16}) {
    std::vector<float> reference_param = weights, reference_m(n, 0.0f), reference_v(n, 0.0f);
    std::vector<float> host_param = weights, host_m(n, 0.0f), host_v(n, 0.0f);
    std::vector<uint16_t> reference_copy(n), host_copy(n);
    backend->adamw(
        Tensor(reference_param.data(), DType::F32, {n}), Tensor(grad.data(), DType::F32, {n}),
        Tensor(reference_m.data(), DType::F32, {n}), Tensor(reference_v.data(), DType::F32, {n}),
        Tensor(reference_copy.data(), dtype, {n}), step, nullptr);
    host_adamw_with(GetParam(), host_param.data(), grad.data(), DType::F32, host_m.data(),
                    host_v.data(), host_copy.data(), dtype, n, step, 2);
    const std::string name =
        std::string("rounding_") + host_adamw_isa_name(GetParam()) + "_" + dtype_name(dtype);
    auto inputs = [&](int64_t i) { return "param " + hex_bits(weights[i]); };
    EXPECT_TRUE(
        bitwise_equal(name, "param_copy", reference_copy.data(), host_copy.data(), n, inputs));
    EXPECT_TRUE(bitwise_equal(name, "param", reference_param.data(), host_param.data(), n, inputs));
  }
}

// Inf and NaN gradients (the trainer skips such steps, but the bits must still agree).
TEST_P(HostAdamWLevel, NonFiniteGradients) {
  const int64_t n = 1003;
  Rng rng(5);
  State reference = random_state(rng, n, false);
  State host = reference;
  std::vector<float> grad = mixed_values(rng, n, 0.05, false);
  const float specials[] = {
      std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN(), bits_float(0xff800123u), 3e38f};
  for (int64_t i = 0; i < n; i += 7) grad[i] = specials[(i / 7) % 5];
  AdamWStep step;
  step.lr = 1e-3f;
  step.weight_decay = 0.1f;
  step.step = 3;
  step.grad_scale = 2.0f;  // 3e38 * 2 overflows to inf
  auto backend = make_cpu_backend(1);
  backend->adamw(Tensor(reference.param.data(), DType::F32, {n}),
                 Tensor(grad.data(), DType::F32, {n}), Tensor(reference.m.data(), DType::F32, {n}),
                 Tensor(reference.v.data(), DType::F32, {n}), Tensor(), step, nullptr);
  host_adamw_with(GetParam(), host.param.data(), grad.data(), DType::F32, host.m.data(),
                  host.v.data(), nullptr, DType::F16, n, step, 1);
  const std::string name = std::string("nonfinite_") + host_adamw_isa_name(GetParam());
  auto inputs = [&](int64_t i) { return "grad " + hex_bits(grad[i]); };
  EXPECT_TRUE(bitwise_equal(name, "param", reference.param.data(), host.param.data(), n, inputs));
  EXPECT_TRUE(bitwise_equal(name, "m", reference.m.data(), host.m.data(), n, inputs));
  EXPECT_TRUE(bitwise_equal(name, "v", reference.v.data(), host.v.data(), n, inputs));
}

// bf16 optimizer states: each step is the CPU backend's fp32 AdamW on the widened moments (exact),
// its new moments stored rounded to bf16 and its parameter update taken from the unrounded ones.
// Three steps from a state of bf16 moments, bf16 gradients and copy, odd sizes, 1-3 threads.
TEST_P(HostAdamWLevel, Bf16MomentsAreTheFp32StepRounded) {
  auto backend = make_cpu_backend(1);
  for (int threads : {1, 3}) {
    for (const int64_t n : {int64_t{1}, int64_t{17}, int64_t{40003}}) {
      Rng rng(static_cast<uint64_t>(11 + n + threads));
      State state = random_state(rng, n, false);
      std::vector<uint16_t> m = to_16bit(state.m, DType::BF16), v = to_16bit(state.v, DType::BF16);
      std::vector<float> param = state.param;
      for (int step_index = 1; step_index <= 3; ++step_index) {
        const std::vector<uint16_t> grad = to_16bit(mixed_values(rng, n, 0.02, false), DType::BF16);
        AdamWStep step;
        step.lr = 1e-3f;
        step.weight_decay = 0.1f;
        step.step = 10 + step_index;
        step.grad_scale = 0.5f;
        // The reference: fp32 moments widened from the bf16 ones.
        std::vector<float> ref_param = param, ref_m(n), ref_v(n);
        for (int64_t i = 0; i < n; ++i) {
          ref_m[i] = bf16_bits_to_fp32(m[i]);
          ref_v[i] = bf16_bits_to_fp32(v[i]);
        }
        std::vector<uint16_t> ref_copy(n), copy(n);
        backend->adamw(Tensor(ref_param.data(), DType::F32, {n}),
                       Tensor(const_cast<uint16_t*>(grad.data()), DType::BF16, {n}),
                       Tensor(ref_m.data(), DType::F32, {n}), Tensor(ref_v.data(), DType::F32, {n}),
                       Tensor(ref_copy.data(), DType::BF16, {n}), step, nullptr);
        host_adamw_moments(GetParam(), param.data(), grad.data(), DType::BF16, m.data(), v.data(),
                           DType::BF16, copy.data(), DType::BF16, n, step, threads);
        const std::string name = std::string("bf16_moments_") + host_adamw_isa_name(GetParam()) +
                                 "_n" + std::to_string(n) + "_step" + std::to_string(step_index);
        auto inputs = [&](int64_t i) { return "grad " + hex_bits(grad[i]); };
        const std::vector<uint16_t> want_m = to_16bit(ref_m, DType::BF16);
        const std::vector<uint16_t> want_v = to_16bit(ref_v, DType::BF16);
        ASSERT_TRUE(bitwise_equal(name, "param", ref_param.data(), param.data(), n, inputs));
        ASSERT_TRUE(bitwise_equal(name, "m", want_m.data(), m.data(), n, inputs));
        ASSERT_TRUE(bitwise_equal(name, "v", want_v.data(), v.data(), n, inputs));
        ASSERT_TRUE(bitwise_equal(name, "param_copy", ref_copy.data(), copy.data(), n, inputs));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, HostAdamWLevel,
                         ::testing::Values(HostAdamWIsa::Scalar, HostAdamWIsa::Avx2,
                                           HostAdamWIsa::Avx512),
                         [](const ::testing::TestParamInfo<HostAdamWIsa>& info) {
                           return std::string(host_adamw_isa_name(info.param));
                         });

TEST(HostAdamW, ReportsALevelThisCpuRuns) {
  const std::string isa = host_adamw_isa();
  EXPECT_TRUE(isa == "avx512" || isa == "avx2" || isa == "scalar") << isa;
  EXPECT_TRUE(host_adamw_isa_supported(HostAdamWIsa::Scalar));
  EXPECT_TRUE(host_adamw_isa_supported(HostAdamWIsa::Auto));
  if (isa == "avx512") {
    EXPECT_TRUE(host_adamw_isa_supported(HostAdamWIsa::Avx2));
  } else {
    EXPECT_FALSE(host_adamw_isa_supported(HostAdamWIsa::Avx512));
  }
  std::printf("host_adamw runs the %s level on this CPU\n", isa.c_str());
}

// The plain fp32 entry point, automatic level, all threads.
TEST(HostAdamW, AutoLevelAllThreads) {
  const int64_t n = (int64_t{1} << 20) + 3;
  Rng rng(9);
  State reference = random_state(rng, n, false);
  State host = reference;
  const std::vector<float> grad = mixed_values(rng, n, 0.05, false);
  AdamWStep step;
  step.lr = 3e-4f;
  step.weight_decay = 0.1f;
  step.step = 7;
  step.grad_scale = 0.8f;
  auto backend = make_cpu_backend(1);
  backend->adamw(Tensor(reference.param.data(), DType::F32, {n}),
                 Tensor(const_cast<float*>(grad.data()), DType::F32, {n}),
                 Tensor(reference.m.data(), DType::F32, {n}),
                 Tensor(reference.v.data(), DType::F32, {n}), Tensor(), step, nullptr);
  host_adamw(host.param.data(), grad.data(), host.m.data(), host.v.data(), n, step, 0);
  auto inputs = [&](int64_t i) { return "grad " + hex_bits(grad[i]); };
  EXPECT_TRUE(bitwise_equal("auto_all_threads", "param", reference.param.data(), host.param.data(),
                            n, inputs));
  EXPECT_TRUE(bitwise_equal("auto_all_threads", "m", reference.m.data(), host.m.data(), n, inputs));
  EXPECT_TRUE(bitwise_equal("auto_all_threads", "v", reference.v.data(), host.v.data(), n, inputs));
}

TEST(HostAdamW, RejectsBadArgumentsBeforeTouchingMemory) {
  std::vector<float> param(8, 1.0f), grad(8, 1.0f), m(8, 0.0f), v(8, 0.0f);
  std::vector<uint16_t> copy(8, 0);
  const std::vector<float> param_before = param;
  AdamWStep step;
  step.lr = 0.1f;
  step.step = 0;
  EXPECT_THROW(host_adamw(param.data(), grad.data(), m.data(), v.data(), 8, step, 1), Error);
  step.step = 1;
  EXPECT_THROW(host_adamw(param.data(), grad.data(), DType::I32, m.data(), v.data(), nullptr,
                          DType::F16, 8, step, 1),
               Error);
  EXPECT_THROW(host_adamw(param.data(), grad.data(), DType::F32, m.data(), v.data(), copy.data(),
                          DType::F32, 8, step, 1),
               Error);
  EXPECT_THROW(host_adamw(param.data(), nullptr, m.data(), v.data(), 8, step, 1), Error);
  EXPECT_EQ(param, param_before);
  for (HostAdamWIsa isa : {HostAdamWIsa::Avx2, HostAdamWIsa::Avx512}) {
    if (host_adamw_isa_supported(isa)) continue;
    EXPECT_THROW(host_adamw_with(isa, param.data(), grad.data(), DType::F32, m.data(), v.data(),
                                 nullptr, DType::F16, 8, step, 1),
                 Error);
  }
  // n = 0 is a no-op, even with null pointers.
  EXPECT_NO_THROW(host_adamw(nullptr, nullptr, nullptr, nullptr, 0, step, 1));
}

}  // namespace
}  // namespace dstrain
