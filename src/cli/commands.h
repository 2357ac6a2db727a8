// The `topo`, `plan`, `bench` and `report` commands, and the flag groups they share with other
// commands (training takes the same machine and plan flags when it plans).
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "parallel/machine.h"
#include "parallel/planner.h"

namespace dstrain {

// `dstrain topo [--json] [--topology FILE | --from-nvidia-smi FILE|-] [--gpu NAME]
// [--host-memory SIZE]`: the machine's GPUs and links as a table (or JSON). Returns the exit
// code; throws UserError (run_cli reports it).
int run_topo_command(const std::vector<std::string>& args, std::ostream& out);

// `dstrain plan --model M [--gpus N] [machine flags] [--global-batch-tokens K] [--seq-len T]
// [--plan-json] [plan flags]`: the chosen plan, its memory and time, and the alternatives.
int run_plan_command(const std::vector<std::string>& args, std::ostream& out);

// `dstrain bench comm [--gpus N] [--sizes MIN:MAX] [--ops LIST] [--dtype fp32|fp16|bf16]
// [--iters N] [--warmup N] [--device auto|cpu|cuda] [--json]`: the collectives of the
// communicator training would use, timed as nccl-tests does (cli/comm_bench.h), next to the bus
// bandwidth the planner assumes. Another or no subcommand is a UserError naming comm.
int run_bench_command(const std::vector<std::string>& args, std::ostream& out);

// `dstrain report RUN.jsonl [MORE.jsonl ...] [--out FILE.html] [--title TEXT]`: one
// self-contained HTML page plotting the training logs (cli/report.h), written atomically.
int run_report_command(const std::vector<std::string>& args, std::ostream& out);

// `dstrain verify DIR`: a checkpoint (or a run directory's newest) read back against its
// checksums.json; throws UserError naming the damaged file.
int run_verify_command(const std::vector<std::string>& args, std::ostream& out);

// --topology, --from-nvidia-smi, --gpu, --host-memory.
boost::program_options::options_description machine_flags(MachineSource& source);
// --inter-node-bandwidth RATE (topology/cluster.h: kInterNodeBandwidthFlag), into
// `inter_node_bandwidth` as written; make_cluster_shape parses it (with --nnodes and the machine).
boost::program_options::options_description inter_node_flags(std::string& inter_node_bandwidth);
// --dp, --tp, --pp, --zero, --offload [WHAT], --recompute, --micro-batch: read them back
// from the parsed values with read_plan_flags. Throws UserError on a bad --offload or
// --recompute value.
boost::program_options::options_description plan_flags();
void read_plan_flags(const boost::program_options::variables_map& values, PlanRequest& request);

// Parses `args` against `flags` (and the bare words against `positional`); Boost's errors
// become one UserError sentence.
boost::program_options::variables_map parse_command_flags(
    const std::vector<std::string>& args, const boost::program_options::options_description& flags,
    const boost::program_options::positional_options_description& positional = {});

}  // namespace dstrain
