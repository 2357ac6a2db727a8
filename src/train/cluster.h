// The nodes of a training run. One node (the default): the ranks are threads of this process,
// launched as train/devices.h says. Several (--nnodes N, or NNODES / WORLD_SIZE): one dstrain
// process per node, started with the same flags, each driving --gpus ranks as threads; the
// processes meet through the rendezvous (comm/rendezvous.h) and their ranks form one world of
// nnodes x gpus ranks, node r holding world ranks r x gpus .. (r + 1) x gpus - 1:
//   CPU ranks   Gloo (comm/gloo_communicator.h): the same bits as the local communicator
//   CUDA ranks  NCCL, the unique id made on node 0 and handed out through the rendezvous
// Rank 0 (on node 0) prints the progress, writes the log and finishes checkpoints; every node
// reads the data and the starting weights itself, and writes its ranks' parts of a checkpoint
// into the directory node 0 staged, on storage every node shares (NFS and the like).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/rendezvous.h"
#include "core/check.h"
#include "train/devices.h"

namespace dstrain {

// A run stopped by something outside this process (another node failed, the network went
// away): not a bug here; main says it plainly ("dstrain: error: ...") and exits 1.
class RunFailure : public Error {
 public:
  using Error::Error;
};

class Cluster {
 public:
  // One node: nothing happens. Several: joins the rendezvous (node 0 starts its store), prints
  // one line naming this node and the nodes, and the NCCL_* and GLOO_* environment that will
  // tune the communicators. UserError: nodes missing at the timeout, a node rank twice, ...
  Cluster(const RendezvousOptions& options, std::ostream& out);
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  int nnodes() const { return options_.nnodes; }
  int node_rank() const { return options_.node_rank; }
  bool multi_node() const { return options_.nnodes > 1; }
  // The tag every node names the staging directory of a checkpoint with: node 0's pid.
  const std::string& checkpoint_tag() const { return checkpoint_tag_; }
  // "node 1 (host b, ranks 2-3)" for messages, given the ranks per node.
  std::string describe_node(int node, int local_ranks) const;

  // Collective over the nodes: node 0's `settings` must equal this node's; else a UserError
  // naming the first key that differs (the same flags on every node, or a node would run
  // another plan and hang or diverge).
  void agree(const nlohmann::json& settings);

  // Runs fn(world communicator) on this node's ranks (devices.ranks of them, world ranks from
  // devices.first_rank): launch_ranks on one node. A failure is rethrown as a RunFailure that
  // says on which node and where the ranks live; UserErrors pass unchanged.
  // REQUIRES: devices.first_rank set by first_rank().
  void launch(const RunDevices& devices, double timeout_seconds,
              const std::function<void(Communicator&)>& fn);

  // The first world rank of this node with `local_ranks` ranks per node.
  int first_rank(int local_ranks) const { return options_.node_rank * local_ranks; }

  // --trace's file of this node: `path` on node 0, "trace.node1.json" for "trace.json" on node 1.
  std::string node_file(const std::string& path) const;

 private:
  void launch_gloo(const RunDevices& devices, double timeout_seconds,
                   const std::function<void(Communicator&)>& fn);
  void launch_nccl(const RunDevices& devices, double timeout_seconds,
                   const std::function<void(Communicator&)>& fn);
  std::string where_ranks_are(int local_ranks) const;

  RendezvousOptions options_;
  std::unique_ptr<Rendezvous> rendezvous_;  // several nodes only
  std::vector<RendezvousNode> nodes_;
  std::string checkpoint_tag_;
  int agreements_ = 0;
};

// The NCCL_* and GLOO_* variables of this process's environment, "NCCL_IB_DISABLE=1 ..."
// (empty: none), sorted by name.
std::string communicator_environment();

}  // namespace dstrain
