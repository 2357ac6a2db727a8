// `dstrain topo`, and the flag helpers `topo` and `plan` share.
#include <iostream>

#include "cli/commands.h"
#include "cli/parse_flags.h"
#include "core/check.h"
#include "topology/format.h"
#include "topology/gpu_table.h"
#include "topology/topology_json.h"

namespace dstrain {

namespace po = boost::program_options;

po::variables_map parse_command_flags(const std::vector<std::string>& args,
                                      const po::options_description& flags,
                                      const po::positional_options_description& positional) {
  return parse_exact_flags(args, flags, positional, "--help");
}

po::options_description machine_flags(MachineSource& source) {
  po::options_description flags("Machine (default: this one)");
  flags.add_options()
      ("topology", po::value(&source.topology_file)->value_name("FILE"),
       "a saved topology: the JSON of `dstrain topo --json`, or the text of `nvidia-smi topo -m`")
      ("from-nvidia-smi", po::value(&source.nvidia_smi_file)->value_name("FILE|-"),
       "the text of `nvidia-smi topo -m` (- reads standard input)")
      ("gpu", po::value(&source.gpu)->value_name("NAME"),
       ("the GPU model, for what the source does not say (memory, compute, peer access): " +
        known_gpu_names()).c_str())
      ("host-memory", po::value(&source.host_memory)->value_name("SIZE"),
       "host RAM, e.g. 256G (for optimizer offload)")
      ("gpu-memory", po::value(&source.gpu_memory)->value_name("SIZE"),
       "every GPU's memory, as if it had only SIZE, e.g. 24G (default: what it has)");
  return flags;
}

int run_topo_command(const std::vector<std::string>& args, std::ostream& out) {
  MachineSource source;
  po::options_description flags = machine_flags(source);
  flags.add_options()
      ("json", "print the topology as JSON")
      ("help,h", "this help");
  const po::variables_map values = parse_command_flags(args, flags);
  if (values.count("help")) {
    out << "Usage: dstrain topo [--json] [--topology FILE | --from-nvidia-smi FILE|-] "
           "[--gpu NAME] [--host-memory SIZE]\n"
        << "Shows the GPUs of this machine (or of the one a file describes) and how every pair "
           "is linked.\n\n"
        << flags << "\n";
    return 0;
  }
  std::string report;
  const NodeTopology topology = load_machine(source, std::cin, &report);
  if (values.count("json")) {
    out << to_json(topology).dump(2) << "\n";
    return 0;
  }
  if (!source.names_a_machine() && topology.gpu_count() == 0) {
    out << "No NVIDIA GPU found on this machine: " << report << ".\n"
        << "To look at another machine: dstrain topo --from-nvidia-smi FILE --gpu NAME "
           "(the output of `nvidia-smi topo -m` there), or --topology FILE.\n";
    return 0;
  }
  out << format_topology_table(topology);
  return 0;
}

}  // namespace dstrain
