#include "comm/rank_threads.h"

#include <thread>
#include <vector>

namespace dstrain::comm_detail {

void run_rank_threads(int world_size, const std::function<void(int)>& rank_main,
                      const std::function<void(std::exception_ptr)>& release_started) {
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world_size));
  try {
    for (int rank = 0; rank < world_size; ++rank) threads.emplace_back(rank_main, rank);
  } catch (...) {
    release_started(std::current_exception());
    for (std::thread& thread : threads) thread.join();
    throw;
  }
  for (std::thread& thread : threads) thread.join();
}

}  // namespace dstrain::comm_detail
