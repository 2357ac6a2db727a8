// A pipeline stage: the part of the model one rank runs, for any Architecture. Layers
// [first_layer, end_layer), plus the embedding on the first stage and the final norm, head
// and loss on the last; one stage with every layer is the whole model (pp = 1).
//
//   forward(slot)   first stage: tokens -> embedding; others: the input the runner received
//                   into input(slot). Then the layers. Last stage: the head and the loss, and
//                   with dloss != 0 the head's backward at once (only a (b, t, C) gradient is
//                   kept per micro-batch, never (b, t, V) logits). Others leave their output in
//                   output() for the runner to send.
//   backward(slot)  last stage: from the head's gradient of that forward; others: from the
//                   gradient the runner received into output_grad(). The layers in reverse,
//                   recomputing what was not kept. First stage: the embedding's backward;
//                   others leave dL/d(input) in input_grad() for the runner to send.
//
// What the runner sends (the output after forward, the input gradient after backward) is in
// one buffer, and what it receives goes elsewhere (the input into the micro-batch's slot, the
// output gradient into the residual gradient), so a send and a receive can run at once.
//
// Activations belong to micro-batch slots, not to the model: a 1F1B stage keeps up to
// pp - stage micro-batches in flight (parallel/pipeline_schedule.h counts them), each in
// its own slot. plan_stage_buffers() is the single source of truth of the bytes: the stage
// allocates exactly it, and the memory model (parallel/memory_model.h) calls it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/allocator.h"
#include "core/arena.h"
#include "kernels/ops.h"
#include "model/architecture.h"
#include "model/param_provider.h"

namespace dstrain {

struct StageRange {
  int64_t first_layer = 0, end_layer = 0;  // [first_layer, end_layer)
  bool first = true;                       // runs the embedding
  bool last = true;                        // runs the final norm, the head and the loss
  int64_t layers() const { return end_layer - first_layer; }
  bool operator==(const StageRange&) const = default;
};
StageRange whole_model(const ModelConfig& config);

// Where one of a layer's activations lives: in the micro-batch slot (kept) or in the
// buffer of recomputed activations every layer shares.
struct ActivationSlotId {
  bool kept = true;
  int id = -1;  // in StageBuffers::slot, or StageBuffers::recomputed
};

// The memory of one stage for micro-batches of at most (B, T).
struct StageBuffers {
  ArenaPlan slot;        // one micro-batch's activations (MemCategory::Activations)
  ArenaPlan recomputed;  // recompute's shared buffers (MemCategory::Activations), once
  ArenaPlan workspace;   // (MemCategory::Workspace), once
  int slots = 1;         // micro-batches in flight: `slots` copies of `slot`
  // Ids in `slot`.
  // The residual stream's buffers are (stream_rows(B, T), C) (model/architecture.h).
  int input = -1;                   // the stage's input: embedding output or received
  int head_grad = -1;               // last stage with backward: the head's gradient
  std::vector<int> layer_outputs;   // each layer's output but the stage's last
  std::vector<std::vector<ActivationSlotId>> layer_activations;  // [layer - first_layer]
  // Ids in `workspace`.
  int send = -1;           // the stage's last layer's output; after backward of a stage that
                           // is not the first, dL/d(input)
  int residual_grad = -1;  // backward: the residual stream's gradient
  std::vector<int> layer_workspace, head_workspace;
  // Each layer's layer_weight_cache() [layer - first_layer], kept in `workspace` for the
  // stage's life: unlike the rest of it, their contents outlive a step.
  std::vector<std::vector<int>> layer_weight_cache;
  uint64_t activation_bytes() const { return slots * slot.bytes() + recomputed.bytes(); }
};
StageBuffers plan_stage_buffers(const Architecture& arch, const StageRange& range, int64_t B,
                                int64_t T, DType dtype, bool with_backward, Recompute recompute,
                                int slots);

class ModelStage {
 public:
  // Allocates plan_stage_buffers(...) from `allocator`.
  // REQUIRES: 1 <= T <= n_positions, B >= 1, slots >= 1, the range inside the model with at
  // least one layer. `arch` outlives the stage.
  ModelStage(const Architecture& arch, const StageRange& range, Backend& backend,
             Allocator& allocator, int64_t B, int64_t T, DType dtype, bool with_backward,
             Recompute recompute, int slots);

  const StageRange& range() const { return range_; }
  const Architecture& architecture() const { return arch_; }
  int slots() const { return plan_.slots; }
  int64_t max_batch() const { return B_; }
  int64_t max_seq() const { return T_; }

  // One micro-batch (b, t) into `slot`, b * t <= B * T and t <= T (narrower rows may be more).
  // tokens (b, t) I32 on the first stage (else empty: the input is in input(slot, b, t));
  // targets (b, t) I32 on the last stage (empty: logits only). dloss != 0 (the last stage's loss gradient per token) prepares backward(slot).
  // Returns the mean loss on the last stage with targets, else 0.
  // positions: (b, t) I32 of packed sequences (kernels/ops.h) on every stage, or empty; they
  // stay in place until the slot's backward.
  double forward(ParamProvider& params, int slot, int64_t b, int64_t t, Tensor tokens,
                 Tensor targets, Tensor positions, float dloss, Stream stream);
  double forward(ParamProvider& params, int slot, int64_t b, int64_t t, Tensor tokens,
                 Tensor targets, float dloss, Stream stream) {
    return forward(params, slot, b, t, tokens, targets, Tensor(), dloss, stream);
  }
  // Backpropagates the micro-batch of `slot`, adding into the gradients. tokens: the first
  // stage's (b, t), for the embedding's backward (else empty).
  void backward(ParamProvider& params, int slot, Tensor tokens, Stream stream);

  // (stream_rows(b, t), C) views the pipeline runner receives into and sends from: the slot's input
  // (receive), the output after forward (send), the output's gradient before backward
  // (receive), the input's gradient after backward (send; the output's buffer).
  Tensor input(int slot, int64_t b, int64_t t) const;
  Tensor output(int64_t b, int64_t t) const;
  Tensor output_grad(int64_t b, int64_t t) const;
  Tensor input_grad(int64_t b, int64_t t) const { return output(b, t); }
  // (b, t, Vp) logits of the last forward on the last stage (their gradient after one with
  // dloss != 0).
  Tensor logits() const;

 private:
  struct SlotState {
    int64_t b = 0, t = 0;
    bool forwarded = false;  // with dloss != 0: backward may follow
    Tensor positions;        // the forward's (packed sequences), or empty
  };
  Tensor slot_tensor(int slot, int id) const;
  // The (stream_rows(b, t), C) prefix of a residual-stream buffer.
  Tensor stream_view(Tensor full, int64_t b, int64_t t) const;
  Tensor work_tensor(int id) const;
  Tensor layer_input(int slot, int64_t layer) const;
  Tensor layer_output(int slot, int64_t layer) const;
  // A layer's parameter (and gradient) blocks in hand: its own, and its experts' (MoE layers).
  struct LayerBlocks {
    Tensor params, grads, expert_params, expert_grads;
  };
  // Acquires them (the gradients with `grads`), and releases them (gradients first).
  LayerBlocks acquire_layer(ParamProvider& params, int64_t layer, bool grads) const;
  void release_layer(ParamProvider& params, int64_t layer, bool grads) const;
  // `version`: the provider's params_version(), which says whether the layer's weight cache
  // is fresh (filled at this version).
  LayerRun layer_run(int slot, int64_t layer, const LayerBlocks& blocks,
                     std::optional<uint64_t> version, Stream stream) const;
  // After a layer's forward or backward ran with `version`: its weight cache holds it.
  void weight_cache_filled(int64_t layer, std::optional<uint64_t> version);
  std::vector<Tensor> views(const std::vector<int>& ids) const;
  void forward_layers(ParamProvider& params, int slot, Stream stream);
  void backward_layers(ParamProvider& params, int slot, Stream stream);

  const Architecture& arch_;
  const ParamLayout& layout_;
  StageRange range_;
  Backend& backend_;
  int64_t B_, T_;
  bool with_backward_;
  Recompute recompute_;
  StageBuffers plan_;
  std::vector<Buffer> slot_buffers_;
  Buffer recomputed_, workspace_;
  std::vector<SlotState> slot_state_;
  // The params_version() each layer's weight cache was filled at [layer - first_layer]
  // (nullopt: never, or not to be trusted).
  std::vector<std::optional<uint64_t>> weight_cache_version_;
  int64_t last_b_ = 0, last_t_ = 0;  // the last forward's micro-batch (logits())
};

}  // namespace dstrain
