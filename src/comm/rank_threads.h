// Internal to src/comm/: the thread launch shared by run_local_ranks and run_nccl_ranks.
#pragma once

#include <exception>
#include <functional>

namespace dstrain::comm_detail {

// Runs rank_main(rank) on one thread per rank, 0..world_size-1, and joins them all. When a
// thread cannot be started, release_started(error) is called first (it must make the started
// ranks return: record the failure they poll for), then they are joined and the error is
// rethrown. rank_main must not throw (it records its own failure).
void run_rank_threads(int world_size, const std::function<void(int)>& rank_main,
                      const std::function<void(std::exception_ptr)>& release_started);

}  // namespace dstrain::comm_detail
