#include "tests/fuzz/fuzz_entries.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <thread>

#include "cli/config_file.h"
#include "cli/deepspeed_config.h"
#include "cli/train_flags.h"
#include "comm/tcp_store.h"
#include "core/check.h"
#include "core/fs.h"
#include "core/safetensors.h"
#include "data/bpe_tokenizer.h"
#include "data/chat_data.h"
#include "data/chat_template.h"
#include "data/conversations.h"
#include "data/loader.h"
#include "data/loss_mask.h"
#include "data/token_file.h"
#include "model/config.h"
#include "optim/grad_scaler.h"
#include "topology/nvidia_smi.h"
#include "topology/topology_json.h"
#include "train/checkpoint.h"
#include "train/weight_files.h"

namespace dstrain::fuzz {

namespace fs = std::filesystem;

namespace {

// ---------------------------------------------------------------------------------------------
// Helpers

std::string_view as_text(FuzzInput input) {
  return {reinterpret_cast<const char*>(input.data()), input.size()};
}

fs::path source_dir() { return fs::path(DSTRAIN_SOURCE_DIR); }

// This process's scratch directory (the entries whose parser takes a path write the input
// there), removed at exit.
class ScratchDir {
 public:
  ScratchDir()
      : path_(fs::temp_directory_path() / ("dstrain_fuzz_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

const fs::path& scratch() {
  static const ScratchDir dir;
  return dir.path();
}

// scratch()/relative, its folders created.
fs::path scratch_path(const std::string& relative) {
  const fs::path path = scratch() / relative;
  fs::create_directories(path.parent_path());
  return path;
}

void write_bytes(const fs::path& path, std::string_view bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!file) throw std::runtime_error("fuzz harness: cannot write " + path.string());
}

// The input as scratch()/relative.
std::string input_file(const std::string& relative, FuzzInput input) {
  const fs::path path = scratch_path(relative);
  write_bytes(path, as_text(input));
  return path.string();
}

// A property of a parsed input that the parser documents and breaks: a finding.
void require(bool condition, const std::string& what) {
  if (!condition) throw std::logic_error("fuzz property violated: " + what);
}

// ---------------------------------------------------------------------------------------------
// Files from the Hugging Face hub

void run_safetensors(FuzzInput input) {
  const std::string path = input_file("safetensors/model.safetensors", input);
  try {
    const SafetensorsFile file = SafetensorsFile::open(path);
    for (const std::string& name : file.names()) {
      const SafetensorsTensorInfo& info = file.info(name);
      require(info.offset + info.nbytes <= fs::file_size(path), "a tensor past the file's end");
      (void)file.data(name);
      try {
        (void)file.tensor(name);
      } catch (const UserError&) {  // more dims than a Tensor holds
      }
      try {
        (void)file.read_f32(name);
      } catch (const UserError&) {  // I32
      }
    }
  } catch (const UserError&) {
  }
}

// model.safetensors.index.json next to the shards of tests/reference/llama_tiny.
void run_safetensors_index(FuzzInput input) {
  static const fs::path dir = [] {
    const fs::path shards = scratch_path("index/x").parent_path();
    for (const auto& entry : fs::directory_iterator(source_dir() / "tests/reference/llama_tiny")) {
      if (entry.path().filename().string().starts_with("model-")) {
        fs::copy_file(entry.path(), shards / entry.path().filename(),
                      fs::copy_options::overwrite_existing);
      }
    }
    return shards;
  }();
  const fs::path index = dir / "model.safetensors.index.json";
  write_bytes(index, as_text(input));
  try {
    const WeightFiles files = WeightFiles::open(index);
    for (const std::string& name : files.names()) (void)files.file_of(name).info(name);
  } catch (const UserError&) {
  }
}

void run_model_config(FuzzInput input) {
  try {
    const ModelConfig config = model_config_from_json(std::string(as_text(input)), "config.json");
    (void)config.num_parameters();
    (void)config.to_json().dump();
  } catch (const UserError&) {
  }
}

// A text with what the tokenizers treat specially: added tokens, spaces, newlines, non-ASCII.
constexpr std::string_view kSampleText =
    "Hello world!<|endoftext|> naïve café, 日本語\n\n    indented\tline <s>[INST] 12345 </s>"
    " don't  ▁x <0x0A>\r\n";

// The documented properties of encode(text, spans) and safe_prefix_length(text).
// every_byte: the vocabulary spells every byte (all 256 characters, or byte fallback); lossless:
// decode_bytes gives the text back (byte-level without a normalizer).
void check_encoding(BpeTokenizer& tokenizer, std::string_view text, bool every_byte,
                    bool lossless) {
  std::vector<BpeTokenizer::TokenSpan> spans;
  const std::vector<int32_t> ids = tokenizer.encode(text, spans);
  require(spans.size() == ids.size(), "one span per id");
  for (size_t i = 0; i < spans.size(); ++i) {
    require(spans[i].begin <= spans[i].end && spans[i].end <= text.size(), "a span in the text");
    if (i > 0) {
      require(spans[i].begin >= spans[i - 1].begin && spans[i].end >= spans[i - 1].end,
              "spans rise with the ids");
    }
  }
  (void)tokenizer.decode(ids);
  const std::string bytes = tokenizer.decode_bytes(ids);
  if (every_byte) {
    require(ids.empty() || spans.back().end == text.size(), "the last span ends the text");
  }
  if (lossless) require(bytes == text, "decode_bytes(encode(text)) == text");
  const size_t prefix = tokenizer.safe_prefix_length(text);
  require(prefix <= text.size(), "a safe prefix inside the text");
  if (prefix > 0) {
    const std::vector<int32_t> head = tokenizer.encode(text.substr(0, prefix));
    require(head.size() <= ids.size() && std::equal(head.begin(), head.end(), ids.begin()),
            "the safe prefix encodes to the first ids of the whole text");
  }
}

void run_tokenizer(FuzzInput input) {
  try {
    BpeTokenizer tokenizer = BpeTokenizer::from_json(as_text(input), "tokenizer.json");
    (void)tokenizer.vocab_size();
    (void)tokenizer.end_of_text_id();
    (void)tokenizer.token_id("Hello");
    check_encoding(tokenizer, kSampleText, false, false);
  } catch (const UserError&) {
  }
}

// The input as text, encoded by the tokenizers of tests/reference/tokenizers (every kind).
void run_tokenizer_encode(FuzzInput input) {
  struct Kind {
    const char* file;
    bool lossless;  // byte-level without a normalizer: decode_bytes gives the text back
  };
  static const std::vector<Kind> kinds = {
      {"gpt2_kind.json", true},         {"llama3_kind.json", true},
      {"deepseek_kind.json", true},     {"qwen2_kind.json", false},
      {"llama2_kind.json", false},      {"llama2_metaspace_kind.json", false},
      {"mistral_v3_kind.json", false},  {"mistral_v3_added_kind.json", false},
  };  // every one spells every byte
  static std::vector<BpeTokenizer> tokenizers = [] {
    std::vector<BpeTokenizer> loaded;
    for (const Kind& kind : kinds) {
      loaded.push_back(BpeTokenizer::from_file(
          (source_dir() / "tests/reference/tokenizers" / kind.file).string()));
    }
    return loaded;
  }();
  for (size_t k = 0; k < kinds.size(); ++k) {
    try {
      check_encoding(tokenizers[k], as_text(input), true, kinds[k].lossless);
    } catch (const UserError&) {  // not UTF-8
    }
  }
}

// A conversation with every role, rendered by each template.
const std::vector<ChatMessage>& sample_conversation() {
  static const std::vector<ChatMessage> messages = {
      {ChatRole::kSystem, "Be brief."},
      {ChatRole::kUser, "Hi <|eot_id|>"},
      {ChatRole::kAssistant, " Hello.\n"},
      {ChatRole::kUser, "Bye"},
  };
  return messages;
}

void render_all(const ChatTemplate& chat_template, std::span<const ChatMessage> messages) {
  for (bool add_generation_prompt : {false, true}) {
    try {
      const std::vector<ChatSegment> segments =
          render_chat(chat_template, messages, "fuzz", add_generation_prompt);
      (void)chat_text(segments);
    } catch (const UserError&) {  // the mistral templates' alternation
    }
  }
}

// tokenizer_config.json (its chat_template recognised, bos/eos read), and the same bytes as a
// --chat-template FILE's Jinja text.
void run_chat_template(FuzzInput input) {
  const fs::path dir = scratch_path("chat/tokenizer_config.json").parent_path();
  write_bytes(dir / "tokenizer_config.json", as_text(input));
  try {
    render_all(load_chat_template(dir.string(), ""), sample_conversation());
  } catch (const UserError&) {
  }
  try {
    (void)recognize_chat_template(as_text(input), "template.jinja");
  } catch (const UserError&) {
  }
}

// Chat JSONL: every line parsed, each conversation rendered by every known template.
void run_chat_jsonl(FuzzInput input) {
  const std::string_view text = as_text(input);
  size_t line_number = 0;
  for (size_t begin = 0; begin <= text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    const std::string where = "train.jsonl:" + std::to_string(++line_number);
    try {
      const auto messages = parse_chat_line(text.substr(begin, end - begin), where);
      if (messages) {
        for (const std::string& name : chat_template_names()) {
          render_all(default_chat_template(chat_template_kind(name)), *messages);
        }
      }
    } catch (const UserError&) {
    }
    begin = end + 1;
  }
}

// ---------------------------------------------------------------------------------------------
// Token data: llm.c shards and dstrain's loss masks

void read_all_tokens(const TokenSource& source) {
  std::vector<int32_t> tokens(source.size());
  if (!tokens.empty()) source.read(0, tokens.size(), tokens.data());
}

void run_token_file(FuzzInput input) {
  for (const char* name : {"tokens/shard.bin", "tokens/shard.u16", "tokens/shard.u32"}) {
    try {
      read_all_tokens(*TokenSource::open_file(input_file(name, input), 50304));
    } catch (const UserError&) {
    }
  }
}

// A mask for as many tokens as its size says (so the header's count is what is tested), then
// its flags as chat data: the conversation index, packed rows and token batches.
void run_loss_mask(FuzzInput input) {
  const std::string path = input_file("mask/shard.mask", input);
  const size_t count = input.size() > kLlmcHeaderBytes ? input.size() - kLlmcHeaderBytes : 0;
  try {
    const MappedMask mask = open_mask_file(path, count);
    if (mask.count == 0) return;
    std::vector<uint8_t> flags(mask.bytes, mask.bytes + mask.count);
    const TokenDataset dataset =
        TokenDataset::from_tokens(std::vector<int32_t>(mask.count, 1), 8, "shard", flags);
    for (int64_t seq_len : {1, 4, 64}) {
      const ConversationIndex index = index_conversations(dataset, seq_len);
      (void)describe_conversations(index, seq_len);
      (void)pack_conversations(index, seq_len);
      (void)batch_conversations(index, seq_len, 2 * seq_len, 1);
    }
  } catch (const UserError&) {
  }
}

// ---------------------------------------------------------------------------------------------
// Topology

// The topology of the nvidia-smi fixture `file`.
NodeTopology fixture_topology(const char* file) {
  return parse_nvidia_smi_topo(read_file(source_dir() / "tests/topology/fixtures" / file));
}

// `nvidia-smi topo -m` (and -mp), and the same text as `topo -p2p` for 2, 4 and 8 GPUs.
void run_nvidia_smi(FuzzInput input) {
  static const std::vector<NodeTopology> topologies = {
      fixture_topology("rtx4090-2gpu-ansi.txt"), fixture_topology("a100-4gpu-mp.txt"),
      fixture_topology("h100-8gpu-nvswitch.txt")};
  const std::string text(as_text(input));
  try {
    (void)to_json(parse_nvidia_smi_topo(text)).dump();
  } catch (const UserError&) {
  }
  for (NodeTopology topology : topologies) {
    try {
      apply_nvidia_smi_p2p(topology, text);
    } catch (const UserError&) {
    }
  }
}

void run_topology_json(FuzzInput input) {
  try {
    (void)to_json(load_topology_file(input_file("topology.json", input))).dump();
  } catch (const UserError&) {
  }
}

// ---------------------------------------------------------------------------------------------
// Configs and checkpoints

// --deepspeed-config: mapped, its flags stored as --config's are, its train_batch_size applied.
void run_deepspeed_config(FuzzInput input) {
  try {
    const DeepSpeedMapping mapping = map_deepspeed_config(input_file("ds_config.json", input));
    TrainOptions options;
    const boost::program_options::options_description flags = train_flags(options);
    boost::program_options::variables_map values;
    store_flag_json(mapping.flags, "ds_config.json", flags, values);
    apply_train_batch_size(mapping, {}, options);
  } catch (const UserError&) {
  }
}

// --config FILE (OUT/run_config.json, or Boost's `key = value` syntax).
void run_run_config(FuzzInput input) {
  try {
    TrainOptions options;
    const boost::program_options::options_description flags = train_flags(options);
    boost::program_options::variables_map values;
    store_config_file(input_file("run_config.json", input), flags, values);
  } catch (const UserError&) {
  }
}

// trainer.json of a checkpoint (beside llama_tiny's config.json), then its data position and
// loss scale restored as --resume does.
void run_trainer_state(FuzzInput input) {
  static const fs::path dir = [] {
    const fs::path checkpoint = scratch_path("checkpoint/x").parent_path();
    fs::copy_file(source_dir() / "tests/reference/llama_tiny/config.json",
                  checkpoint / "config.json", fs::copy_options::overwrite_existing);
    write_bytes(checkpoint / "model.safetensors", "");
    write_bytes(checkpoint / "optimizer.safetensors", "");
    return checkpoint;
  }();
  write_bytes(dir / "trainer.json", as_text(input));
  try {
    const CheckpointInfo info = open_checkpoint(dir.string());
    const nlohmann::json& trainer = info.trainer_state;
    if (trainer.contains("data")) {
      std::vector<int32_t> tokens(100);
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i);
      LoaderOptions options;
      options.batch = 2;
      options.seq_len = 3;
      options.shuffle = true;
      options.seed = 7;
      DataLoader loader(TokenDataset::from_tokens(std::move(tokens), 100), options);
      loader.restore(trainer["data"]);
      std::vector<int32_t> inputs(6), targets(6);
      loader.next_batch(inputs.data(), targets.data());
    }
    if (trainer.contains("scaler")) {
      GradScaler scaler(true);
      scaler.restore(trainer["scaler"]);
      (void)scaler.update(true);
    }
  } catch (const UserError&) {
  }
}

// ---------------------------------------------------------------------------------------------
// The TCP store's frames

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

sockaddr_in loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// Sends what the peer takes within the deadline (a peer that stops reading or hangs up ends
// it early).
void send_bytes(int fd, std::string_view bytes, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n =
        ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    pollfd p{fd, POLLOUT, 0};
    ::poll(&p, 1, static_cast<int>(left.count()));
  }
}

// Reads and drops what the peer sends until it hangs up or the deadline passes.
void drain(int fd, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  char buffer[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return;
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return;
  }
}

// The input as the bytes a client sends to a fresh server: its frames are read and answered
// until the input ends; then the server stops (waking a get or wait the input left blocked).
// A malformed frame ends that connection with an Error the server keeps.
void run_tcp_store_server(FuzzInput input) {
  TcpStoreServer server(0, 1.0);
  {
    const sockaddr_in address = loopback(server.port());
    std::unique_ptr<Socket> client;
    for (int attempt = 0; !client; ++attempt) {  // a loaded machine may refuse one now and then
      auto socket = std::make_unique<Socket>(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (::connect(socket->get(), reinterpret_cast<const sockaddr*>(&address),
                    sizeof address) == 0) {
        client = std::move(socket);
      } else if (attempt == 100) {
        throw std::runtime_error(std::string("fuzz harness: cannot connect to the store: ") +
                                 std::strerror(errno));
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    send_bytes(client->get(), as_text(input), std::chrono::milliseconds(200));
    ::shutdown(client->get(), SHUT_WR);
    drain(client->get(), std::chrono::milliseconds(200));
  }
  server.stop(0);
  (void)server.connection_errors();
}

// The input as the bytes a server sends back: a client makes each kind of call and reads the
// input as their replies, the server hanging up at its end. Error is the documented refusal.
void run_tcp_store_client(FuzzInput input) {
  static const int listener = [] {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    const sockaddr_in address = loopback(0);
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(fd, 16) != 0)
      throw std::runtime_error("fuzz harness: cannot listen on the loopback");
    return fd;
  }();
  sockaddr_in bound{};
  socklen_t length = sizeof bound;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&bound), &length);
  const std::string replies(as_text(input));
  std::thread fake_server([&replies] {
    const Socket peer(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    if (peer.get() < 0) return;
    send_bytes(peer.get(), replies, std::chrono::milliseconds(500));
    ::shutdown(peer.get(), SHUT_WR);
    drain(peer.get(), std::chrono::milliseconds(5000));
  });
  {
    TcpStoreClient client("127.0.0.1", ntohs(bound.sin_port), 0.5);
    const auto attempt = [](auto&& call) {
      try {
        call();
      } catch (const Error&) {
      }
    };
    attempt([&] { client.set("key", "value"); });
    attempt([&] { (void)client.get("key"); });
    attempt([&] { (void)client.add("counter", 3); });
    attempt([&] { (void)client.check({"key", "other"}); });
    attempt([&] { client.wait({"key"}); });
    attempt([&] { (void)client.wait_for({"key", "other"}, 0.05); });
  }
  fake_server.join();
}

}  // namespace

const std::vector<FuzzEntry>& fuzz_entries() {
  static const std::vector<FuzzEntry> entries = {
      {"safetensors", run_safetensors},
      {"safetensors_index", run_safetensors_index},
      {"model_config", run_model_config},
      {"tokenizer", run_tokenizer},
      {"tokenizer_encode", run_tokenizer_encode},
      {"chat_template", run_chat_template},
      {"chat_jsonl", run_chat_jsonl},
      {"token_file", run_token_file},
      {"loss_mask", run_loss_mask},
      {"nvidia_smi", run_nvidia_smi},
      {"topology_json", run_topology_json},
      {"deepspeed_config", run_deepspeed_config},
      {"run_config", run_run_config},
      {"trainer_state", run_trainer_state},
      {"tcp_store_server", run_tcp_store_server},
      {"tcp_store_client", run_tcp_store_client},
  };
  return entries;
}

const FuzzEntry& fuzz_entry(const std::string& name) {
  for (const FuzzEntry& entry : fuzz_entries()) {
    if (entry.name == name) return entry;
  }
  throw std::invalid_argument("no fuzz entry named " + name);
}

}  // namespace dstrain::fuzz
