// Communicator::all_to_all's default: one exchange() of every nonempty part with the other
// peers, and this rank's own part copied (communicator.h).
#include <cstring>
#include <numeric>

#include "comm/communicator.h"

namespace dstrain {

namespace {

void check_counts(const std::vector<int64_t>& counts, const char* name, int size, const Tensor& t) {
  DSTRAIN_CHECK(static_cast<int>(counts.size()) == size)
      << "all_to_all: " << counts.size() << " " << name << " for " << size << " ranks";
  for (int64_t count : counts) DSTRAIN_CHECK(count >= 0) << "all_to_all: a negative " << name;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  DSTRAIN_CHECK(total <= t.numel()) << "all_to_all: " << name << " sum to " << total
                                    << " elements, more than " << t.shape_str() << " holds";
}

}  // namespace

void Communicator::all_to_all(Tensor output, const std::vector<int64_t>& recv_counts, Tensor input,
                              const std::vector<int64_t>& send_counts, Stream stream) {
  check_counts(send_counts, "send_counts", size(), input);
  check_counts(recv_counts, "recv_counts", size(), output);
  DSTRAIN_CHECK(input.dtype == output.dtype)
      << "all_to_all of " << input.shape_str() << " into " << output.shape_str();
  std::vector<P2POp> ops;
  Tensor own_input, own_output;
  int64_t send_at = 0, recv_at = 0;
  for (int peer = 0; peer < size(); ++peer) {
    const auto p = static_cast<size_t>(peer);
    const Tensor sent = input.slice(send_at, {send_counts[p]});
    const Tensor received = output.slice(recv_at, {recv_counts[p]});
    send_at += send_counts[p];
    recv_at += recv_counts[p];
    if (peer == rank()) {
      DSTRAIN_CHECK(send_counts[p] == recv_counts[p])
          << "all_to_all: rank " << peer << " sends itself " << send_counts[p]
          << " elements but receives " << recv_counts[p];
      own_input = sent;
      own_output = received;
      continue;
    }
    if (send_counts[p] > 0) ops.push_back(P2POp{P2POp::Kind::Send, sent, peer});
    if (recv_counts[p] > 0) ops.push_back(P2POp{P2POp::Kind::Recv, received, peer});
  }
  if (!ops.empty()) exchange(ops, stream);
  if (own_input.numel() > 0) copy_own_part(own_output, own_input, stream);
}

void Communicator::copy_own_part(Tensor dst, Tensor src, Stream) {
  DSTRAIN_CHECK(dst.device.is_cpu() && src.device.is_cpu())
      << "all_to_all: this communicator copies host memory only, not " << src.shape_str();
  std::memcpy(dst.data, src.data, src.nbytes());
}

}  // namespace dstrain
