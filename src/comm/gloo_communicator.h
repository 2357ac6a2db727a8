// The Gloo communicator: the Communicator of communicator.h over Gloo (Debian's libgloo-dev, the
// CPU collective library PyTorch uses), for CPU ranks in several processes or on several
// machines. The ranks meet through the store of the rendezvous (comm/tcp_store.h): each puts its
// address there under a key prefix and connects to every other rank over TCP (a full mesh).
// Built only with DSTRAIN_WITH_GLOO (CMake's DSTRAIN_GLOO); this header includes no Gloo header,
// and without Gloo gloo_available() is false and make_gloo_communicator throws a UserError.
//
// How it differs from the local communicator
// - Memory: CPU memory only (a CUDA tensor is an Error); `stream` is ignored.
// - Reduction order: the local communicator's, exactly (rank 0 first, then 1, 2, ...; 16-bit
//   inputs widened, combined in fp32, rounded once), so every rank gets the same bits, and the
//   bits of the local communicator. Gloo's own allreduce (ring, halving-doubling, bcube)
//   combines partial sums in an order that depends on the rank and the chunk, and in the storage
//   type; it is not used. The collectives are written here on Gloo's point-to-point transport:
//   all_reduce = a reduce-scatter (rank r receives chunk r of every rank's buffer and reduces it
//   with comm/local_reduce.h's reduce_in_order) and an all-gather of the reduced chunks; each
//   rank sends and receives 2 (size-1)/size of the buffer, as in a ring, in one step to each
//   peer at once instead of size-1 steps (fine for the small worlds of CPU ranks; a large world
//   would want a ring).
// - broadcast: the root sends to each rank in turn (flat); barrier: an all-gather of one int.
// - send returns once the peer has posted the matching receive and the data has been handed to
//   the socket; per-pair order as the contract says. exchange posts every send, then every
//   receive, then waits for all.
// - No mismatch check across ranks (they share no memory to compare calls in): as for NCCL,
//   matching calls and sizes are a REQUIRES. A rank calling another collective, or a recv of
//   another size than its send, is undefined: usually the timeout, or an Error from Gloo.
// - Failure: every wait is bounded by the timeout from the start of the call; then (or when a
//   connection breaks: a peer process that died) the call throws dstrain::Error naming the
//   operation and its number on the group ("all_reduce #3 on group 'job/world'"), the rank and
//   the peer it was waiting for. Gloo closes every connection of the communicator at a timeout,
//   so the peers fail at once instead of at their own timeout; the communicator is then broken
//   and every later call throws. A rank that never arrives cannot be told from a slow one: the
//   others fail at the timeout.
// - split: an all-gather of (color, key), then a new Gloo context for each color through the
//   store, under the key prefix "<prefix>/split<n>[color <c>]" (n: the split's number on this
//   communicator), over the same network device.
// - annotate: ignored (the ranks cannot see each other's labels).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/tcp_store.h"

namespace dstrain {

// True when this build has Gloo.
bool gloo_available();

// Where this rank listens for its peers: the address of `interface` ("eth0"; Gloo's
// GLOO_SOCKET_IFNAME) when it is set, else that of `hostname` (an address or a host name the
// peers can reach). The default is the loopback: every rank on this machine.
struct GlooNetwork {
  std::string hostname = "127.0.0.1";
  std::string interface;
};

// Collective over `size` ranks (one call per rank, each in its own thread or process): joins
// the Gloo communicator named `prefix` through `store` as rank `rank`, connecting to every other
// rank. Ranks missing after `timeout_seconds` are an Error naming them ("ranks 2, 3 of 4 never
// joined the Gloo communicator 'job/world' through the store at 10.0.0.1:29500 within 60 s").
// timeout_seconds also bounds every later wait of the communicator (> 0; infinity: none).
// REQUIRES: 0 <= rank < size; `prefix` used for no other communicator of this store;
// `store` (this rank's own client: a blocked call holds it) outlives the communicator and
// its splits, and is used by nothing else while they talk to it (construction and split).
// A build without Gloo: a UserError.
std::unique_ptr<Communicator> make_gloo_communicator(TcpStoreClient& store,
                                                     const std::string& prefix, int rank, int size,
                                                     double timeout_seconds,
                                                     const GlooNetwork& network = {});

// This process's ranks of a Gloo world that spans several processes (one per node): world
// ranks first_rank .. first_rank + local_ranks - 1 of world_size, each a thread with its own
// client of the store at store_host:store_port, the world named `prefix` in the store.
struct GlooRanks {
  std::string store_host;
  int store_port = 0;
  std::string prefix = "world";
  int first_rank = 0;
  int local_ranks = 1;
  int world_size = 1;
  GlooNetwork network;
};

// Runs fn(communicator) on one thread per local rank, each joined to the world, and returns
// when every thread has. A rank whose fn throws closes its communicator at once, so that its
// peers' waits on it fail instead of running into the timeout (and theirs in turn close); the
// first error of this process is rethrown after every thread has joined. timeout_seconds: as
// make_gloo_communicator's (connecting to the store and joining included).
// REQUIRES: 0 <= first_rank, 1 <= local_ranks, first_rank + local_ranks <= world_size.
void run_gloo_ranks(const GlooRanks& ranks, double timeout_seconds,
                    const std::function<void(Communicator&)>& fn);

}  // namespace dstrain
