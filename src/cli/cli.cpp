#include "cli/cli.h"

#include <chrono>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "cli/commands.h"
#include "cli/config_file.h"
#include "cli/deepspeed_config.h"
#include "cli/parse_flags.h"
#include "cli/train_flags.h"
#include "core/check.h"
#include "data/prepare.h"
#include "data/prepare_chat.h"
#include "model/config.h"
#include "parallel/plan.h"
#include "topology/cluster.h"
#include "train/cluster.h"
#include "train/trainer.h"

namespace dstrain {

namespace po = boost::program_options;

namespace {

// Parses argv into `flags`, names exactly; Boost's errors become one sentence.
po::variables_map parse(const std::vector<std::string>& args, const po::options_description& flags) {
  return parse_exact_flags(args, flags, {}, "dstrain --help");
}

// The rendezvous flags given (checked, with the environment, by rendezvous_options).
RendezvousFlags rendezvous_flags(const po::variables_map& values) {
  RendezvousFlags flags;
  const auto take = [&values](const char* name, std::optional<std::string>& into) {
    if (values.count(name)) into = values[name].as<std::string>();
  };
  take("master-addr", flags.master_addr);
  take("master-port", flags.master_port);
  take("nnodes", flags.nnodes);
  take("node-rank", flags.node_rank);
  take("rendezvous-timeout", flags.timeout_seconds);
  return flags;
}

int run_train(const std::vector<std::string>& args, std::ostream& out) {
  TrainOptions options;
  options.model.clear();  // empty: tiny, or the checkpoint's model on --resume
  po::options_description flags = train_flags(options);
  flags.add_options()("help,h", "this help");
  po::variables_map values = parse(args, flags);
  if (values.count("help")) {
    print_usage(out, flags);
    return 0;
  }
  if (values.count("config")) store_config_file(values["config"].as<std::string>(), flags, values);
  std::optional<DeepSpeedMapping> deepspeed;
  if (values.count("deepspeed-config")) {
    const std::string path = values["deepspeed-config"].as<std::string>();
    deepspeed = map_deepspeed_config(path);
    out << "deepspeed config " << path << ":\n";
    for (const std::string& line : deepspeed->lines) out << "  " << line << "\n";
    store_flag_json(deepspeed->flags, "deepspeed config " + path, flags, values);
  }
  options.explicit_flags.emplace();
  for (const auto& [name, value] : values) {
    if (!value.defaulted()) options.explicit_flags->insert(name);
  }
  DSTRAIN_USER_CHECK(!options.explicit_flags->count("steps") ||
                     !options.explicit_flags->count("epochs"))
      << "--steps and --epochs both say how long to train: give one";
  if (deepspeed) apply_train_batch_size(*deepspeed, *options.explicit_flags, options);
  if (values.count("offload")) {
    Plan offload;
    set_offload(offload, values["offload"].as<std::string>());
    options.offload = offload.offload;
    options.offload_params = offload.offload_params;
  }
  options.rendezvous = rendezvous_options(rendezvous_flags(values), process_environment());
  for (const char* launcher : {"local_rank", "local-rank"}) {
    if (values.count(launcher)) {
      out << "dstrain: --" << launcher << " " << values[launcher].as<int>()
          << " (from a launcher) is ignored: dstrain runs one process per node and starts its "
             "own ranks\n";
    }
  }
  if (values.count("micro-batch")) {
    DSTRAIN_USER_CHECK(!options.explicit_flags->count("batch"))
        << "--batch and --micro-batch are the same setting: give one";
    options.batch = values["micro-batch"].as<int64_t>();
    options.explicit_flags->insert("batch");
  }
  const TrainSummary summary = train(options, out);
  // Interrupted: the conventional exit code of the signal (the checkpoint, if any, is whole).
  return summary.interrupted_by != 0 ? 128 + summary.interrupted_by : 0;
}

// prepare --chat: conversations -> shards with loss masks, and what to train them with.
int run_prepare_chat(const ChatPrepareOptions& options, std::ostream& out) {
  const auto start = std::chrono::steady_clock::now();
  const ChatPrepareResult result = prepare_chat(options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t conversations = result.train_conversations + result.val_conversations;
  const size_t tokens = result.train_tokens + result.val_tokens;
  out << "rendered " << conversations << " conversations with the " << result.template_name
      << " chat template: " << result.train_conversations << " for training ("
      << result.train_tokens << " tokens), " << result.val_conversations << " for validation ("
      << result.val_tokens << " tokens); " << result.trained_tokens << " of the " << tokens
      << " tokens are trained (" << (options.train_on_prompt ? "--train-on-prompt" : "the assistant's replies")
      << ")\n";
  if (result.left_out > 0) {
    out << "left out " << result.left_out << " conversation(s) with nothing to train (no "
        << "assistant reply), the first at " << result.first_left_out << "\n";
  }
  out.precision(3);
  out << "in " << seconds << " s: " << static_cast<double>(conversations) / std::max(seconds, 1e-9)
      << " conversations/s, " << static_cast<double>(tokens) / std::max(seconds, 1e-9)
      << " tokens/s\n"
      << "look at one: dstrain prepare --show 0 --out " << options.out_dir << "\n"
      << "train with: dstrain --data '" << options.out_dir << "/train_*.bin'";
  if (!result.val_files.empty()) out << " --val-data '" << options.out_dir << "/val_*.bin'";
  out << "\n";
  return 0;
}

int run_prepare(const std::vector<std::string>& args, std::ostream& out) {
  PrepareOptions options;
  ChatPrepareOptions chat;
  int64_t show = -1;
  std::string template_help = "with --chat: this known template (";
  for (const std::string& name : chat_template_names()) {
    template_help += (name == chat_template_names().front() ? "" : ", ") + name;
  }
  template_help += ") or a file of Jinja text instead of tokenizer_config.json's";
  po::options_description flags("dstrain prepare");
  flags.add_options()
      ("input", po::value(&options.inputs)->composing()->value_name("FILE.txt"), "text file to tokenize (repeat for several, tokenized in order)")
      ("out", po::value(&options.out_dir)->value_name("DIR"), "where train_*.bin and val_*.bin go")
      ("val-fraction", po::value(&options.val_fraction)->default_value(0.1, "0.1"), "share of the tokens held out for validation (0: train shards only)")
      ("tokenizer", po::value(&options.tokenizer_path)->value_name("tokenizer.json"),
       "a Hugging Face BPE tokenizer (GPT-2, Llama 3, Qwen2, DeepSeek byte-level kinds; Llama 2, Mistral SentencePiece kind; UTF-8 input); "
       "ids as tokenizers' encode(text, add_special_tokens=False): no post-processor tokens such as "
       "<|begin_of_text|>. Default: bytes (vocabulary 256)")
      ("eot", po::bool_switch(&options.append_eot), "append the tokenizer's end-of-text token after each input file (<|endoftext|>, <|end_of_text|>, DeepSeek's end of sentence, </s>)")
      ("eot-token", po::value(&options.eot_token)->value_name("TOKEN"), "the token --eot appends instead (implies --eot)")
      ("chat", po::value(&chat.inputs)->composing()->value_name("FILE.jsonl"),
       "conversations to fine-tune on, one JSON object a line: OpenAI {\"messages\": [{\"role\", \"content\"}]} "
       "or ShareGPT {\"conversations\": [{\"from\", \"value\"}]} (repeat for several). Rendered with the "
       "model's chat template; needs --tokenizer DIR with tokenizer.json and tokenizer_config.json; writes a "
       "loss mask beside each shard (train_NNNNNN.mask)")
      ("chat-template", po::value(&chat.chat_template)->value_name("NAME|FILE"),
       template_help.c_str())
      ("train-on-prompt", po::bool_switch(&chat.train_on_prompt),
       "with --chat: train every token, not only the assistant's replies (axolotl's train_on_inputs)")
      ("show", po::value(&show)->value_name("N"),
       "print training conversation N (from 0) of the chat shards in --out as text, its trained spans "
       "between [TRAINED] and [/TRAINED]")
      ("help,h", "this help");
  const po::variables_map values = parse(args, flags);
  if (values.count("help")) {
    out << "Usage: dstrain prepare --input FILE.txt [--input ...] --out DIR [--tokenizer tokenizer.json [--eot]]\n"
        << "       dstrain prepare --chat FILE.jsonl --tokenizer DIR --out DIR [--chat-template NAME|FILE] [--train-on-prompt]\n"
        << "       dstrain prepare --show N --out DIR\n"
        << flags << "\n";
    return 0;
  }
  if (values.count("show")) {
    DSTRAIN_USER_CHECK(!options.out_dir.empty()) << "--show needs --out DIR (the prepared shards)";
    out << show_conversation(options.out_dir, show, options.tokenizer_path);
    return 0;
  }
  const bool with_chat = !chat.inputs.empty();
  DSTRAIN_USER_CHECK(with_chat || (chat.chat_template.empty() && !chat.train_on_prompt))
      << "--chat-template and --train-on-prompt go with --chat FILE.jsonl";
  if (with_chat) {
    DSTRAIN_USER_CHECK(options.inputs.empty() && !options.append_eot && options.eot_token.empty())
        << "--chat takes conversations; --input, --eot and --eot-token are for text (prepare "
        << "them separately)";
    DSTRAIN_USER_CHECK(!options.out_dir.empty()) << "dstrain prepare needs --out DIR";
    chat.out_dir = options.out_dir;
    chat.tokenizer = options.tokenizer_path;
    chat.val_fraction = options.val_fraction;
    return run_prepare_chat(chat, out);
  }
  DSTRAIN_USER_CHECK(!options.inputs.empty()) << "dstrain prepare needs --input FILE.txt";
  DSTRAIN_USER_CHECK(!options.out_dir.empty()) << "dstrain prepare needs --out DIR";
  if (!options.eot_token.empty()) options.append_eot = true;
  const PrepareResult result = prepare(options);
  const std::string& out_dir = options.out_dir;
  out << "wrote " << result.train_tokens << " training tokens (" << result.train_files.size()
      << " shard" << (result.train_files.size() == 1 ? "" : "s") << ") and "
      << result.val_tokens << " validation tokens to " << out_dir << " ("
      << (result.uint32_tokens ? "uint32" : "uint16") << " tokens, vocabulary "
      << result.vocab_size << ")\n"
      << "train with: dstrain --data '" << out_dir << "/train_*.bin'";
  if (!result.val_files.empty()) out << " --val-data '" << out_dir << "/val_*.bin'";
  out << "\n";
  return 0;
}

}  // namespace

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (!args.empty() && (args[0] == "--version" || args[0] == "version")) {
      out << "dstrain " << kDstrainVersion << "\n";
      return 0;
    }
    if (!args.empty() && (args[0] == "--help" || args[0] == "-h" || args[0] == "help")) {
      TrainOptions defaults;
      print_usage(out, train_flags(defaults));
      return 0;
    }
    std::string command = "train";
    if (!args.empty() && !args[0].starts_with("-")) {
      command = args[0];
      args.erase(args.begin());
    }
    if (command == "train") return run_train(args, out);
    if (command == "prepare") return run_prepare(args, out);
    if (command == "topo") return run_topo_command(args, out);
    if (command == "plan") return run_plan_command(args, out);
    if (command == "bench") return run_bench_command(args, out);
    if (command == "report") return run_report_command(args, out);
    if (command == "verify") return run_verify_command(args, out);
    DSTRAIN_USER_ERROR() << "unknown command '" << command
                         << "' (commands: train, prepare, topo, plan, bench, report, verify; see "
                            "dstrain --help)";
  } catch (const UserError& error) {
    out.flush();
    err << "dstrain: error: " << error.what() << "\n";
    return 2;
  } catch (const RunFailure& error) {
    out.flush();
    err << "dstrain: error: " << error.what() << "\n";
    return 1;
  } catch (const std::exception& error) {
    out.flush();
    err << "dstrain: internal error: " << error.what() << "\n";
    return 1;
  }
  return 1;
}

}  // namespace dstrain
