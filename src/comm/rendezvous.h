// The rendezvous of a multi-node run, as torchrun users know it: the same binary with the same
// flags on every node (`--nnodes N --node-rank R --master-addr HOST --master-port PORT`, or
// MASTER_ADDR, MASTER_PORT, NNODES / WORLD_SIZE, NODE_RANK), nodes started in any order within
// the timeout. Node 0 runs the store (comm/tcp_store.h) on a thread of its process; every node
// (node 0 too) talks to it as a client. What the communicators must share before they exist
// (the NCCL unique id, the Gloo addresses) goes through broadcast_bytes().
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/tcp_store.h"

namespace dstrain {

constexpr int kDefaultMasterPort = 29500;          // torchrun's
constexpr double kDefaultRendezvousSeconds = 900;  // torchrun's join timeout

struct RendezvousOptions {
  std::string master_addr;               // node 0's address or host name, as every node reaches it
  int master_port = kDefaultMasterPort;  // 0 on node 0: a free port (tests; see server_port())
  int nnodes = 1;
  int node_rank = 0;
  double timeout_seconds = kDefaultRendezvousSeconds;
};

// The flags as the user typed them (absent: not given), checked by rendezvous_options().
struct RendezvousFlags {
  std::optional<std::string> master_addr;      // --master-addr
  std::optional<std::string> master_port;      // --master-port
  std::optional<std::string> nnodes;           // --nnodes
  std::optional<std::string> node_rank;        // --node-rank
  std::optional<std::string> timeout_seconds;  // --rendezvous-timeout
};

// The value of an environment variable, or nothing when it is unset.
using EnvironmentLookup = std::function<std::optional<std::string>(const std::string& name)>;
// This process's environment (getenv).
EnvironmentLookup process_environment();

// The options from the flags, else the environment (MASTER_ADDR, MASTER_PORT, NNODES or
// torchrun's WORLD_SIZE, NODE_RANK or torchrun's GROUP_RANK or RANK), else the defaults: one
// node, node rank 0, port 29500, 127.0.0.1 on a single node. dstrain is one process per node,
// so torchrun's process counts are node counts: LOCAL_WORLD_SIZE above 1 or LOCAL_RANK above
// 0 (several processes on a node) is a UserError, and so are variables that contradict each
// other (NNODES=2 with WORLD_SIZE=3, NODE_RANK=1 with RANK=0). A bad value (not an integer, a port outside 1..65535, nnodes < 1, node_rank
// outside 0..nnodes-1, a timeout that is not a positive number), or a missing --node-rank or
// --master-addr with more than one node, is a UserError naming the flag or variable it came
// from.
RendezvousOptions rendezvous_options(const RendezvousFlags& flags,
                                     const EnvironmentLookup& environment);

// A node as it registered.
struct RendezvousNode {
  int rank = 0;
  std::string host;  // its host name
  int64_t pid = 0;
};

class Rendezvous {
 public:
  // Node 0 starts the store server here (a UserError when the port is in use); nothing blocks.
  // REQUIRES: valid options (as rendezvous_options() makes them).
  explicit Rendezvous(RendezvousOptions options);
  // Node 0 waits (at most min(timeout, 10 s)) for the other nodes to hang up before stopping
  // the server, so values it has just set still reach them.
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  const RendezvousOptions& options() const { return options_; }
  // After a failed run: closes this node's connection and (node 0) stops the store at once,
  // without the destructor's wait for the other nodes to hang up.
  void stop_now();
  // "host:port" of the store, as messages name it.
  std::string address() const;
  // The port the server listens on. REQUIRES: node 0.
  int server_port() const;
  // The store's port as every node reaches it (node 0: server_port(), for --master-port 0).
  int store_port() const;
  // This node's address on the way to the store (TcpStoreClient::local_address): where the
  // other nodes can reach it. REQUIRES: join() returned.
  std::string local_address();

  // Connects, registers "node/<rank>" (host name and pid) and waits until every node has.
  // Returns the nodes by rank. Within the timeout (from this call): nodes missing then are a
  // UserError naming them ("nodes 2, 3 of 4 never joined the rendezvous at 10.0.0.1:29500
  // within 60 s"); so are two nodes with one rank, and nodes started with different --nnodes.
  std::vector<RendezvousNode> join();

  // Collective over the nodes (all call it with the same key, in the same order): node 0's
  // `bytes` on every node (the others' argument is ignored). A key may be used again: each
  // call is a new round. Node 0 silent for the timeout is an Error naming the key.
  // REQUIRES: join() returned.
  std::string broadcast_bytes(const std::string& key, const std::string& bytes);

  // Collective: every node's `bytes`, by node rank. Nodes missing at the timeout are an Error
  // naming them. REQUIRES: join() returned.
  std::vector<std::string> all_gather_bytes(const std::string& key, const std::string& bytes);

  // Collective: returns when every node has called barrier(name) as often as this one. Nodes
  // missing at the timeout are an Error naming them and the barrier.
  // REQUIRES: join() returned.
  void barrier(const std::string& name);

 private:
  // Waits for every key; at the timeout, an Error naming the ranks whose key is missing.
  // `keys[r]` belongs to node r.
  void wait_for_nodes(const std::vector<std::string>& keys, double seconds, bool joining,
                      const std::string& what);
  // Reads node `rank`'s record into `node`; another --nnodes than this node's is a UserError
  // (node 0 keeps its store up a moment first, so that nodes still joining read its record and
  // say the same, instead of finding no store).
  void read_node(int rank, RendezvousNode& node);
  std::string next_round(const std::string& kind, const std::string& name);
  TcpStoreClient& client();

  RendezvousOptions options_;
  std::unique_ptr<TcpStoreServer> server_;  // node 0 only
  std::unique_ptr<TcpStoreClient> client_;  // after join()
  std::map<std::string, int> rounds_;       // calls so far, by "barrier/<name>", "broadcast/<key>"
};

}  // namespace dstrain
