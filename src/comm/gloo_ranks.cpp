// run_gloo_ranks (comm/gloo_communicator.h): a process's share of a Gloo world, as threads.
#include <exception>
#include <memory>
#include <mutex>

#include "comm/gloo_communicator.h"
#include "comm/rank_threads.h"
#include "core/check.h"

namespace dstrain {

namespace {

// The first failure among this process's ranks, a peer's closing (PeerClosedError) giving way
// to a later failure of another kind: the rank that closed may be one of ours, its own error
// recorded only after the stack it unwound (split groups' connections among it) has closed.
class FirstError {
 public:
  void record(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_ || (is_peer_closed(error_) && !is_peer_closed(error))) error_ = std::move(error);
  }
  void rethrow() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static bool is_peer_closed(const std::exception_ptr& error) {
    try {
      std::rethrow_exception(error);
    } catch (const PeerClosedError&) {
      return true;
    } catch (...) {
      return false;
    }
  }
  std::mutex mutex_;
  std::exception_ptr error_;
};

void run_gloo_rank(const GlooRanks& ranks, int local, double timeout_seconds,
                   const std::function<void(Communicator&)>& fn, FirstError& failure) {
  const int rank = ranks.first_rank + local;
  thread_error_context().rank = rank;
  try {
    TcpStoreClient store(ranks.store_host, ranks.store_port, timeout_seconds);
    std::unique_ptr<Communicator> world = make_gloo_communicator(
        store, ranks.prefix, rank, ranks.world_size, timeout_seconds, ranks.network);
    try {
      fn(*world);
    } catch (...) {
      // Recorded first: the peers' failures that the closing below causes are follow-ons, and
      // one of this process's ranks could otherwise record its own before this root cause.
      failure.record(std::current_exception());
      world.reset();  // closes every connection of this rank now: the peers see it go
    }
  } catch (...) {
    failure.record(std::current_exception());
  }
}

}  // namespace

void run_gloo_ranks(const GlooRanks& ranks, double timeout_seconds,
                    const std::function<void(Communicator&)>& fn) {
  DSTRAIN_CHECK(ranks.first_rank >= 0 && ranks.local_ranks >= 1 &&
                ranks.first_rank + ranks.local_ranks <= ranks.world_size)
      << "run_gloo_ranks: ranks " << ranks.first_rank << " + " << ranks.local_ranks << " of "
      << ranks.world_size;
  FirstError failure;
  comm_detail::run_rank_threads(
      ranks.local_ranks,
      [&](int local) { run_gloo_rank(ranks, local, timeout_seconds, fn, failure); },
      // A thread that cannot start: the started ranks fail at their timeout (joining or later).
      [&](std::exception_ptr error) { failure.record(std::move(error)); });
  failure.rethrow();
}

}  // namespace dstrain
