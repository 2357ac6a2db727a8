#include "model/stage.h"

#include <map>
#include <string>

#include "core/trace.h"

namespace dstrain {

const char* recompute_name(Recompute recompute) {
  switch (recompute) {
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::None;
  if (name == "selective") return Recompute::Selective;
  if (name == "full") return Recompute::Full;
  DSTRAIN_USER_ERROR() << "unknown --recompute '" << name << "' (expected none, selective or full)";
  return Recompute::None;
}

Tensor prefix(Tensor full, std::initializer_list<int64_t> dims) { return full.slice(0, dims); }

StageRange whole_model(const ModelConfig& config) {
  return StageRange{0, config.n_layer, true, true};
}

namespace {

std::vector<int> add_all(ArenaPlan& arena, const std::vector<TensorSpec>& specs) {
  std::vector<int> ids;
  for (const TensorSpec& spec : specs) ids.push_back(arena.add(spec.name, spec.dtype, spec.shape));
  return ids;
}

// "name (shape) dtype": a recomputed buffer is shared by the layers whose specs name it alike.
std::string spec_key(const TensorSpec& t) {
  std::string key = t.name + " (";
  for (int64_t d : t.shape) key += std::to_string(d) + ",";
  return key + ") " + dtype_name(t.dtype);
}

// One layer's activations: kept ones in the slot under "h.<layer>.", recomputed ones in the
// shared arena under "recompute." (once for all layers with the same buffer).
std::vector<ActivationSlotId> add_layer(StageBuffers& plan, int64_t layer,
                                        const std::vector<ActivationSpec>& specs,
                                        std::map<std::string, int>& recomputed_ids) {
  std::vector<ActivationSlotId> ids;
  for (const ActivationSpec& spec : specs) {
    const TensorSpec& t = spec.tensor;
    if (spec.kept) {
      ids.push_back({true, plan.slot.add("h." + std::to_string(layer) + "." + t.name, t.dtype, t.shape)});
      continue;
    }
    auto [it, added] = recomputed_ids.try_emplace(spec_key(t), -1);
    if (added) it->second = plan.recomputed.add("recompute." + t.name, t.dtype, t.shape);
    ids.push_back({false, it->second});
  }
  return ids;
}

}  // namespace

StageBuffers plan_stage_buffers(const Architecture& arch, const StageRange& range, int64_t B,
                                int64_t T, DType dtype, bool with_backward, Recompute recompute,
                                int slots) {
  const ModelConfig& config = arch.config();
  DSTRAIN_CHECK(range.first_layer >= 0 && range.end_layer <= config.n_layer &&
                range.layers() >= 1 && slots >= 1)
      << "layers [" << range.first_layer << ", " << range.end_layer << ") of " << config.n_layer
      << ", " << slots << " slots";
  if (!with_backward) recompute = Recompute::None;
  // The residual stream: (B*T, C), or this tp rank's rows of it under sequence parallelism.
  const std::vector<int64_t> stream = {arch.stream_rows(B, T), config.n_embd};
  StageBuffers plan;
  plan.slots = slots;
  plan.input = plan.slot.add("input", dtype, stream);
  std::map<std::string, int> recomputed_ids;
  for (int64_t l = range.first_layer; l < range.end_layer; ++l) {
    const std::vector<ActivationSpec> specs =
        arch.layer_activations(static_cast<int>(l), B, T, dtype, recompute);
    plan.layer_activations.push_back(add_layer(plan, l, specs, recomputed_ids));
    if (l + 1 < range.end_layer) {
      plan.layer_outputs.push_back(plan.slot.add("h." + std::to_string(l) + ".output", dtype, stream));
    }
  }
  if (range.last && with_backward) plan.head_grad = plan.slot.add("head_grad", dtype, stream);

  plan.send = plan.workspace.add("stage_output", dtype, stream);
  if (with_backward) plan.residual_grad = plan.workspace.add("residual_grad", dtype, stream);
  plan.layer_workspace = add_all(plan.workspace, arch.layer_workspace(B, T, dtype, with_backward));
  if (range.last) {
    plan.head_workspace = add_all(plan.workspace, arch.head_workspace(B, T, dtype, with_backward));
  }
  for (int64_t l = range.first_layer; l < range.end_layer; ++l) {
    plan.layer_weight_cache.push_back(
        add_all(plan.workspace, arch.layer_weight_cache(static_cast<int>(l))));
  }
  return plan;
}

ModelStage::ModelStage(const Architecture& arch, const StageRange& range, Backend& backend,
                       Allocator& allocator, int64_t B, int64_t T, DType dtype, bool with_backward,
                       Recompute recompute, int slots)
    : arch_(arch),
      layout_(arch.layout()),
      range_(range),
      backend_(backend),
      B_(B),
      T_(T),
      with_backward_(with_backward),
      recompute_(with_backward ? recompute : Recompute::None),
      plan_(plan_stage_buffers(arch, range, B, T, dtype, with_backward, recompute, slots)),
      slot_state_(static_cast<size_t>(slots)),
      weight_cache_version_(static_cast<size_t>(range.layers())) {
  const ModelConfig& config = arch.config();
  DSTRAIN_USER_CHECK(T >= 1 && T <= config.n_positions)
      << "sequence length " << T << " is outside 1.." << config.n_positions
      << " (the model's n_positions)";
  DSTRAIN_USER_CHECK(B >= 1) << "batch size must be at least 1";
  for (int s = 0; s < slots; ++s) {
    slot_buffers_.push_back(allocator.allocate(MemCategory::Activations, plan_.slot.bytes()));
  }
  recomputed_ = allocator.allocate(MemCategory::Activations, plan_.recomputed.bytes());
  workspace_ = allocator.allocate(MemCategory::Workspace, plan_.workspace.bytes());
}

Tensor ModelStage::slot_tensor(int slot, int id) const {
  const Buffer& buffer = slot_buffers_.at(static_cast<size_t>(slot));
  return plan_.slot.view(id, buffer.data(), buffer.device());
}

Tensor ModelStage::work_tensor(int id) const {
  return plan_.workspace.view(id, workspace_.data(), workspace_.device());
}

std::vector<Tensor> ModelStage::views(const std::vector<int>& ids) const {
  std::vector<Tensor> tensors;
  for (int id : ids) tensors.push_back(work_tensor(id));
  return tensors;
}

Tensor ModelStage::stream_view(Tensor full, int64_t b, int64_t t) const {
  return prefix(full, {arch_.stream_rows(b, t), arch_.config().n_embd});
}

Tensor ModelStage::input(int slot, int64_t b, int64_t t) const {
  return stream_view(slot_tensor(slot, plan_.input), b, t);
}

Tensor ModelStage::output(int64_t b, int64_t t) const {
  return stream_view(work_tensor(plan_.send), b, t);
}

Tensor ModelStage::output_grad(int64_t b, int64_t t) const {
  DSTRAIN_CHECK(plan_.residual_grad >= 0) << "a stage without backward has no gradients";
  return stream_view(work_tensor(plan_.residual_grad), b, t);
}

Tensor ModelStage::logits() const {
  DSTRAIN_CHECK(range_.last) << "only the last stage has logits";
  return arch_.head_logits(views(plan_.head_workspace), last_b_, last_t_);
}

// Full-size residual-stream views: layer l's input is the stage input or layer l-1's kept output;
// the stage's last layer writes the shared output buffer.
Tensor ModelStage::layer_input(int slot, int64_t layer) const {
  if (layer == range_.first_layer) return slot_tensor(slot, plan_.input);
  return slot_tensor(slot, plan_.layer_outputs[static_cast<size_t>(layer - 1 - range_.first_layer)]);
}

Tensor ModelStage::layer_output(int slot, int64_t layer) const {
  if (layer + 1 == range_.end_layer) return work_tensor(plan_.send);
  return slot_tensor(slot, plan_.layer_outputs[static_cast<size_t>(layer - range_.first_layer)]);
}

ModelStage::LayerBlocks ModelStage::acquire_layer(ParamProvider& params, int64_t layer,
                                                  bool grads) const {
  const int block = ParamLayout::layer_block(static_cast<int>(layer));
  const int experts = layout_.expert_block(static_cast<int>(layer));
  LayerBlocks blocks;
  blocks.params = params.acquire_params(block);
  if (experts >= 0) blocks.expert_params = params.acquire_params(experts);
  if (!grads) return blocks;
  blocks.grads = params.acquire_grads(block);
  if (experts >= 0) blocks.expert_grads = params.acquire_grads(experts);
  return blocks;
}

void ModelStage::release_layer(ParamProvider& params, int64_t layer, bool grads) const {
  const int block = ParamLayout::layer_block(static_cast<int>(layer));
  const int experts = layout_.expert_block(static_cast<int>(layer));
  if (grads) {
    if (experts >= 0) params.release_grads(experts);
    params.release_grads(block);
  }
  if (experts >= 0) params.release_params(experts);
  params.release_params(block);
}

LayerRun ModelStage::layer_run(int slot, int64_t layer, const LayerBlocks& blocks,
                               std::optional<uint64_t> version, Stream stream) const {
  const SlotState& state = slot_state_[static_cast<size_t>(slot)];
  const int block = ParamLayout::layer_block(static_cast<int>(layer));
  LayerRun run{backend_,
               stream,
               state.b,
               state.t,
               static_cast<int>(layer),
               layout_.block_views(block, blocks.params),
               layout_.block_views(block, blocks.grads),
               layer_input(slot, layer),
               layer_output(slot, layer),
               {},
               views(plan_.layer_workspace),
               plan_.residual_grad >= 0 ? work_tensor(plan_.residual_grad) : Tensor()};
  run.positions = state.positions;
  const size_t index = static_cast<size_t>(layer - range_.first_layer);
  run.weight_cache = views(plan_.layer_weight_cache[index]);
  run.weight_cache_fresh = version && weight_cache_version_[index] == version;
  const int experts = layout_.expert_block(static_cast<int>(layer));
  if (experts >= 0) {
    run.expert_weights = layout_.block_views(experts, blocks.expert_params);
    run.expert_grads = layout_.block_views(experts, blocks.expert_grads);
  }
  const Buffer& slot_buffer = slot_buffers_[static_cast<size_t>(slot)];
  for (const ActivationSlotId& a :
       plan_.layer_activations[static_cast<size_t>(layer - range_.first_layer)]) {
    run.activations.push_back(
        a.kept ? plan_.slot.view(a.id, slot_buffer.data(), slot_buffer.device())
               : plan_.recomputed.view(a.id, recomputed_.data(), recomputed_.device()));
  }
  return run;
}

void ModelStage::weight_cache_filled(int64_t layer, std::optional<uint64_t> version) {
  weight_cache_version_[static_cast<size_t>(layer - range_.first_layer)] = version;
}

void ModelStage::forward_layers(ParamProvider& params, int slot, Stream stream) {
  const std::optional<uint64_t> version = params.params_version();
  for (int64_t l = range_.first_layer; l < range_.end_layer; ++l) {
    const LayerBlocks blocks = acquire_layer(params, l, false);
    {
      const TraceSpan span(TraceTrack::Compute, TraceKind::Compute, "forward layer", l, stream);
      arch_.layer_forward(layer_run(slot, l, blocks, version, stream));
      weight_cache_filled(l, version);
    }
    if (l + 1 < range_.end_layer) {
      params.prefetch_params(ParamLayout::layer_block(static_cast<int>(l + 1)));
    } else if (range_.last) {
      params.prefetch_params(arch_.head_first_block());
    }
    release_layer(params, l, false);
  }
}

double ModelStage::forward(ParamProvider& params, int slot, int64_t b, int64_t t, Tensor tokens,
                           Tensor targets, Tensor positions, float dloss, Stream stream) {
  DSTRAIN_CHECK(slot >= 0 && slot < plan_.slots) << "slot " << slot << " of " << plan_.slots;
  DSTRAIN_CHECK(b >= 1 && t >= 1 && b * t <= B_ * T_ && t <= T_)
      << "micro-batch (" << b << ", " << t << ") exceeds (" << B_ << ", " << T_ << ")";
  DSTRAIN_CHECK(range_.first == !tokens.empty()) << "tokens go to the first stage only";
  DSTRAIN_CHECK(tokens.empty() || (tokens.ndim == 2 && tokens.dtype == DType::I32 &&
                                   tokens.size(0) == b && tokens.size(1) == t))
      << tokens.shape_str();
  DSTRAIN_CHECK(dloss == 0.0f || (with_backward_ && range_.last && !targets.empty()))
      << "dloss needs backward, the last stage and targets";
  DSTRAIN_CHECK(positions.empty() || (positions.ndim == 2 && positions.dtype == DType::I32 &&
                                      positions.size(0) == b && positions.size(1) == t))
      << "positions " << positions.shape_str();
  SlotState& state = slot_state_[static_cast<size_t>(slot)];
  state = SlotState{b, t, false, positions};
  if (range_.first) {
    const int next = ParamLayout::layer_block(static_cast<int>(range_.first_layer));
    const TraceSpan span(TraceTrack::Compute, TraceKind::Compute, "forward embedding", -1, stream);
    arch_.embed_forward(params,
                        EmbedRun{backend_, stream, tokens, slot_tensor(slot, plan_.input), Tensor(),
                                 views(plan_.layer_workspace), positions},
                        next);
  }
  forward_layers(params, slot, stream);
  if (!range_.last) {
    state.forwarded = with_backward_;
    return 0.0;
  }
  last_b_ = b;
  last_t_ = t;
  HeadRun head{backend_, stream, b, t, work_tensor(plan_.send), targets, dloss,
               views(plan_.head_workspace),
               plan_.head_grad >= 0 ? slot_tensor(slot, plan_.head_grad) : Tensor()};
  // The head's gradient blocks stay acquired when this stage's embedding adds to them later.
  const int next = ParamLayout::layer_block(static_cast<int>(range_.end_layer - 1));
  const TraceSpan span(TraceTrack::Compute, TraceKind::Compute,
                       dloss != 0.0f ? "head, loss and their backward" : "head and loss", -1,
                       stream);
  const double loss = arch_.head_forward(params, head, /*release_grads=*/!range_.first, next);
  state.forwarded = dloss != 0.0f;
  return loss;
}

void ModelStage::backward_layers(ParamProvider& params, int slot, Stream stream) {
  const std::optional<uint64_t> version = params.params_version();
  for (int64_t l = range_.end_layer - 1; l >= range_.first_layer; --l) {
    const LayerBlocks blocks = acquire_layer(params, l, true);
    if (recompute_ != Recompute::None) {
      const TraceSpan span(TraceTrack::Compute, TraceKind::Compute, "recompute layer", l, stream);
      arch_.layer_recompute(layer_run(slot, l, blocks, version, stream), recompute_);
    }
    {
      const TraceSpan span(TraceTrack::Compute, TraceKind::Compute, "backward layer", l, stream);
      arch_.layer_backward(layer_run(slot, l, blocks, version, stream));
      weight_cache_filled(l, version);
    }
    // (The embedding's backward needs no parameters: nothing to prefetch after the first.)
    if (l > range_.first_layer) params.prefetch_params(ParamLayout::layer_block(static_cast<int>(l - 1)));
    release_layer(params, l, true);
  }
}

void ModelStage::backward(ParamProvider& params, int slot, Tensor tokens, Stream stream) {
  DSTRAIN_CHECK(slot >= 0 && slot < plan_.slots) << "slot " << slot << " of " << plan_.slots;
  SlotState& state = slot_state_[static_cast<size_t>(slot)];
  DSTRAIN_CHECK(state.forwarded) << "backward of slot " << slot
                                 << " needs its forward (on the last stage with dloss != 0)";
  DSTRAIN_CHECK(range_.first == !tokens.empty()) << "tokens go to the first stage only";
  const int64_t b = state.b, t = state.t;
  if (range_.last) {
    backend_.copy(output_grad(b, t), stream_view(slot_tensor(slot, plan_.head_grad), b, t), stream);
  }
  backward_layers(params, slot, stream);
  if (range_.first) {
    DSTRAIN_CHECK(tokens.size(0) == b && tokens.size(1) == t) << tokens.shape_str();
    const TraceSpan span(TraceTrack::Compute, TraceKind::Compute, "backward embedding", -1, stream);
    arch_.embed_backward(params, EmbedRun{backend_, stream, tokens, Tensor(),
                                          work_tensor(plan_.residual_grad),
                                          views(plan_.layer_workspace), state.positions});
  } else {
    // Into the send buffer, so that the next output gradient can be received meanwhile.
    backend_.copy(input_grad(b, t), output_grad(b, t), stream);
  }
  state.forwarded = false;
}

}  // namespace dstrain
