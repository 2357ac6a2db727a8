#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <thread>
#include <utility>

#include "core/check.h"

namespace dstrain {
namespace {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

constexpr uint32_t kMagic = 0x53545344;  // the bytes "DSTS", read little-endian
constexpr size_t kHeaderBytes = 9;       // magic u32, code u8, field count u32
// How much longer than a get/wait's own timeout a client waits for the server's answer.
constexpr double kReplyGraceSeconds = 2.0;
// More connections than any run has nodes: a flood of them is refused, not served.
constexpr size_t kMaxConnections = 4096;
constexpr size_t kMaxKeptErrors = 64;

enum Operation : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kWait = 4, kCheck = 5 };
enum Status : uint8_t { kOk = 0, kTimedOut = 1, kFailed = 2 };

// Thrown inside the server when stop() wakes a thread blocked on a socket.
struct Stopped {};

std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds << " s";
  return text.str();
}

Deadline deadline_after(double seconds) {
  if (!(seconds < 1e7)) return Deadline::max();  // infinity (or absurdly far): never
  const auto span = std::chrono::duration<double>(std::max(seconds, 0.0));
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(span);
}

std::string errno_text(int error) { return std::strerror(error); }

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    reset(std::exchange(other.fd_, -1));
    return *this;
  }
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// A pipe that, once signalled, stays readable: every thread polling it wakes, now and later.
class WakePipe {
 public:
  WakePipe() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0)
      throw Error("pipe2 for the store server failed: " + errno_text(errno));
    read_end_.reset(fds[0]);
    write_end_.reset(fds[1]);
  }
  int read_fd() const { return read_end_.get(); }
  void signal() {
    const char byte = 1;
    [[maybe_unused]] const ssize_t written = ::write(write_end_.get(), &byte, 1);
  }

 private:
  UniqueFd read_end_, write_end_;
};

enum class Readiness { Ready, Woken, TimedOut };

// Waits until `fd` has `events`, `wake_fd` (if >= 0) is readable, or the deadline passes.
Readiness wait_fd(int fd, short events, Deadline deadline, int wake_fd) {
  while (true) {
    pollfd fds[2] = {{fd, events, 0}, {wake_fd, POLLIN, 0}};
    int timeout_ms = -1;
    if (deadline != Deadline::max()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT_MAX));
    }
    const int ready = ::poll(fds, wake_fd >= 0 ? 2 : 1, timeout_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) throw Error("poll on a store socket failed: " + errno_text(errno));
    if (wake_fd >= 0 && fds[1].revents != 0) return Readiness::Woken;
    if (fds[0].revents != 0) return Readiness::Ready;  // errors too: recv/send report them
    if (Clock::now() >= deadline) return Readiness::TimedOut;
  }
}

// One end of a connection, as seen from this process: the socket, how messages name the other
// end ("127.0.0.1:40112", "the store at node0:29500"), and the server's stop pipe (or -1).
struct Endpoint {
  int fd = -1;
  std::string name;
  int wake_fd = -1;
};

// Reads exactly `size` bytes. Returns false only when `at_frame_start` and the peer closed
// the connection before the first byte (a clean hang-up between frames).
bool read_exact(const Endpoint& peer, char* data, size_t size, Deadline deadline,
                double body_seconds, bool at_frame_start) {
  size_t got = 0;
  while (got < size) {
    const ssize_t n = ::recv(peer.fd, data + got, size - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n == 0) {
      if (got == 0 && at_frame_start) return false;
      throw Error(peer.name + " closed the connection in the middle of a message");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      const Readiness readiness = wait_fd(peer.fd, POLLIN, deadline, peer.wake_fd);
      if (readiness == Readiness::Woken) throw Stopped{};
      if (readiness == Readiness::TimedOut)
        throw Error(peer.name + " began a message and sent nothing more for " +
                    seconds_text(body_seconds));
    } else if (errno != EINTR) {
      throw Error("reading from " + peer.name + " failed: " + errno_text(errno));
    }
  }
  return true;
}

void write_all(const Endpoint& peer, const std::string& bytes, double seconds) {
  const Deadline deadline = deadline_after(seconds);
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(peer.fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      const Readiness readiness = wait_fd(peer.fd, POLLOUT, deadline, peer.wake_fd);
      if (readiness == Readiness::Woken) throw Stopped{};
      if (readiness == Readiness::TimedOut)
        throw Error(peer.name + " took no more of a message for " + seconds_text(seconds));
    } else if (errno != EINTR) {
      throw Error("writing to " + peer.name + " failed: " + errno_text(errno));
    }
  }
}

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t get_le(const char* data, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{static_cast<unsigned char>(data[i])} << (8 * i);
  return value;
}

struct Frame {
  uint8_t code = 0;
  std::vector<std::string> fields;
};

std::string encode_frame(uint8_t code, const std::vector<std::string>& fields) {
  uint64_t payload = 0;
  for (const std::string& field : fields) payload += field.size();
  DSTRAIN_CHECK(fields.size() <= kMaxStoreFields && payload <= kMaxStoreMessageBytes)
      << "a store message of " << fields.size() << " fields and " << payload
      << " bytes exceeds the limit of " << kMaxStoreFields << " fields and "
      << kMaxStoreMessageBytes << " bytes";
  std::string bytes;
  bytes.reserve(kHeaderBytes + 8 * fields.size() + payload);
  put_le(bytes, kMagic, 4);
  put_le(bytes, code, 1);
  put_le(bytes, fields.size(), 4);
  for (const std::string& field : fields) {
    put_le(bytes, field.size(), 8);
    bytes += field;
  }
  return bytes;
}

// Reads one frame: waits up to `first_byte_seconds` (infinity: until woken) for it to begin,
// then gives the rest `body_seconds`. Returns nothing when the peer hung up between frames.
std::optional<Frame> read_frame(const Endpoint& peer, double first_byte_seconds,
                                double body_seconds) {
  const Readiness readiness =
      wait_fd(peer.fd, POLLIN, deadline_after(first_byte_seconds), peer.wake_fd);
  if (readiness == Readiness::Woken) throw Stopped{};
  if (readiness == Readiness::TimedOut)
    throw Error(peer.name + " did not answer within " + seconds_text(first_byte_seconds));
  const Deadline deadline = deadline_after(body_seconds);
  char header[kHeaderBytes];
  if (!read_exact(peer, header, kHeaderBytes, deadline, body_seconds, true)) return std::nullopt;
  if (get_le(header, 4) != kMagic)
    throw Error(peer.name + " sent bytes that are not a dstrain store message");
  Frame frame;
  frame.code = static_cast<uint8_t>(header[4]);
  const uint64_t count = get_le(header + 5, 4);
  if (count > kMaxStoreFields)
    throw Error(peer.name + " sent a message of " + std::to_string(count) +
                " fields, more than the " + std::to_string(kMaxStoreFields) + " allowed");
  uint64_t budget = kMaxStoreMessageBytes;
  for (uint64_t i = 0; i < count; ++i) {
    char length_bytes[8];
    read_exact(peer, length_bytes, 8, deadline, body_seconds, false);
    const uint64_t length = get_le(length_bytes, 8);
    if (length > budget)
      throw Error(peer.name + " sent a field of " + std::to_string(length) +
                  " bytes, more than the " + std::to_string(kMaxStoreMessageBytes) +
                  " bytes a store message may hold");
    budget -= length;
    std::string& field = frame.fields.emplace_back(length, '\0');
    read_exact(peer, field.data(), length, deadline, body_seconds, false);
  }
  return frame;
}

std::string encode_int64(int64_t value) {
  std::string bytes;
  put_le(bytes, static_cast<uint64_t>(value), 8);
  return bytes;
}

std::optional<int64_t> decode_int64(const std::string& bytes) {
  if (bytes.size() != 8) return std::nullopt;
  return static_cast<int64_t>(get_le(bytes.data(), 8));
}

std::optional<int64_t> parse_decimal(const std::string& text) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// A get/wait's timeout as sent: whole milliseconds, rounded up.
std::string encode_timeout(double seconds) {
  return encode_int64(static_cast<int64_t>(std::ceil(std::clamp(seconds, 0.0, 1e7) * 1000)));
}

void set_no_delay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::string ipv4_text(const sockaddr_in& address) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address.sin_addr, text, sizeof text);
  return std::string(text) + ":" + std::to_string(ntohs(address.sin_port));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Server

struct TcpStoreServer::State {
  struct Connection {
    std::thread thread;
    bool finished = false;
  };

  double timeout_seconds = 0;
  int port = 0;
  UniqueFd listener;
  WakePipe stop_accepting, stop_serving;
  std::thread acceptor;

  std::mutex mutex;                             // guards everything below
  std::condition_variable values_changed;       // a key was set or added, or stopping
  std::condition_variable connection_finished;  // for stop()'s linger
  std::map<std::string, std::string> values;
  std::list<Connection> connections;  // a list: a Connection never moves while its thread runs
  std::deque<std::string> errors;
  bool stopping = false;
  bool stopped = false;

  // REQUIRES: mutex held.
  void record_error_locked(const std::string& text) {
    errors.push_back(text);
    if (errors.size() > kMaxKeptErrors) errors.pop_front();
  }
  void record_error(const std::string& text) {
    std::lock_guard<std::mutex> lock(mutex);
    record_error_locked(text);
  }
};

namespace {

using State = TcpStoreServer::State;

Frame reply(Status status, std::vector<std::string> fields = {}) {
  return Frame{status, std::move(fields)};
}

Frame failed(const std::string& text) { return reply(kFailed, {text}); }

// Blocks until every key exists (kOk), the deadline passes (kTimedOut) or the server stops.
Status wait_for_keys(State& state, std::unique_lock<std::mutex>& lock,
                     std::span<const std::string> keys, Deadline deadline) {
  const auto all_present = [&] {
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& key) { return state.values.count(key) != 0; });
  };
  state.values_changed.wait_until(lock, deadline, [&] { return state.stopping || all_present(); });
  if (all_present()) return kOk;
  return state.stopping ? kFailed : kTimedOut;
}

Deadline request_deadline(const std::string& timeout_field) {
  const int64_t milliseconds = std::max<int64_t>(decode_int64(timeout_field).value_or(0), 0);
  return deadline_after(static_cast<double>(milliseconds) / 1000.0);
}

Frame handle_get(State& state, std::vector<std::string>& fields) {
  if (fields.size() != 2 || !decode_int64(fields[1])) return failed("malformed get request");
  std::unique_lock<std::mutex> lock(state.mutex);
  const Status status = wait_for_keys(state, lock, {&fields[0], 1}, request_deadline(fields[1]));
  if (status == kOk) return reply(kOk, {state.values[fields[0]]});
  return status == kFailed ? failed("the store stopped") : reply(kTimedOut);
}

Frame handle_wait(State& state, std::vector<std::string>& fields) {
  if (fields.empty() || !decode_int64(fields[0])) return failed("malformed wait request");
  std::unique_lock<std::mutex> lock(state.mutex);
  const std::span<const std::string> keys(fields.data() + 1, fields.size() - 1);
  const Status status = wait_for_keys(state, lock, keys, request_deadline(fields[0]));
  return status == kFailed ? failed("the store stopped") : reply(status);
}

Frame handle_add(State& state, std::vector<std::string>& fields) {
  const std::optional<int64_t> delta = fields.size() == 2 ? decode_int64(fields[1]) : std::nullopt;
  if (!delta) return failed("malformed add request");
  std::lock_guard<std::mutex> lock(state.mutex);
  std::string& stored = state.values[fields[0]];  // absent: "" reads as 0
  const std::optional<int64_t> current = stored.empty() ? int64_t{0} : parse_decimal(stored);
  if (!current) return failed("the value of '" + fields[0] + "' is not an integer");
  int64_t sum = 0;
  if (__builtin_add_overflow(*current, *delta, &sum)) return failed("add overflows int64");
  stored = std::to_string(sum);
  state.values_changed.notify_all();
  return reply(kOk, {stored});
}

Frame handle_request(State& state, Frame& request) {
  std::vector<std::string>& fields = request.fields;
  switch (request.code) {
    case kSet: {
      if (fields.size() != 2) return failed("malformed set request");
      std::lock_guard<std::mutex> lock(state.mutex);
      state.values[fields[0]] = std::move(fields[1]);
      state.values_changed.notify_all();
      return reply(kOk);
    }
    case kGet:
      return handle_get(state, fields);
    case kAdd:
      return handle_add(state, fields);
    case kWait:
      return handle_wait(state, fields);
    case kCheck: {
      std::lock_guard<std::mutex> lock(state.mutex);
      std::string present;
      for (const std::string& key : fields) present.push_back(state.values.count(key) ? 1 : 0);
      return reply(kOk, {present});
    }
    default:
      return failed("unknown operation " + std::to_string(request.code));
  }
}

// A connection's thread: answers requests until the peer hangs up, sends something malformed,
// or the server stops.
void serve_connection(State& state, State::Connection& connection, UniqueFd fd,
                      const std::string& peer_name) {
  const Endpoint peer{fd.get(), peer_name, state.stop_serving.read_fd()};
  try {
    while (std::optional<Frame> request = read_frame(peer, INFINITY, state.timeout_seconds)) {
      const Frame answer = handle_request(state, *request);
      write_all(peer, encode_frame(answer.code, answer.fields), state.timeout_seconds);
    }
  } catch (const Stopped&) {
  } catch (const std::exception& e) {  // an Error naming the peer, or bad_alloc
    state.record_error(e.what());
  }
  fd.reset();
  std::lock_guard<std::mutex> lock(state.mutex);
  connection.finished = true;
  state.connection_finished.notify_all();
}

// Joins the threads of connections that have ended. REQUIRES: state.mutex held.
void reap_finished(State& state) {
  for (auto it = state.connections.begin(); it != state.connections.end();) {
    if (!it->finished) {
      ++it;
      continue;
    }
    it->thread.join();
    it = state.connections.erase(it);
  }
}

void accept_one(State& state) {
  sockaddr_in address{};
  socklen_t length = sizeof address;
  UniqueFd fd(::accept4(state.listener.get(), reinterpret_cast<sockaddr*>(&address), &length,
                        SOCK_NONBLOCK | SOCK_CLOEXEC));
  if (fd.get() < 0) {
    if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
      state.record_error("accept on port " + std::to_string(state.port) +
                         " failed: " + errno_text(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // EMFILE: let some close
    }
    return;
  }
  set_no_delay(fd.get());
  const std::string peer_name = ipv4_text(address);
  std::lock_guard<std::mutex> lock(state.mutex);
  reap_finished(state);
  if (state.connections.size() >= kMaxConnections) {
    state.record_error_locked("refused " + peer_name + ": " + std::to_string(kMaxConnections) +
                              " connections are open");
    return;
  }
  State::Connection& connection = state.connections.emplace_back();
  connection.thread = std::thread(serve_connection, std::ref(state), std::ref(connection),
                                  std::move(fd), peer_name);
}

void accept_connections(State& state) {
  while (true) {
    const Readiness readiness =
        wait_fd(state.listener.get(), POLLIN, Deadline::max(), state.stop_accepting.read_fd());
    if (readiness != Readiness::Ready) return;
    accept_one(state);
  }
}

UniqueFd listen_on(int port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) throw Error("socket for the store server failed: " + errno_text(errno));
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    const int error = errno;
    DSTRAIN_USER_CHECK(error != EADDRINUSE)
        << "port " << port << " is already in use on this machine: choose another "
        << "--master-port (MASTER_PORT) or stop the process that holds it.";
    DSTRAIN_USER_CHECK(error != EACCES)
        << "this user may not listen on port " << port << ": choose a --master-port (MASTER_PORT) "
        << "above 1023.";
    throw Error("bind of the store server to port " + std::to_string(port) +
                " failed: " + errno_text(error));
  }
  if (::listen(fd.get(), SOMAXCONN) != 0)
    throw Error("listen on port " + std::to_string(port) + " failed: " + errno_text(errno));
  return fd;
}

int bound_port(int fd) {
  sockaddr_in address{};
  socklen_t length = sizeof address;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0)
    throw Error("getsockname of the store server failed: " + errno_text(errno));
  return ntohs(address.sin_port);
}

}  // namespace

TcpStoreServer::TcpStoreServer(int port, double timeout_seconds) : state_(new State) {
  DSTRAIN_CHECK(port >= 0 && port <= 65535) << "port " << port;
  DSTRAIN_CHECK(timeout_seconds > 0) << "timeout " << timeout_seconds;
  state_->timeout_seconds = timeout_seconds;
  state_->listener = listen_on(port);
  state_->port = bound_port(state_->listener.get());
  state_->acceptor = std::thread(accept_connections, std::ref(*state_));
}

TcpStoreServer::~TcpStoreServer() { stop(0); }

int TcpStoreServer::port() const { return state_->port; }

void TcpStoreServer::stop(double linger_seconds) {
  State& state = *state_;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.stopped) return;
    state.stopped = true;
  }
  state.stop_accepting.signal();
  state.acceptor.join();
  state.listener.reset();
  {
    std::unique_lock<std::mutex> lock(state.mutex);
    state.connection_finished.wait_until(lock, deadline_after(linger_seconds), [&] {
      return std::all_of(state.connections.begin(), state.connections.end(),
                         [](const State::Connection& c) { return c.finished; });
    });
    state.stopping = true;
    state.values_changed.notify_all();
  }
  state.stop_serving.signal();
  // The acceptor has ended: nobody else touches the list now.
  for (State::Connection& connection : state.connections) connection.thread.join();
  state.connections.clear();
}

std::vector<std::string> TcpStoreServer::connection_errors() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return {state_->errors.begin(), state_->errors.end()};
}

// ---------------------------------------------------------------------------------------------
// Client

namespace {

// Connecting to a local port nobody listens on can, rarely, connect a socket to itself (TCP
// simultaneous open, when the kernel picks that port as the source).
bool connected_to_itself(int fd) {
  sockaddr_in self{}, peer{};
  socklen_t self_length = sizeof self, peer_length = sizeof peer;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &self_length);
  ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length);
  return self.sin_port == peer.sin_port && self.sin_addr.s_addr == peer.sin_addr.s_addr;
}

// One connection attempt to `address`: the socket, or an invalid one with `last_error` saying
// why.
UniqueFd connect_once(const addrinfo& address, Deadline deadline, std::string& last_error) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) throw Error("socket for a store client failed: " + errno_text(errno));
  int error = 0;
  if (::connect(fd.get(), address.ai_addr, address.ai_addrlen) != 0) error = errno;
  if (error == EINPROGRESS) {
    if (wait_fd(fd.get(), POLLOUT, deadline, -1) == Readiness::TimedOut) {
      last_error = "connecting timed out";
      return UniqueFd();
    }
    socklen_t length = sizeof error;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
  }
  if (error != 0) {
    last_error = errno_text(error);
    return UniqueFd();
  }
  if (connected_to_itself(fd.get())) {
    last_error = "the socket connected to itself";
    return UniqueFd();
  }
  set_no_delay(fd.get());
  return fd;
}

// One attempt at each IPv4 address of host:port. A host name that cannot exist is a UserError
// at once; a failed lookup that may pass (no DNS yet) is only `last_error`.
UniqueFd try_connect(const std::string& host, int port, Deadline deadline,
                     std::string& last_error) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  DSTRAIN_USER_CHECK(resolved != EAI_NONAME)
      << "the rendezvous host '" << host << "' has no IPv4 address (" << gai_strerror(resolved)
      << "): check --master-addr (MASTER_ADDR).";
  if (resolved != 0) {
    last_error = std::string("resolving the host: ") + gai_strerror(resolved);
    return UniqueFd();
  }
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(found, ::freeaddrinfo);
  for (const addrinfo* address = found; address != nullptr; address = address->ai_next) {
    UniqueFd fd = connect_once(*address, deadline, last_error);
    if (fd.get() >= 0) return fd;
  }
  return UniqueFd();
}

UniqueFd connect_with_retry(const std::string& host, int port, double timeout_seconds) {
  const Deadline deadline = deadline_after(timeout_seconds);
  auto pause = std::chrono::milliseconds(10);
  std::string last_error = "no attempt";
  while (true) {
    UniqueFd fd = try_connect(host, port, deadline, last_error);
    if (fd.get() >= 0) return fd;
    const Clock::time_point now = Clock::now();
    DSTRAIN_USER_CHECK(now < deadline)
        << "could not reach the rendezvous store at " << host << ":" << port << " within "
        << seconds_text(timeout_seconds) << " (" << last_error << "): start node 0 with this "
        << "--master-addr and --master-port, and check that this machine can reach it.";
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::milliseconds(250));
  }
}

std::string quoted_list(const std::vector<std::string>& keys) {
  std::string text;
  for (size_t i = 0; i < keys.size(); ++i) text += (i ? ", '" : "'") + keys[i] + "'";
  return text;
}

}  // namespace

TcpStoreClient::TcpStoreClient(std::string host, int port, double timeout_seconds)
    : address_(host + ":" + std::to_string(port)), timeout_seconds_(timeout_seconds) {
  DSTRAIN_CHECK(port > 0 && port <= 65535) << "port " << port;
  DSTRAIN_CHECK(timeout_seconds > 0) << "timeout " << timeout_seconds;
  fd_ = connect_with_retry(host, port, timeout_seconds).release();
}

std::string TcpStoreClient::local_address() const {
  sockaddr_in local{};
  socklen_t length = sizeof local;
  DSTRAIN_CHECK(fd_ >= 0 && ::getsockname(fd_, reinterpret_cast<sockaddr*>(&local), &length) == 0 &&
                local.sin_family == AF_INET)
      << "the local address of the connection to the store at " << address_;
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text);
  return text;
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

TcpStoreClient::Reply TcpStoreClient::call(uint8_t operation,
                                           const std::vector<std::string>& fields,
                                           double reply_seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0)
    throw Error("the connection to the store at " + address_ + " was closed by an earlier error");
  const Endpoint peer{fd_, "the store at " + address_, -1};
  const std::string request = encode_frame(operation, fields);  // too big: nothing is sent
  try {
    write_all(peer, request, timeout_seconds_);
    std::optional<Frame> frame = read_frame(peer, reply_seconds, timeout_seconds_);
    if (!frame) throw Error(peer.name + " closed the connection");
    return Reply{frame->code, std::move(frame->fields)};
  } catch (const Error&) {
    ::close(std::exchange(fd_, -1));  // out of step with the server now
    throw;
  }
}

TcpStoreClient::Reply TcpStoreClient::call_checked(uint8_t operation,
                                                   const std::vector<std::string>& fields,
                                                   double reply_seconds, const std::string& what) {
  Reply answer = call(operation, fields, reply_seconds);
  if (answer.status == kFailed) {
    const std::string reason = answer.fields.empty() ? "no reason given" : answer.fields[0];
    throw Error(what + " failed at the store at " + address_ + ": " + reason);
  }
  if (answer.status != kOk && answer.status != kTimedOut)
    throw Error("the store at " + address_ + " answered " + what + " with the unknown status " +
                std::to_string(answer.status));
  return answer;
}

void TcpStoreClient::set(const std::string& key, const std::string& value) {
  call_checked(kSet, {key, value}, timeout_seconds_, "set '" + key + "'");
}

std::string TcpStoreClient::get(const std::string& key) {
  Reply answer = call_checked(kGet, {key, encode_timeout(timeout_seconds_)},
                              timeout_seconds_ + kReplyGraceSeconds, "get '" + key + "'");
  if (answer.status == kTimedOut)
    throw Error("key '" + key + "' was not set in the store at " + address_ + " within " +
                seconds_text(timeout_seconds_));
  if (answer.fields.size() != 1)
    throw Error("the store at " + address_ + " answered get '" + key + "' with " +
                std::to_string(answer.fields.size()) + " fields instead of 1");
  return std::move(answer.fields[0]);
}

int64_t TcpStoreClient::add(const std::string& key, int64_t delta) {
  const Reply answer =
      call_checked(kAdd, {key, encode_int64(delta)}, timeout_seconds_, "add '" + key + "'");
  const std::optional<int64_t> sum =
      answer.fields.size() == 1 ? parse_decimal(answer.fields[0]) : std::nullopt;
  if (!sum || answer.status != kOk)
    throw Error("the store at " + address_ + " answered add '" + key + "' with no integer");
  return *sum;
}

bool TcpStoreClient::wait_for(const std::vector<std::string>& keys, double seconds) {
  std::vector<std::string> fields;
  fields.reserve(keys.size() + 1);
  fields.push_back(encode_timeout(seconds));
  fields.insert(fields.end(), keys.begin(), keys.end());
  const Reply answer =
      call_checked(kWait, fields, seconds + kReplyGraceSeconds, "wait for " + quoted_list(keys));
  return answer.status == kOk;
}

void TcpStoreClient::wait(const std::vector<std::string>& keys) {
  if (wait_for(keys, timeout_seconds_)) return;
  const std::vector<bool> present = check(keys);
  std::vector<std::string> missing;
  for (size_t i = 0; i < keys.size(); ++i)
    if (!present[i]) missing.push_back(keys[i]);
  if (missing.empty()) return;  // they arrived between the timeout and the check
  throw Error((missing.size() == 1 ? "key " : "keys ") + quoted_list(missing) +
              (missing.size() == 1 ? " was" : " were") + " not set in the store at " + address_ +
              " within " + seconds_text(timeout_seconds_));
}

std::vector<bool> TcpStoreClient::check(const std::vector<std::string>& keys) {
  const Reply answer = call_checked(kCheck, keys, timeout_seconds_, "check");
  if (answer.fields.size() != 1 || answer.fields[0].size() != keys.size())
    throw Error("the store at " + address_ + " answered check with a malformed reply");
  std::vector<bool> present(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) present[i] = answer.fields[0][i] != 0;
  return present;
}

}  // namespace dstrain
