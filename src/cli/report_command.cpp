// `dstrain report`: training logs in, one HTML page out.
#include <filesystem>

#include "cli/commands.h"
#include "cli/report.h"
#include "core/check.h"
#include "core/fs.h"

namespace dstrain {

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace {

// RUN.jsonl -> RUN.html, beside the log.
std::string default_out(const std::string& log) {
  fs::path path(log);
  path.replace_extension(".html");
  return path.string();
}

// The page must not overwrite one of the logs it is made from.
void check_out_is_no_input(const std::string& out, const std::vector<std::string>& logs) {
  for (const std::string& log : logs) {
    std::error_code error;
    DSTRAIN_USER_CHECK(!fs::equivalent(out, log, error))
        << "--out " << out << " is one of the logs: give another file for the report";
  }
}

}  // namespace

int run_report_command(const std::vector<std::string>& args, std::ostream& out) {
  std::vector<std::string> logs;
  std::string out_path, title;
  po::options_description flags("dstrain report");
  // clang-format off
  flags.add_options()
      ("log", po::value(&logs)->composing()->value_name("RUN.jsonl"),
       "a log of `dstrain --log FILE` (the bare arguments; several are overlaid)")
      ("out", po::value(&out_path)->value_name("FILE.html"),
       "where the page goes (default: the first log with .html for .jsonl)")
      ("title", po::value(&title)->value_name("TEXT"), "the page's title (default: the logs' names)")
      ("help,h", "this help");
  // clang-format on
  po::positional_options_description positional;
  positional.add("log", -1);
  const po::variables_map values = parse_command_flags(args, flags, positional);
  if (values.count("help")) {
    out << "Usage: dstrain report RUN.jsonl [MORE.jsonl ...] [--out FILE.html] [--title TEXT]\n"
        << "Plots training logs on one self-contained HTML page (inline SVG, no script): loss "
           "and eval loss against the entropy floor, tokens/s, learning rate, gradient norm, "
           "loss scale (fp16), MFU and the step's time split when logged, and the peak memory "
           "per category per rank. Several logs are overlaid, one colour each.\n\n"
        << flags << "\n";
    return 0;
  }
  DSTRAIN_USER_CHECK(!logs.empty())
      << "dstrain report needs a log: dstrain report RUN.jsonl [MORE.jsonl ...] --out report.html";
  if (out_path.empty()) out_path = default_out(logs.front());
  check_out_is_no_input(out_path, logs);
  std::vector<RunLog> runs;
  for (const std::string& log : logs) runs.push_back(parse_run_log(log));
  make_labels_unique(runs);
  const std::string html = render_report(runs, title.empty() ? default_report_title(runs) : title);
  write_file_atomic(out_path, html);
  for (const RunLog& run : runs) {
    for (const std::string& warning : run.warnings) out << "warning: " << warning << "\n";
  }
  out << "wrote " << out_path << " (" << runs.size() << (runs.size() == 1 ? " run, " : " runs, ")
      << (html.size() + 1023) / 1024 << " KB)\n";
  return 0;
}

}  // namespace dstrain
