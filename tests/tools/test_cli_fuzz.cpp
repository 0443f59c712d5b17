// Every value-taking option of every `zoe` subcommand given huge, negative, overflowing and garbled values
// (issue 49): the command must end by itself with exit 0, 1 or 2, never by a signal or a hang, and a refusal
// must say what it refused. Before the option ranges, `zoe bench adam --n 18446744073709551615` ended in
// SIGSEGV (its buffer sizes wrapped), `zoe probe --bytes 18446744073709551615` measured "0 MiB" and called
// the path ok, and `--reps 1T` was truncated to 0 repetitions. Under scripts/test-sanitized the zoe run
// here is the sanitized one, so undefined behaviour on the way to a refusal aborts it and fails the case.
//
// Each command starts from a tiny valid run (a few thousand parameters, one repetition), so a value that is
// in range runs quickly; the point is the refusal path.
#include <gtest/gtest.h>

#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/tools/cli_runner.h"

namespace zoe::test {
namespace {

// What a user can type wrong: 2^64 - 1 and 2^64, signs, zero, suffixed sizes past any machine, doubles out of
// range, not-a-numbers, nothing, trailing garbage, hex, a leading space, 2^63 (negative as a signed integer).
const std::vector<std::string> kNumbers = {"18446744073709551615", "18446744073709551616", "-1", "0", "1T",
                                           "99999999T", "1e400", "nan", "inf", "", "12abc", "0x10", " 5",
                                           "9223372036854775808"};
// Options that take a word (a dtype, a device, a folder) get fewer: each is refused or taken as a name.
const std::vector<std::string> kWords = {"", "-1", "18446744073709551616", " 5"};

struct Option {
  std::string name;
  bool numeric;
};

struct Command {
  std::string label;
  std::vector<std::string> base;  // a tiny valid run
  std::vector<Option> options;
};

class CliFuzz : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zoe-cli-fuzz-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    // Each of the two runners its own folder with its own swap folder: two bench nvme runs in one folder
    // would meet each other's store.
    for (const char* w : {"/w0/swap", "/w1/swap"}) std::filesystem::create_directories(dir_ + w);
    // The benches' threads: few, so that the runs in range stay short on a small machine.
    ::setenv("ZOE_THREADS", "2", 1);
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::vector<Command> commands() const {
    const std::string swap = "swap";  // in the runner's folder, the children's working folder
    std::vector<Command> c = {
        {"bench adam",
         {"bench", "adam", "--n", "4K", "--reps", "1", "--threads", "1"},
         {{"n", true}, {"tensors", true}, {"threads", true}, {"reps", true}, {"tile", true}, {"isa", false},
          {"grad", false}, {"out", false}, {"state", false}, {"optimizer", false}}},
        {"bench accumulate",
         {"bench", "accumulate", "--n", "4K", "--reps", "1", "--threads", "1"},
         {{"n", true}, {"threads", true}, {"reps", true}, {"tile", true}, {"isa", false}, {"grad", false},
          {"mode", false}}},
        {"bench step",
         {"bench", "step", "--n", "4K", "--buckets", "2", "--iters", "1", "--compute-ms", "0"},
         {{"n", true}, {"buckets", true}, {"compute-ms", true}, {"iters", true}, {"tile", true}, {"device", false},
          {"schedule", false}, {"tier", false}, {"path", false}, {"durability", false}, {"state", false}}},
        {"bench step --offload-param",
         {"bench", "step", "--offload-param", "cpu", "--layers", "2", "--layer-bytes", "64K", "--prefetch", "0",
          "--iters", "1", "--compute-ratio", "0.001"},
         {{"layers", true}, {"layer-bytes", true}, {"prefetch", true}, {"compute-ratio", true}, {"iters", true},
          {"device", false}, {"path", false}, {"offload-param", false}}},
        {"plan",
         {"plan", "--params", "1B", "--adam-rate", "1B", "--nvme-gbps", "2", "--pcie-gbps", "25", "--gpu-mem", "80G",
          "--host-ram", "256G"},
         {{"params", true}, {"gpus", true}, {"nodes", true}, {"gpu-mem", true}, {"host-ram", true},
          {"nvme-capacity", true}, {"stage", true}, {"prefetch", true}, {"grad-accum", true}, {"micro-batch", true},
          {"seq-len", true}, {"adam-rate", true}, {"nvme-gbps", true}, {"pcie-gbps", true}, {"model", false},
          {"offload-optimizer", false}, {"offload-param", false}, {"state-dtype", false}, {"nvme", false}}},
        // A checkpoint that is not there: --out is refused or taken as a folder name, nothing is written.
        {"export", {"export", dir_ + "/none.zoe", "--out", dir_ + "/out"}, {{"out", false}}},
    };
#ifdef ZOE_HAVE_AIO
    c.push_back({"bench nvme",
                 {"bench", "nvme", "--path", swap, "--n", "16K", "--tile", "48K", "--buffers", "2", "--reps", "1"},
                 {{"n", true}, {"tile", true}, {"buffers", true}, {"queue-depth", true}, {"block-size", true},
                  {"reps", true}, {"chunk", true}, {"path", false}, {"state", false}, {"grad", false}, {"out", false},
                  {"durability", false}}});
    c.push_back({"probe", {"probe", swap, "--bytes", "1M"}, {{"bytes", true}}});
#endif
    return c;
  }

  std::string dir_;
};

struct Case {
  std::string label;
  std::vector<std::string> args;
  std::string option;  // "--name" when the option takes a number: a refusal names it
};

std::string shown(const std::vector<std::string>& args) {
  std::string s = "zoe";
  for (const std::string& a : args) s += " '" + a + "'";
  return s;
}

// Runs the cases two at a time (each child is mostly waiting on its own start-up), each runner's children in
// its own folder under `dir`, and reports every failure with the command line that caused it.
void run_cases(const std::vector<Case>& cases, const std::string& dir) {
  std::atomic<std::size_t> next{0};
  std::mutex lock;
  std::vector<std::string> failures;
  auto worker = [&](const std::string& cwd) {
    for (std::size_t i; (i = next.fetch_add(1)) < cases.size();) {
      const Case& c = cases[i];
      const Ran r = run_zoe(c.args, 60, cwd);
      std::string why;
      if (r.signaled || r.timed_out || r.code < 0 || r.code > 2) {
        why = r.how();
      } else if (r.code != 0 && r.output.find("zoe") == std::string::npos) {
        why = r.how() + " without a message";
      } else if (r.code == 2 && !c.option.empty() && r.output.find(c.option) == std::string::npos) {
        why = "refused without naming " + c.option;
      }
      if (!why.empty()) {
        const std::lock_guard g(lock);
        failures.push_back(shown(c.args) + ": " + why + "\n" + r.output.substr(0, 2000));
      }
    }
  };
  std::thread a(worker, dir + "/w0"), b(worker, dir + "/w1");
  a.join();
  b.join();
  for (const std::string& f : failures) ADD_FAILURE() << f;
  std::printf("%zu command lines run, %zu failed\n", cases.size(), failures.size());
}

TEST_F(CliFuzz, EveryOptionOfEveryCommandEndsWithAStatusNotASignal) {
  std::vector<Case> cases;
  for (const Command& c : commands()) {
    for (const Option& o : c.options) {
      for (const std::string& v : o.numeric ? kNumbers : kWords) {
        std::vector<std::string> args = c.base;
        args.push_back("--" + o.name);
        args.push_back(v);
        cases.push_back({c.label, args, o.numeric ? "--" + o.name : ""});
      }
    }
    // The --name=value spelling goes through the same parser: once per command, with its first option.
    std::vector<std::string> args = c.base;
    args.push_back("--" + c.options[0].name + "=18446744073709551616");
    cases.push_back({c.label, args, "--" + c.options[0].name});
  }
  run_cases(cases, dir_);
}

// The reproductions, each refused by name with its range (exit 2), not run.
TEST_F(CliFuzz, TheReportedNumbersAreRefusedWithTheirRange) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"bench", "adam", "--n", "18446744073709551615"}, "--n 18446744073709551615 is out of range: give 1 to 1T"},
      {{"bench", "accumulate", "--n", "18446744073709551615"}, "--n 18446744073709551615 is out of range: give 1 to 1T"},
      {{"bench", "adam", "--n", "4K", "--reps", "1T"}, "--reps 1T is out of range: give 1 to 1M"},
      {{"bench", "accumulate", "--n", "4K", "--reps", "1T"}, "--reps 1T is out of range: give 1 to 1M"},
      {{"bench", "adam", "--n", "1T"}, "--n 1T needs buffers of"},
      {{"bench", "step", "--compute-ms", "1e400"}, "--compute-ms 1e400 is out of range"},
      {{"plan", "--params", "7B", "--pcie-gbps", "inf"}, "--pcie-gbps inf is out of range"},
      {{"plan", "--params", "7B", "--gpus", "-1"}, "--gpus '-1' is not a count"},
      {{"plan", "--params", "0x10"}, "--params: '0x10' is not a size"},  // strtod took it as hex
      {{"plan", "--params", "200T"}, "--params 200T is out of range: give 1 to 100T"},
#ifdef ZOE_HAVE_AIO
      {{"probe", dir_ + "/w0/swap", "--bytes", "18446744073709551615"}, "--bytes 18446744073709551615 is out of range: give 1 to 16G"},
      {{"bench", "nvme", "--path", dir_ + "/w0/swap", "--reps", "1T"}, "--reps 1T is out of range: give 1 to 1M"},
#endif
  };
  for (const auto& [args, message] : cases) {
    const Ran r = run_zoe(args, 60, dir_);
    EXPECT_FALSE(r.signaled) << shown(args) << ": " << r.how() << "\n" << r.output;
    EXPECT_EQ(r.code, 2) << shown(args) << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << shown(args) << " said:\n" << r.output;
  }
}

// Commands and words that are not commands: the usage, exit 2.
TEST_F(CliFuzz, UnknownCommandsAndHelpEndWithAStatus) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"1T"}, {""}, {"bench", "18446744073709551616"}, {"bench"}, {"--help"},
                                             {"bench", "adam", "--help"}, {"plan", "--help"}, {"info"}}) {
    const Ran r = run_zoe(args, 60, dir_);
    EXPECT_TRUE(!r.signaled && !r.timed_out && r.code >= 0 && r.code <= 2) << shown(args) << ": " << r.how();
  }
}

}  // namespace
}  // namespace zoe::test
