// A small TCP key-value store through which the processes of a multi-node run meet, in the
// manner of torchrun's TCPStore: node 0 runs a TcpStoreServer on a thread of its process, and
// every node (node 0 too) talks to it through a TcpStoreClient.
//
// Semantics (those of TCPStore)
// - set(key, value) stores bytes under a key, replacing what was there.
// - get(key) blocks until the key exists, then returns its value; at the timeout it is an Error
//   naming the key.
// - add(key, delta) adds to the decimal integer stored under key (absent: 0), atomically across
//   clients, and returns the new value; get() of such a key reads the decimal text.
// - wait(keys) blocks until every key exists; wait_for() says whether they did in time.
// - check(keys) says which keys exist now, without waiting.
//
// Wire format: both directions send frames
//   magic u32 "DSTS" | code u8 | field count u32 | per field: length u64, bytes
// (integers little-endian). A request's code is its operation, a reply's its status. Keys and
// values are bytes (std::string as a byte container). One frame holds at most
// kMaxStoreMessageBytes of fields and kMaxStoreFields fields: a length beyond that, a wrong
// magic, or a peer that closes or falls silent inside a frame is a malformed message and a
// dstrain::Error naming the peer; no length read from the wire is allocated unchecked.
//
// Timeouts: every blocking call is bounded. A client's connect retries until its timeout (the
// server may start later); get/wait send their timeout with the request and the server answers
// "timed out" at it, so the connection stays in step; the client waits for any reply at most a
// little longer than the timeout. The server gives a peer `timeout_seconds` to finish a frame
// it has begun. On the server such an Error ends that connection only (connection_errors()
// keeps it); on a client it is thrown, and the connection is closed for good.
//
// Not TCPStore's: no compare_set, delete or num_keys (the rendezvous needs none); IPv4 only
// (the server listens on 0.0.0.0). The UserErrors of connecting and binding name the
// rendezvous flags (--master-addr, --master-port), the store's one user.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dstrain {

// The most bytes of fields one frame may carry, and the most fields.
constexpr uint64_t kMaxStoreMessageBytes = uint64_t{64} << 20;
constexpr uint32_t kMaxStoreFields = 65536;

class TcpStoreServer {
 public:
  // Listens on every IPv4 interface at `port` (0: a free port the system picks; port() says
  // which), with SO_REUSEADDR. A port already in use is a UserError naming it.
  // REQUIRES: 0 <= port <= 65535, timeout_seconds > 0.
  TcpStoreServer(int port, double timeout_seconds);
  // stop(0) unless stop() ran already.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const;
  // Stops accepting, waits up to `linger_seconds` for the connected clients to hang up (so a
  // value just set still reaches the clients that are about to read it), then closes every
  // connection: a client still blocked in get/wait gets an Error saying the store stopped.
  // Returns when every thread of the server has ended; a second call returns at once.
  void stop(double linger_seconds);
  // The Errors that ended connections (malformed frames, peers gone mid-frame), each naming
  // the peer, oldest first (the last 64). For diagnostics and tests.
  std::vector<std::string> connection_errors() const;

  struct State;  // the listener, the connections, the map; the server's threads use it

 private:
  std::unique_ptr<State> state_;
};

class TcpStoreClient {
 public:
  // Connects to `host` (an IPv4 address or a host name, resolved with getaddrinfo) at `port`,
  // retrying until `timeout_seconds` have passed; then a UserError naming host and port.
  // The same timeout bounds every later call. Calls from several threads are serialized.
  TcpStoreClient(std::string host, int port, double timeout_seconds);
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  void set(const std::string& key, const std::string& value);
  std::string get(const std::string& key);
  int64_t add(const std::string& key, int64_t delta);
  void wait(const std::vector<std::string>& keys);
  // True when every key exists within `seconds` (which may exceed the client's timeout).
  bool wait_for(const std::vector<std::string>& keys, double seconds);
  std::vector<bool> check(const std::vector<std::string>& keys);

  // "host:port", as messages name the store.
  const std::string& address() const { return address_; }
  double timeout_seconds() const { return timeout_seconds_; }
  // The IPv4 address of this end of the connection ("10.0.0.2"): the address of this machine
  // the store's host reaches it by, so a good one for peers on that network to connect to.
  std::string local_address() const;

 private:
  struct Reply {
    uint8_t status = 0;
    std::vector<std::string> fields;
  };

  // Sends one request and returns its reply; waits at most `reply_seconds` for it. After an
  // Error the connection is closed and every later call is an Error.
  Reply call(uint8_t operation, const std::vector<std::string>& fields, double reply_seconds);
  Reply call_checked(uint8_t operation, const std::vector<std::string>& fields,
                     double reply_seconds, const std::string& what);

  std::string address_;
  double timeout_seconds_;
  std::mutex mutex_;
  int fd_ = -1;
};

}  // namespace dstrain
