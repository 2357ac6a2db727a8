#include "topology/nvidia_smi.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <set>
#include <sstream>
#include <vector>

#include "core/check.h"

namespace dstrain {

namespace {

// Escape sequences "ESC [ params final" (SGR colours, underline) and the same without the
// ESC byte, which is what is left after a copy from some terminals: "[4m", "[0m".
std::string strip_ansi(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text[i] == '\x1b' && i + 1 < text.size() && text[i + 1] == '[') {
      size_t j = i + 2;
      while (j < text.size() && (std::isdigit(static_cast<unsigned char>(text[j])) ||
                                 text[j] == ';' || text[j] == '?')) {
        ++j;
      }
      if (j < text.size() && text[j] >= '@' && text[j] <= '~') {
        i = j + 1;
        continue;
      }
    } else if (text[i] == '[') {
      size_t j = i + 1;
      while (j < text.size() && (std::isdigit(static_cast<unsigned char>(text[j])) || text[j] == ';')) {
        ++j;
      }
      if (j < text.size() && text[j] == 'm') {  // a colour code that lost its ESC
        i = j + 1;
        continue;
      }
    }
    if (text[i] == '\x1b' || text[i] == '\r') {  // a lone ESC; Windows line ends
      ++i;
      continue;
    }
    out += text[i++];
  }
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Cells separated by tabs or runs of spaces; empty cells vanish (none of the values nvidia-smi
// prints contains a space).
std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

bool is_gpu_label(const std::string& word, int* index) {
  if (word.size() < 4 || word.compare(0, 3, "GPU") != 0) return false;
  int value = 0;
  for (size_t i = 3; i < word.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(word[i])) || i - 3 > 4) return false;
    value = value * 10 + (word[i] - '0');
  }
  if (index) *index = value;
  return true;
}

// Words that start the trailing (non-device) column names of the header.
bool starts_trailing_columns(const std::vector<std::string>& words, size_t k) {
  const std::string& w = words[k];
  if (w == "CPU" || w == "NUMA") return true;
  return w == "GPU" && k + 1 < words.size() && words[k + 1] == "NUMA";
}

// Splits "CPU Affinity NUMA Affinity GPU NUMA ID" into its column names.
std::vector<std::string> trailing_column_names(const std::vector<std::string>& words,
                                               size_t start) {
  static const std::vector<std::vector<std::string>> known = {
      {"CPU", "Affinity"}, {"NUMA", "Affinity"}, {"GPU", "NUMA", "ID"}};
  std::vector<std::string> names;
  for (size_t k = start; k < words.size();) {
    bool matched = false;
    for (const auto& name : known) {
      if (k + name.size() <= words.size() &&
          std::equal(name.begin(), name.end(), words.begin() + static_cast<long>(k))) {
        std::string joined;
        for (const auto& part : name) joined += (joined.empty() ? "" : " ") + part;
        names.push_back(joined);
        k += name.size();
        matched = true;
        break;
      }
    }
    if (!matched) names.push_back(words[k++]);  // an unknown column: one word, best effort
  }
  return names;
}

struct MatrixRow {
  std::string label;
  std::vector<std::string> cells;     // one per device column
  std::vector<std::string> trailing;  // non-empty trailing values, in order
};

struct Matrix {
  std::vector<std::string> columns;         // device columns: GPU0.., NIC0.., mlx5_0..
  std::vector<std::string> trailing_names;  // "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"
  std::vector<MatrixRow> gpu_rows;          // in GPU index order, one per GPU column
  std::string legend;                       // the lines after the matrix
};

const char* const kNoMatrix =
    "no GPU rows found in the nvidia-smi topo output; pass the text `nvidia-smi topo -m` "
    "prints (a header line GPU0 GPU1 ... and one row per GPU)";

Matrix parse_matrix(const std::string& raw_text, const char* what) {
  const std::vector<std::string> lines = split_lines(strip_ansi(raw_text));
  Matrix m;
  size_t line_no = 0;
  // The header: the first line with a word GPU0 that is not a row (a row's GPU0 is followed by
  // its self cell X). Anything before GPU0 on that line (a shell prompt) is ignored.
  for (; line_no < lines.size(); ++line_no) {
    const std::vector<std::string> words = split_words(lines[line_no]);
    auto first = std::find(words.begin(), words.end(), "GPU0");
    if (first == words.end()) continue;
    if (first + 1 != words.end() && first[1] == "X") continue;
    size_t k = static_cast<size_t>(first - words.begin());
    for (; k < words.size() && !starts_trailing_columns(words, k); ++k) {
      m.columns.push_back(words[k]);
    }
    m.trailing_names = trailing_column_names(words, k);
    ++line_no;
    break;
  }
  DSTRAIN_USER_CHECK(!m.columns.empty()) << kNoMatrix;

  std::vector<int> gpu_column_index;  // GPU index -> column
  for (size_t c = 0; c < m.columns.size(); ++c) {
    int gpu = -1;
    if (!is_gpu_label(m.columns[c], &gpu)) continue;
    DSTRAIN_USER_CHECK(gpu == static_cast<int>(gpu_column_index.size()))
        << "the " << what << " header has column " << m.columns[c] << " where GPU"
        << gpu_column_index.size() << " was expected; GPU columns must be GPU0, GPU1, ... in order";
    gpu_column_index.push_back(static_cast<int>(c));
  }
  const size_t n_columns = m.columns.size();
  const size_t n_gpus = gpu_column_index.size();
  std::vector<std::optional<MatrixRow>> rows(n_gpus);

  bool in_rows = false;
  std::ostringstream legend;
  for (; line_no < lines.size(); ++line_no) {
    const std::vector<std::string> words = split_words(lines[line_no]);
    if (words.empty()) continue;
    const bool is_row = std::find(m.columns.begin(), m.columns.end(), words[0]) != m.columns.end();
    DSTRAIN_USER_CHECK(is_row || !is_gpu_label(words[0], nullptr))
        << "row " << words[0] << " has no column in the " << what << " header, which names "
        << n_gpus << " GPUs";
    if (!is_row) {
      if (in_rows) break;  // the legend (or anything else) after the matrix
      continue;            // a stray line between the header and the rows
    }
    in_rows = true;
    int gpu = -1;
    if (!is_gpu_label(words[0], &gpu)) continue;  // a NIC row: NICs are not GPUs
    DSTRAIN_USER_CHECK(words.size() - 1 >= n_columns)
        << "row " << words[0] << " has " << words.size() - 1 << " cells, expected "
        << n_columns << " (one per column " << m.columns.front() << ".." << m.columns.back()
        << ")";
    DSTRAIN_USER_CHECK(!rows[static_cast<size_t>(gpu)].has_value())
        << "row " << words[0] << " appears twice in the " << what << " output";
    MatrixRow row;
    row.label = words[0];
    row.cells.assign(words.begin() + 1, words.begin() + 1 + static_cast<long>(n_columns));
    row.trailing.assign(words.begin() + 1 + static_cast<long>(n_columns), words.end());
    rows[static_cast<size_t>(gpu)] = std::move(row);
  }
  for (; line_no < lines.size(); ++line_no) legend << lines[line_no] << "\n";
  m.legend = legend.str();

  DSTRAIN_USER_CHECK(in_rows) << kNoMatrix;
  for (size_t g = 0; g < n_gpus; ++g) {
    DSTRAIN_USER_CHECK(rows[g].has_value())
        << "the " << what << " header names " << n_gpus << " GPUs but row GPU" << g
        << " is missing";
    // Keep only the GPU columns of each row, in GPU order.
    MatrixRow row = std::move(*rows[g]);
    std::vector<std::string> gpu_cells;
    for (int column : gpu_column_index) gpu_cells.push_back(row.cells[static_cast<size_t>(column)]);
    row.cells = std::move(gpu_cells);
    m.gpu_rows.push_back(std::move(row));
  }
  return m;
}

struct Cell {
  LinkKind kind = LinkKind::PCIe;
  int nvlinks = 0;
  PciePath path = PciePath::SYS;
  bool operator==(const Cell& other) const {
    return kind == other.kind && nvlinks == other.nvlinks &&
           (kind == LinkKind::NVLink || path == other.path);
  }
};

// NV# with # a positive count, or a PCIe path.
std::optional<Cell> parse_link_cell(const std::string& text) {
  Cell cell;
  if (text.size() > 2 && text.compare(0, 2, "NV") == 0) {
    int count = 0;
    for (size_t i = 2; i < text.size(); ++i) {
      if (!std::isdigit(static_cast<unsigned char>(text[i])) || i > 5) return std::nullopt;
      count = count * 10 + (text[i] - '0');
    }
    if (count <= 0) return std::nullopt;
    cell.kind = LinkKind::NVLink;
    cell.nvlinks = count;
    return cell;
  }
  const std::optional<PciePath> path = parse_pcie_path(text);
  if (!path) return std::nullopt;
  cell.path = *path;
  return cell;
}

std::optional<int> parse_small_int(const std::string& text) {
  if (text.empty() || text.size() > 6) return std::nullopt;
  int value = 0;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
    value = value * 10 + (c - '0');
  }
  return value;
}

void check_self_cell(const MatrixRow& row, size_t i) {
  DSTRAIN_USER_CHECK(row.cells[i] == "X")
      << "row " << row.label << " has '" << row.cells[i] << "' in its own column GPU" << i
      << " where nvidia-smi prints X";
}

// The network devices of the matrix: its columns that are not GPUs, NIC# named by the legend
// ("NIC Legend:" lines "  NIC0: mlx5_0"), older drivers' columns (mlx5_0) as they are.
std::vector<std::string> nic_names(const Matrix& m) {
  std::vector<std::string> legend_names;  // by "NIC" index
  for (const std::string& line : split_lines(m.legend)) {
    const std::vector<std::string> words = split_words(line);
    if (words.size() != 2 || words[0].size() < 5 || words[0].back() != ':' ||
        words[0].compare(0, 3, "NIC") != 0) {
      continue;
    }
    const std::optional<int> index = parse_small_int(words[0].substr(3, words[0].size() - 4));
    if (!index) continue;
    const size_t position = static_cast<size_t>(*index);
    if (legend_names.size() <= position) legend_names.resize(position + 1);
    legend_names[position] = words[1];
  }
  std::vector<std::string> nics;
  for (const std::string& column : m.columns) {
    if (is_gpu_label(column, nullptr)) continue;
    std::optional<int> index;
    if (column.size() > 3 && column.compare(0, 3, "NIC") == 0) {
      index = parse_small_int(column.substr(3));
    }
    const bool named = index && static_cast<size_t>(*index) < legend_names.size() &&
                       !legend_names[static_cast<size_t>(*index)].empty();
    nics.push_back(named ? legend_names[static_cast<size_t>(*index)] : column);
  }
  return nics;
}

}  // namespace

NodeTopology parse_nvidia_smi_topo(const std::string& text) {
  const Matrix m = parse_matrix(text, "nvidia-smi topo");
  const int n = static_cast<int>(m.gpu_rows.size());
  NodeTopology topology = make_topology(n);

  bool any_nvlink = false;
  bool any_soc = false;
  std::vector<std::vector<Cell>> cells(static_cast<size_t>(n), std::vector<Cell>(static_cast<size_t>(n)));
  for (int i = 0; i < n; ++i) {
    const MatrixRow& row = m.gpu_rows[static_cast<size_t>(i)];
    check_self_cell(row, static_cast<size_t>(i));
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      const std::string& word = row.cells[static_cast<size_t>(j)];
      const std::optional<Cell> cell = parse_link_cell(word);
      DSTRAIN_USER_CHECK(cell.has_value())
          << "cell '" << word << "' in row " << row.label << ", column GPU" << j
          << " is not a link type nvidia-smi prints (NV#, PIX, PXB, PHB, NODE, SYS, SOC)";
      cells[static_cast<size_t>(i)][static_cast<size_t>(j)] = *cell;
      any_nvlink = any_nvlink || cell->kind == LinkKind::NVLink;
      any_soc = any_soc || word == "SOC";
    }
  }
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      const Cell& ab = cells[static_cast<size_t>(a)][static_cast<size_t>(b)];
      const Cell& ba = cells[static_cast<size_t>(b)][static_cast<size_t>(a)];
      DSTRAIN_USER_CHECK(ab == ba)
          << "the nvidia-smi topo matrix is not symmetric: row GPU" << a << " says '"
          << m.gpu_rows[static_cast<size_t>(a)].cells[static_cast<size_t>(b)] << "' for GPU" << b
          << " but row GPU" << b << " says '"
          << m.gpu_rows[static_cast<size_t>(b)].cells[static_cast<size_t>(a)] << "' for GPU" << a;
      Link& link = topology.link(a, b);
      link.kind = ab.kind;
      link.nvlinks = ab.nvlinks;
      if (ab.kind == LinkKind::NVLink) {
        link.peer_access = true;  // NVLink peers can always access each other
        link.peer_access_known = true;
      } else {
        link.path = ab.path;
        link.path_known = true;
      }
    }
  }

  std::set<int> numa_nodes;
  for (int i = 0; i < n; ++i) {
    const MatrixRow& row = m.gpu_rows[static_cast<size_t>(i)];
    GpuInfo& gpu = topology.gpus[static_cast<size_t>(i)];
    for (size_t t = 0; t < row.trailing.size() && t < m.trailing_names.size(); ++t) {
      const std::string& name = m.trailing_names[t];
      const std::string& value = row.trailing[t];
      if (name == "CPU Affinity") {
        if (value != "N/A") gpu.cpu_affinity = value;
      } else if (name == "NUMA Affinity") {
        // A single node; "N/A" or a range ("0-1") stays unknown.
        if (auto node = parse_small_int(value)) gpu.numa_node = *node;
      } else if (name == "GPU NUMA ID") {
        if (auto id = parse_small_int(value)) gpu.gpu_numa_id = *id;
      }
    }
    if (gpu.numa_node >= 0) numa_nodes.insert(gpu.numa_node);
  }
  topology.numa_nodes = static_cast<int>(numa_nodes.size());
  topology.nics = nic_names(m);
  topology.nics_known = true;
  // The names kept from the text go into JSON (topo --json, run_config.json), which holds UTF-8
  // only; nvidia-smi prints them in ASCII.
  const auto ascii = [](const std::string& text) {
    return std::all_of(text.begin(), text.end(), [](char c) { return (c & 0x80) == 0; });
  };
  for (const std::string& nic : topology.nics) {
    DSTRAIN_USER_CHECK(ascii(nic))
        << "nvidia-smi topo: a NIC name holds bytes that are not ASCII; paste the tool's "
        << "output as it prints it";
  }
  for (const GpuInfo& gpu : topology.gpus) {
    DSTRAIN_USER_CHECK(ascii(gpu.cpu_affinity))
        << "nvidia-smi topo: the CPU Affinity of GPU" << gpu.index
        << " holds bytes that are not ASCII; paste the tool's output as it prints it";
  }

  // The -mp view prints PCIe paths only; its legend has no NV# line.
  const bool legend_has_nvlink = m.legend.find("NV#") != std::string::npos;
  const bool mp_view = !any_nvlink && m.legend.find("Legend") != std::string::npos &&
                       !legend_has_nvlink;
  topology.source = mp_view ? "nvidia-smi topo -mp (PCIe paths only, NVLinks not shown)"
                            : "nvidia-smi topo -m";
  if (any_soc) topology.source += " (older driver: SOC read as SYS)";
  return topology;
}

void apply_nvidia_smi_p2p(NodeTopology& topology, const std::string& text) {
  const Matrix m = parse_matrix(text, "nvidia-smi topo -p2p");
  const int n = static_cast<int>(m.gpu_rows.size());
  DSTRAIN_USER_CHECK(n == topology.gpu_count())
      << "the nvidia-smi topo -p2p matrix has " << n << " GPUs but the topology has "
      << topology.gpu_count();
  for (int i = 0; i < n; ++i) check_self_cell(m.gpu_rows[static_cast<size_t>(i)], static_cast<size_t>(i));
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      // Peer access is used both ways: yes only when both directions say OK.
      int yes = 0, no = 0;
      for (const std::string& word : {m.gpu_rows[static_cast<size_t>(a)].cells[static_cast<size_t>(b)],
                                      m.gpu_rows[static_cast<size_t>(b)].cells[static_cast<size_t>(a)]}) {
        if (word == "OK") {
          ++yes;
        } else if (word == "CNS" || word == "GNS" || word == "TNS" || word == "NS" ||
                   word == "DR") {
          ++no;
        } else {
          DSTRAIN_USER_CHECK(word == "U")
              << "cell '" << word << "' for GPU" << a << "-GPU" << b
              << " is not a peer-access status nvidia-smi prints (OK, CNS, GNS, TNS, NS, DR, U)";
        }
      }
      Link& link = topology.link(a, b);
      if (link.kind == LinkKind::NVLink) continue;
      if (no > 0) {
        link.peer_access = false;
        link.peer_access_known = true;
      } else if (yes == 2) {
        link.peer_access = true;
        link.peer_access_known = true;
      }
    }
  }
}

}  // namespace dstrain
