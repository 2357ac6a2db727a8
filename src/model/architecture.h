// What a block is, written against Backend: the interface the stage driver (model/stage.h) runs.
// The driver owns the micro-batch slots, the order of the blocks, the parameter protocol
// (ParamProvider) and recompute; an Architecture says which activations a layer keeps, and how
// the embedding, a layer and the head compute forward and backward. Its one implementation is
// the decoder built from parts (model/decoder.h, model/parts.h).
//
// Shapes: every tensor an Architecture declares is sized for the stage's largest micro-batch
// (B, T). At run time a micro-batch (b, t) with b * t <= B * T, t <= T uses a compact prefix of
// each buffer (see prefix()): producer and consumer agree on the layout, so no strides are
// needed. Every buffer is sized by the positions B * T (or B * T * something), none by B or T
// alone, so that narrower rows may be more (--batch-tokens).
//
// Tensor parallelism: an Architecture is one tp rank's part of the model (its layout holds the
// rank's slices, model/layout.h) and calls the collectives of model/tensor_parallel.h itself.
// The residual stream between layers and stages is (stream_rows(b, t), C): all b*t token rows,
// or this rank's 1/tp of them under sequence parallelism.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "model/expert_parallel.h"
#include "model/fp8_linear.h"
#include "model/layout.h"
#include "model/tensor_parallel.h"

namespace dstrain {

class ParamProvider;

// Activation checkpointing. Full: each layer keeps only its input (the previous layer's
// output) and backward recomputes the layer from it. Selective: the cheap parts (norms and
// elementwise activations) are recomputed, the rest kept. Gradients are bitwise the same.
enum class Recompute { None, Selective, Full };
const char* recompute_name(Recompute recompute);
Recompute parse_recompute(const std::string& name);  // "none" | "selective" | "full"

// A buffer an architecture needs, at the stage's (B, T).
struct TensorSpec {
  std::string name;  // "qkv", "scratch"
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
};

// One activation of a layer's forward that its backward reads. kept: stored per layer and
// micro-batch; otherwise backward recomputes it (layer_recompute) into one buffer that every
// layer and micro-batch shares.
struct ActivationSpec {
  TensorSpec tensor;
  bool kept = true;
};

// A compact (b, t, ...) prefix of a buffer sized for (B, T, ...).
Tensor prefix(Tensor full, std::initializer_list<int64_t> dims);

// What a layer's forward, recompute and backward work with. Tensors are full-size views;
// the architecture takes prefix()es of the micro-batch's (b, t).
struct LayerRun {
  Backend& backend;
  Stream stream;
  int64_t b = 0, t = 0;
  int layer = 0;                       // index in the whole model
  std::vector<Tensor> weights, grads;  // the block's parameter (gradient) tensors, layout order
  Tensor input, output;                // (stream_rows(B, T), C) activations
  std::vector<Tensor> activations;     // by layer_activations() index
  std::vector<Tensor> workspace;       // by layer_workspace() index
  // backward: dL/d(output) on entry, dL/d(input) on exit (the residual stream's gradient).
  Tensor residual_grad;                // (stream_rows(B, T), C)
  // A MoE layer: the tensors of its routed experts' block (ParamLayout::expert_block), and
  // their gradients (backward).
  std::vector<Tensor> expert_weights = {}, expert_grads = {};
  // A forward run again by backward (full recompute): what forward records once is not
  // recorded again.
  bool recomputing = false;
  // (b, t) I32 positions of packed sequences (kernels/ops.h), or empty: one sequence per row.
  Tensor positions = {};
  // The layer's layer_weight_cache() tensors, and whether they were filled from the parameters
  // the layer runs with now (else the layer fills them before it reads them).
  std::vector<Tensor> weight_cache = {};
  bool weight_cache_fresh = false;
};

// The first stage's embedding: tokens (b, t) -> output (b, t, C), and its backward.
struct EmbedRun {
  Backend& backend;
  Stream stream;
  Tensor tokens;                  // (b, t) I32
  Tensor output;                  // (stream_rows(B, T), C)
  Tensor residual_grad;           // backward: dL/d(output), (stream_rows(B, T), C)
  std::vector<Tensor> workspace;  // the layers' (LayerRun::workspace), free between layers
  Tensor positions = {};          // (b, t) I32 of packed sequences, or empty (LayerRun's)
};

// The last stage's final norm, head and loss. forward: input (the last layer's output) ->
// per-token losses and, with targets and dloss != 0, backward through the head at once into
// input_grad (the gradient of the loss weighted dloss per token w.r.t. the input): only
// (b, t, C) of it outlives the call, never the (b, t, V) logits.
struct HeadRun {
  Backend& backend;
  Stream stream;
  int64_t b = 0, t = 0;
  Tensor input;                   // (stream_rows(B, T), C)
  Tensor targets;                 // (b, t) I32, or empty: logits only
  float dloss = 0.0f;             // 0: no backward
  std::vector<Tensor> workspace;  // by head_workspace() index
  Tensor input_grad;              // (stream_rows(B, T), C): written when dloss != 0
};

class Architecture {
 public:
  virtual ~Architecture() = default;
  virtual const ModelConfig& config() const = 0;
  virtual const ParamLayout& layout() const = 0;
  virtual const TensorParallel& tensor_parallel() const = 0;
  // The rows of the residual stream of a (b, t) micro-batch this rank holds.
  int64_t stream_rows(int64_t b, int64_t t) const { return tensor_parallel().stream_rows(b * t); }

  // The activations of layer `layer` (its index in the whole model) besides its input and output
  // (the stage keeps those), in the order LayerRun::activations holds them, with what `recompute`
  // keeps. Layers may differ (a dense layer among mixture-of-experts layers).
  virtual std::vector<ActivationSpec> layer_activations(int layer, int64_t B, int64_t T,
                                                        DType dtype, Recompute recompute) const = 0;
  // Scratch and activation-gradient buffers of the layers (one set, shared by all layers
  // and micro-batches, sized for the largest): LayerRun::workspace.
  virtual std::vector<TensorSpec> layer_workspace(int64_t B, int64_t T, DType dtype,
                                                  bool with_backward) const = 0;
  // What layer `layer` keeps of its parameters from one use to the next while they do not
  // change (--precision fp8's cached FP8 weights, model/fp8_linear.h Fp8Options): one set per
  // layer, kept by the stage for its life (LayerRun::weight_cache). None by default.
  virtual std::vector<TensorSpec> layer_weight_cache(int layer) const { return {}; }
  // The head's buffers (logits, norm statistics, losses): HeadRun::workspace.
  virtual std::vector<TensorSpec> head_workspace(int64_t B, int64_t T, DType dtype,
                                                 bool with_backward) const = 0;

  // The embedding. Acquires (and releases) its parameter blocks from `params`; `next` is the
  // block to prefetch once its work is queued (-1: none).
  virtual void embed_forward(ParamProvider& params, const EmbedRun& run, int next) const = 0;
  virtual void embed_backward(ParamProvider& params, const EmbedRun& run) const = 0;

  // A layer, with its block's parameters in hand (LayerRun::weights).
  virtual void layer_forward(const LayerRun& run) const = 0;
  // Before layer_backward: recompute what `recompute` did not keep (from run.input and what
  // was kept). None: nothing.
  virtual void layer_recompute(const LayerRun& run, Recompute recompute) const = 0;
  virtual void layer_backward(const LayerRun& run) const = 0;

  // The head: acquires its blocks from `params`. Returns the mean of the per-token losses,
  // summed in order in fp64 (0 without targets). With dloss != 0 the head's parameter gradients are added and
  // `release_grads` says whether it releases the gradient blocks it touched (false when the
  // same stage's embedding adds to one of them later: GPT-2's tied wte). `next`: the block
  // to prefetch at the end (the last layer's, for the backward that follows).
  virtual double head_forward(ParamProvider& params, const HeadRun& run, bool release_grads,
                              int next) const = 0;
  // The first block the head acquires (prefetched after the last layer's forward).
  virtual int head_first_block() const = 0;
  // (b, t, Vp / tp) logits of the last head_forward in `workspace` (after one with dloss != 0:
  // their gradient): this tp rank's vocabulary columns.
  virtual Tensor head_logits(const std::vector<Tensor>& workspace, int64_t b, int64_t t) const = 0;
};

// The decoder of a model configuration (model/decoder.h), as tp rank `tp.rank` of `tp.size`
// holding ep rank `ep.rank`'s experts runs it. REQUIRES: the model splits over tp.size and
// ep.size ranks (tp_unsupported_reason, ep_unsupported_reason, model/layout.h); UserError
// otherwise. fp8: the projections of the layers in FP8 (--precision fp8, model/fp8_linear.h),
// their FP8 weights cached or not.
std::unique_ptr<Architecture> make_architecture(const ModelConfig& config,
                                                const TensorParallel& tp = {},
                                                const ExpertParallel& ep = {}, Fp8Options fp8 = {});

// Fresh parameters as their parts ask (ParamSpec::init, model/layout.h), each tensor from its
// own stream (seed, name), the same for any layout or sharding: one F32 host tensor of
// block_numel elements per block; padding and gaps are zeroed.
// Drawn on all of OpenMP's threads (model/init.cpp), the same values for any number of them.
void init_model_parameters(const ParamLayout& layout, const ModelConfig& config, uint64_t seed,
                           const std::vector<Tensor>& block_flats);

// data[i] = stddev x the i-th rng.normal() of a copy of `rng`, for i < n: what one sequential
// loop gives, drawn in parallel chunks.
void fill_normal(float* data, int64_t n, const Rng& rng, double stddev);

}  // namespace dstrain
