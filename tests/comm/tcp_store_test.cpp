// The rendezvous store (comm/tcp_store.h): a server and several clients on threads over
// 127.0.0.1 on a port the system picks. Semantics of set/get/add/wait/check, timeouts that name
// the key, exact concurrent adds, values of several MiB, and a server that survives garbage,
// oversized lengths and peers that vanish mid-message (each recorded as an Error naming the
// peer), and a client that reports a broken server by its address instead of hanging.
// Timeouts are short (well under a second); no test asserts on wall-clock time.
#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/rng.h"

namespace dstrain::test {
namespace {

constexpr double kLongTimeout = 10.0;  // never fires unless something is broken
constexpr double kShortTimeout = 0.3;  // for the tests of timeouts

// The message of the exception E that f throws ("" and a failure when it throws none).
template <class E = Error, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception of the expected type was thrown";
  return "";
}

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\n  message: " << text << "\n  lacks:   " << part;
}

// A port nobody listens on now (the system's pick, released at once).
int free_port() { return TcpStoreServer(0, kLongTimeout).port(); }

// Deterministic, non-zero bytes, NULs included.
std::string test_bytes(size_t size, uint64_t seed) {
  std::string bytes(size, '\0');
  uint64_t state = seed;
  for (char& byte : bytes) byte = static_cast<char>(splitmix64(state));
  return bytes;
}

// A plain blocking socket, for speaking to the server (or as a fake server) byte by byte.
class RawSocket {
 public:
  explicit RawSocket(int fd) : fd_(fd) {
    const timeval limit{5, 0};  // a test's recv never hangs
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  }
  ~RawSocket() { close(); }
  static RawSocket connect_to(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(port));
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    return RawSocket(fd);
  }
  RawSocket(RawSocket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  void send(const std::string& bytes) {
    EXPECT_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  // Everything until the peer closes (or 5 s of silence).
  std::string read_to_end() {
    std::string bytes;
    char chunk[4096];
    ssize_t n = 0;
    while ((n = ::recv(fd_, chunk, sizeof chunk, 0)) > 0)
      bytes.append(chunk, static_cast<size_t>(n));
    return bytes;
  }
  std::string read(size_t size) {
    std::string bytes(size, '\0');
    EXPECT_EQ(::recv(fd_, bytes.data(), size, MSG_WAITALL), static_cast<ssize_t>(size));
    return bytes;
  }
  // "127.0.0.1:<port>", as the server names this end.
  std::string local_name() const {
    sockaddr_in address{};
    socklen_t length = sizeof address;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length);
    return "127.0.0.1:" + std::to_string(ntohs(address.sin_port));
  }
  void close() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }

 private:
  int fd_;
};

std::string le(uint64_t value, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  return out;
}

// The header of a frame: magic "DSTS", code, field count.
std::string frame_header(uint8_t code, uint32_t count) {
  return "DSTS" + le(code, 1) + le(count, 4);
}

// Waits (at most 5 s) until the server has recorded `count` connection errors; returns them.
std::vector<std::string> await_errors(const TcpStoreServer& server, size_t count) {
  for (int i = 0; i < 500 && server.connection_errors().size() < count; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return server.connection_errors();
}

// Sends `bytes` to the server from a raw socket, then closes it (or, with keep_open, waits
// for the server to close it). Returns the name the server knows the socket by.
std::string send_raw(const TcpStoreServer& server, const std::string& bytes, bool keep_open) {
  RawSocket raw = RawSocket::connect_to(server.port());
  const std::string name = raw.local_name();
  raw.send(bytes);
  if (keep_open) {
    EXPECT_EQ(raw.read_to_end(), "") << "the server answered a malformed frame";
  }
  return name;
}

TEST(TcpStore, SetThenGetReturnsTheValueFromAnyClient) {
  TcpStoreServer server(0, kLongTimeout);
  TcpStoreClient writer("127.0.0.1", server.port(), kLongTimeout);
  TcpStoreClient reader("127.0.0.1", server.port(), kLongTimeout);
  writer.set("greeting", "hello");
  EXPECT_EQ(reader.get("greeting"), "hello");
  writer.set("greeting", "replaced");
  EXPECT_EQ(reader.get("greeting"), "replaced");
  const std::string binary("a\0b\xff", 4);
  writer.set(std::string("key\0with nul", 12), binary);
  EXPECT_EQ(reader.get(std::string("key\0with nul", 12)), binary);
  writer.set("empty", "");
  EXPECT_EQ(reader.get("empty"), "");
}

TEST(TcpStore, HostNamesResolve) {
  TcpStoreServer server(0, kLongTimeout);
  TcpStoreClient client("localhost", server.port(), kLongTimeout);
  client.set("k", "v");
  EXPECT_EQ(client.get("k"), "v");
  EXPECT_EQ(client.address(), "localhost:" + std::to_string(server.port()));
}

TEST(TcpStore, GetBlocksUntilAnotherClientSets) {
  TcpStoreServer server(0, kLongTimeout);
  std::string got;
  std::thread reader([&] {
    TcpStoreClient client("127.0.0.1", server.port(), kLongTimeout);
    got = client.get("late");
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  TcpStoreClient writer("127.0.0.1", server.port(), kLongTimeout);
  writer.set("late", "arrived");
  reader.join();
  EXPECT_EQ(got, "arrived");
}

TEST(TcpStore, GetOfAMissingKeyTimesOutNamingTheKeyAndTheConnectionStaysUsable) {
  TcpStoreServer server(0, kLongTimeout);
  TcpStoreClient client("127.0.0.1", server.port(), kShortTimeout);
  const std::string message = error_of([&] { client.get("never-set"); });
  EXPECT_TRUE(contains(message, "key 'never-set' was not set in the store at 127.0.0.1:" +
                                    std::to_string(server.port()) + " within 0.3 s"));
  client.set("after", "the timeout");  // the server answered in step: no stray reply
  EXPECT_EQ(client.get("after"), "the timeout");
}

TEST(TcpStore, AddCountsFromZeroAndGetReadsTheDecimal) {
  TcpStoreServer server(0, kLongTimeout);
  TcpStoreClient client("127.0.0.1", server.port(), kLongTimeout);
  EXPECT_EQ(client.add("counter", 5), 5);
  EXPECT_EQ(client.add("counter", -7), -2);
  EXPECT_EQ(client.get("counter"), "-2");
  client.set("word", "seven");
  EXPECT_TRUE(
      contains(error_of([&] { client.add("word", 1); }),
               "add 'word' failed at the store at 127.0.0.1:" + std::to_string(server.port()) +
                   ": the value of 'word' is not an integer"));
  client.set("near-max", std::to_string(INT64_MAX));
  EXPECT_TRUE(contains(error_of([&] { client.add("near-max", 1); }), "overflows"));
  EXPECT_EQ(client.add("counter", 2), 0);  // failed adds leave the connection usable
}

TEST(TcpStore, ConcurrentAddsFromEightClientsSumExactly) {
  TcpStoreServer server(0, kLongTimeout);
  constexpr int kClients = 8, kAddsEach = 250;
  std::vector<std::vector<int64_t>> seen(kClients);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      TcpStoreClient client("127.0.0.1", server.port(), kLongTimeout);
      for (int i = 0; i < kAddsEach; ++i) seen[c].push_back(client.add("total", 1));
    });
  }
  for (std::thread& thread : threads) thread.join();
  TcpStoreClient client("127.0.0.1", server.port(), kLongTimeout);
  EXPECT_EQ(client.get("total"), std::to_string(kClients * kAddsEach));
  // Atomic: every add saw a different total, together exactly 1..N.
  std::set<int64_t> totals;
  for (const std::vector<int64_t>& values : seen) totals.insert(values.begin(), values.end());
  EXPECT_EQ(totals.size(), static_cast<size_t>(kClients * kAddsEach));
  EXPECT_EQ(*totals.begin(), 1);
  EXPECT_EQ(*totals.rbegin(), kClients * kAddsEach);
}

TEST(TcpStore, WaitReturnsOnceEveryKeyIsSetAndNamesTheMissingOnes) {
  TcpStoreServer server(0, kLongTimeout);
  TcpStoreClient setter("127.0.0.1", server.port(), kLongTimeout);
  std::atomic<bool> waited{false};
  std::thread waiter([&] {
    TcpStoreClient client("127.0.0.1", server.port(), kLongTimeout);
    client.wait({"first", "second"});
    waited = true;
  });
  setter.set("first", "1");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(waited) << "wait returned with a key missing";
  setter.set("second", "2");
  waiter.join();
  EXPECT_TRUE(waited);

  EXPECT_FALSE(setter.wait_for({"first", "third"}, 0.05));
  EXPECT_TRUE(setter.wait_for({"first", "second"}, 0.05));
  TcpStoreClient impatient("127.0.0.1", server.port(), kShortTimeout);
  const std::string message = error_of([&] { impatient.wait({"first", "third", "fourth"}); });
  EXPECT_TRUE(contains(message, "keys 'third', 'fourth' were not set in the store at"));
  EXPECT_FALSE(contains(message, "'first'"));
}

TEST(TcpStore, CheckSaysWhichKeysExistWithoutWaiting) {
  TcpStoreServer server(0, kLongTimeout);
  TcpStoreClient client("127.0.0.1", server.port(), kLongTimeout);
  client.set("b", "");
  client.add("c", 1);
  EXPECT_EQ(client.check({"a", "b", "c"}), (std::vector<bool>{false, true, true}));
  EXPECT_EQ(client.check({}), std::vector<bool>{});
}

TEST(TcpStore, ValuesOfSeveralMiBRoundTrip) {
  TcpStoreServer server(0, kLongTimeout);
  TcpStoreClient writer("127.0.0.1", server.port(), kLongTimeout);
  TcpStoreClient reader("127.0.0.1", server.port(), kLongTimeout);
  const std::string value = test_bytes(6 * 1024 * 1024 + 13, 7);
  writer.set("big", value);
  const std::string got = reader.get("big");
  ASSERT_EQ(got.size(), value.size());
  EXPECT_TRUE(got == value) << "the 6 MiB value came back different";
  const std::string too_big(kMaxStoreMessageBytes + 1, 'x');
  EXPECT_TRUE(contains(error_of([&] { writer.set("huge", too_big); }), "exceeds the limit"));
  EXPECT_EQ(writer.get("big").size(), value.size());  // refused before a byte was sent
}

TEST(TcpStore, GarbageIsRejectedNamingThePeerAndTheServerLivesOn) {
  TcpStoreServer server(0, kShortTimeout);
  const std::string http = send_raw(server, "GET / HTTP/1.1\r\nHost: x\r\n\r\n", true);
  // A length of 1 TiB must be refused, not allocated.
  const std::string huge = send_raw(server, frame_header(1, 2) + le(uint64_t{1} << 40, 8), true);
  const std::string fields = send_raw(server, frame_header(1, 100000), true);
  const std::string cut = send_raw(server, frame_header(1, 2) + le(100, 8) + "only ten b", false);
  const std::vector<std::string> errors = await_errors(server, 4);
  ASSERT_EQ(errors.size(), 4u);
  EXPECT_TRUE(contains(errors[0], http + " sent bytes that are not a dstrain store message"));
  EXPECT_TRUE(contains(errors[1], huge + " sent a field of 1099511627776 bytes, more than"));
  EXPECT_TRUE(contains(errors[2], fields + " sent a message of 100000 fields"));
  EXPECT_TRUE(contains(errors[3], cut + " closed the connection in the middle of a message"));

  TcpStoreClient client("127.0.0.1", server.port(), kLongTimeout);
  client.set("still", "serving");
  EXPECT_EQ(client.get("still"), "serving");
}

TEST(TcpStore, APeerSilentInTheMiddleOfAMessageIsDroppedAtTheTimeout) {
  TcpStoreServer server(0, kShortTimeout);
  RawSocket raw = RawSocket::connect_to(server.port());
  raw.send(frame_header(1, 2) + le(5, 8) + "ke");
  EXPECT_EQ(raw.read_to_end(), "");  // the server hangs up after 0.3 s of silence
  const std::vector<std::string> errors = await_errors(server, 1);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_TRUE(
      contains(errors[0], raw.local_name() + " began a message and sent nothing more for 0.3 s"));
}

TEST(TcpStore, AnUnknownOperationIsAnsweredWithAnErrorAndTheConnectionStays) {
  TcpStoreServer server(0, kLongTimeout);
  RawSocket raw = RawSocket::connect_to(server.port());
  raw.send(frame_header(99, 0));
  const std::string reply = raw.read(9 + 8);
  EXPECT_EQ(reply.substr(0, 4), "DSTS");
  EXPECT_EQ(reply[4], 2) << "not the failure status";
  const uint64_t length = static_cast<unsigned char>(reply[9]);
  EXPECT_EQ(raw.read(length), "unknown operation 99");
  raw.send(frame_header(5, 0));  // check of no keys: still served
  EXPECT_EQ(raw.read(9 + 8 + 0), frame_header(0, 1) + le(0, 8));
}

TEST(TcpStore, APortInUseIsAUserErrorNamingThePort) {
  TcpStoreServer first(0, kLongTimeout);
  const std::string message =
      error_of<UserError>([&] { TcpStoreServer second(first.port(), kLongTimeout); });
  EXPECT_TRUE(contains(
      message, "port " + std::to_string(first.port()) + " is already in use on this machine"));
}

TEST(TcpStore, AClientRetriesUntilTheServerStarts) {
  const int port = free_port();
  std::string got;
  std::thread early([&] {
    TcpStoreClient client("127.0.0.1", port, kLongTimeout);  // connects before the server is up
    got = client.get("ready");
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  TcpStoreServer server(port, kLongTimeout);
  TcpStoreClient late("127.0.0.1", port, kLongTimeout);
  late.set("ready", "yes");
  early.join();
  EXPECT_EQ(got, "yes");
}

TEST(TcpStore, AClientGivesUpAtItsTimeoutNamingTheAddress) {
  const int port = free_port();
  const std::string message =
      error_of<UserError>([&] { TcpStoreClient client("127.0.0.1", port, kShortTimeout); });
  EXPECT_TRUE(contains(message, "could not reach the rendezvous store at 127.0.0.1:" +
                                    std::to_string(port) + " within 0.3 s"));
}

TEST(TcpStore, StopEndsAGetBlockedOnTheServerWithAnError) {
  auto server = std::make_unique<TcpStoreServer>(0, kLongTimeout);
  TcpStoreClient client("127.0.0.1", server->port(), kLongTimeout);
  std::string message;
  std::thread blocked([&] { message = error_of([&] { client.get("never"); }); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  server->stop(0);
  blocked.join();
  const std::string address = "the store at 127.0.0.1:" + std::to_string(server->port());
  EXPECT_TRUE(contains(message, "get 'never' failed at " + address + ": the store stopped"));
  EXPECT_TRUE(contains(error_of([&] { client.set("k", "v"); }), address));  // it hung up
  EXPECT_TRUE(contains(error_of([&] { client.set("k", "v"); }), "closed by an earlier error"));
  server.reset();  // a second stop (the destructor's) does nothing
}

TEST(TcpStore, StopLingersUntilTheClientsHangUp) {
  TcpStoreServer server(0, kLongTimeout);
  auto client = std::make_unique<TcpStoreClient>("127.0.0.1", server.port(), kLongTimeout);
  client->set("last words", "kept");
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    server.stop(kLongTimeout);
    stopped = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(stopped) << "stop did not wait for the connected client";
  EXPECT_EQ(client->get("last words"), "kept");  // still served while lingering
  client.reset();
  stopper.join();
  EXPECT_TRUE(stopped);
}

// A fake server on a free port: accepts one connection, reads one request header, then does
// what `answer` says with the raw socket.
class FakeServer {
 public:
  explicit FakeServer(std::function<void(RawSocket&)> answer) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    socklen_t length = sizeof address;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    ::listen(listener_, 1);
    thread_ = std::thread([this, answer] {
      RawSocket peer(::accept(listener_, nullptr, nullptr));
      peer.read(9);
      answer(peer);
      peer.read_to_end();  // until the client hangs up
    });
  }
  ~FakeServer() {
    thread_.join();
    ::close(listener_);
  }
  int port() const { return port_; }

 private:
  int listener_ = -1;
  int port_ = 0;
  std::thread thread_;
};

// The error a client's check({}) gets from a fake server answering with `answer`.
std::string client_error_against(std::function<void(RawSocket&)> answer) {
  FakeServer fake(std::move(answer));
  TcpStoreClient client("127.0.0.1", fake.port(), kShortTimeout);
  const std::string message = error_of([&] { client.check({}); });
  EXPECT_TRUE(contains(message, "the store at 127.0.0.1:" + std::to_string(fake.port())));
  return message;
}

TEST(TcpStore, AServerThatBreaksOffAReplyIsAnErrorNamingIt) {
  EXPECT_TRUE(contains(client_error_against([](RawSocket& peer) {
                         peer.send(frame_header(0, 1) + le(50, 8) + "short");
                         peer.close();
                       }),
                       "closed the connection in the middle of a message"));
  EXPECT_TRUE(contains(client_error_against([](RawSocket& peer) { peer.close(); }),
                       "closed the connection"));
  EXPECT_TRUE(contains(client_error_against([](RawSocket& peer) { peer.send("HTTP/1.1 400"); }),
                       "sent bytes that are not a dstrain store message"));
  EXPECT_TRUE(contains(client_error_against([](RawSocket&) {}), "did not answer within 0.3 s"));
}

}  // namespace
}  // namespace dstrain::test
