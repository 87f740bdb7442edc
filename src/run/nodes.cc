#include "run/nodes.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.h"

namespace keel::run {
namespace {

// The host a host-file line names ("" for a blank line or a comment).
std::string host_of(const std::string& line) {
  std::istringstream in(line.substr(0, line.find('#')));
  std::string host;
  in >> host;
  return host;
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw Error(fmt::format("run: --hosts {}: cannot read the host file", path));
  std::vector<std::string> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(line);
  return lines;
}

}  // namespace

std::vector<std::string> read_hostfile(const std::string& path) {
  std::vector<std::string> hosts;
  for (const auto& line : read_lines(path))
    if (const std::string h = host_of(line); !h.empty()) hosts.push_back(h);
  if (hosts.empty()) throw Error(fmt::format("run: --hosts {}: the host file names no host", path));
  return hosts;
}

void write_hostfile_without(const std::string& from, const std::vector<std::string>& out, const std::string& to) {
  std::string text;
  int left = 0;
  for (const auto& line : read_lines(from)) {
    const std::string h = host_of(line);
    if (!h.empty() && std::find(out.begin(), out.end(), h) != out.end()) continue;
    left += h.empty() ? 0 : 1;
    text += line + "\n";
  }
  if (left == 0) throw Error(fmt::format("run: --hosts {}: no host is left once the excluded nodes are out", from));
  const std::string tmp = to + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    if (!f) throw Error(fmt::format("run: cannot write the host file {}", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, to, ec);
  if (ec) throw Error(fmt::format("run: cannot write the host file {}: {}", to, ec.message()));
}

std::vector<std::string> launch_args(const std::string& launcher, int ranks, const std::string& hostfile,
                                     const std::vector<std::string>& excluded_nodes) {
  if (launcher == "srun") {
    std::vector<std::string> a = {"srun", fmt::format("--ntasks={}", ranks), "--kill-on-bad-exit=1"};
    if (!excluded_nodes.empty()) a.push_back("--exclude=" + fmt::format("{}", fmt::join(excluded_nodes, ",")));
    return a;
  }
  if (ranks <= 1 && hostfile.empty()) return {};
  std::vector<std::string> a = {launcher, "-np", std::to_string(ranks), "--oversubscribe", "--bind-to", "none"};
  if (!hostfile.empty()) a.insert(a.end(), {"--hostfile", hostfile});
  return a;
}

}  // namespace keel::run
