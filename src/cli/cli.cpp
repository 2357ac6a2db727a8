#include "cli/cli.h"

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

int run_prepare(const std::vector<std::string>& args, std::ostream& out) {
  PrepareOptions options;
  po::options_description flags("dstrain prepare");
  flags.add_options()
      ("input", po::value(&options.inputs)->composing()->value_name("FILE.txt"), "text file to tokenize (repeat for several, tokenized in order)")
      ("out", po::value(&options.out_dir)->value_name("DIR"), "where train_*.bin and val_*.bin go")
      ("val-fraction", po::value(&options.val_fraction)->default_value(0.1, "0.1"), "share of the tokens held out for validation (0: train shards only)")
      ("tokenizer", po::value(&options.tokenizer_path)->value_name("tokenizer.json"),
       "a Hugging Face byte-level BPE tokenizer (GPT-2, Llama 3, Qwen2, DeepSeek kinds; UTF-8 input); "
       "ids as tokenizers' encode(text, add_special_tokens=False): no post-processor tokens such as "
       "<|begin_of_text|>. Default: bytes (vocabulary 256)")
      ("eot", po::bool_switch(&options.append_eot), "append the tokenizer's end-of-text token after each input file (<|endoftext|>, <|end_of_text|>, DeepSeek's end of sentence)")
      ("eot-token", po::value(&options.eot_token)->value_name("TOKEN"), "the token --eot appends instead (implies --eot)")
      ("help,h", "this help");
  const po::variables_map values = parse(args, flags);
  if (values.count("help")) {
    out << "Usage: dstrain prepare --input FILE.txt [--input ...] --out DIR [--tokenizer tokenizer.json [--eot]]\n"
        << flags << "\n";
    return 0;
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
    DSTRAIN_USER_ERROR() << "unknown command '" << command
                         << "' (commands: train, prepare, topo, plan, bench, report; see dstrain --help)";
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
