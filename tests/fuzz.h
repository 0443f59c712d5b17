// Bounded mutation fuzzing for the readers of stored and user-written data (config, checkpoints, swap
// manifests): valid inputs made by the test, mutated at random with a fixed seed, each fed to the reader,
// which must give a clear error or a valid result — never a crash, a hang or an escaping exception. The
// sanitizer build (scripts/test-sanitized) runs the same suites, so memory errors and undefined behaviour
// on the way to a refusal fail them too.
//
// Case i draws from its own generator seeded by (seed, i), so a failure is replayed alone with
// ZOE_FUZZ_ITERATION=i. Budget per reader: ZOE_FUZZ_ITERATIONS cases or ZOE_FUZZ_SECONDS, whichever ends
// first; ZOE_FUZZ_SEED changes the seed. A crash writes the input that caused it to
// /tmp/zoe-fuzz-<reader>.crash and names the case on stderr.
#pragma once

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <exception>
#include <functional>
#include <iterator>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace zoe::fuzz {

// The whole of a file, and a file replaced by `bytes`: the valid inputs the fuzzers start from live in files.
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

using Rng = std::mt19937_64;

struct Budget {
  std::uint64_t iterations;
  double seconds;
  std::uint64_t seed = 0x5eed2024;
  std::int64_t only = -1;  // >= 0: run only this case
};

inline Budget budget_from_env(std::uint64_t iterations, double seconds) {
  Budget b{iterations, seconds};
  if (const char* v = std::getenv("ZOE_FUZZ_ITERATIONS")) b.iterations = std::strtoull(v, nullptr, 10);
  if (const char* v = std::getenv("ZOE_FUZZ_SECONDS")) b.seconds = std::strtod(v, nullptr);
  if (const char* v = std::getenv("ZOE_FUZZ_SEED")) b.seed = std::strtoull(v, nullptr, 0);
  if (const char* v = std::getenv("ZOE_FUZZ_ITERATION")) b.only = std::strtoll(v, nullptr, 10);
  return b;
}

// Per reader: 50000 cases or 8 seconds, whichever ends first. A few tens of seconds per build in all,
// next to minutes for building it; raise it locally (ZOE_FUZZ_SECONDS=600) after changing a reader.
inline Budget default_budget() { return budget_from_env(50000, 8.0); }

// ---- byte-level mutations (any format) ----

inline std::size_t pick(Rng& rng, std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng() % n); }

// Values that sit on the edges readers check: zero, all ones, sign bits, 32/64-bit limits.
inline constexpr std::uint64_t kInterestingInts[] = {
    0, 1, 2, 7, 8, 63, 64, 4095, 4096, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000,
    0xFFFFFFFF, 0x100000000, 0x7FFFFFFFFFFFFFFF, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFC0};

inline void put_le(std::string& s, std::size_t at, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes && at + i < s.size(); ++i) s[at + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}

// One random edit; returns its name (for the failure message).
inline const char* mutate_bytes(std::string& s, Rng& rng) {
  const std::size_t n = s.size();
  switch (rng() % 8) {
    case 0:
      if (n > 0) s[pick(rng, n)] ^= static_cast<char>(1u << (rng() % 8));
      return "bit flip";
    case 1: {
      static constexpr char kBytes[] = {0, '\xFF', '\x7F', '\x80', '"', '{', '[', '\\', ',', ':', '-', '0', '9', 'e'};
      if (n > 0) s[pick(rng, n)] = kBytes[pick(rng, sizeof kBytes)];
      return "byte set";
    }
    case 2:
      s.resize(pick(rng, n + 1));
      return "truncation";
    case 3: {
      std::string junk(1 + pick(rng, 16), '\0');
      for (char& c : junk) c = static_cast<char>(rng());
      s.insert(pick(rng, n + 1), junk);
      return "random insertion";
    }
    case 4: {
      const std::size_t at = pick(rng, n + 1);
      s.erase(at, 1 + pick(rng, std::min<std::size_t>(n - at + 1, 64)));
      return "deletion";
    }
    case 5: {
      if (n == 0) return "span duplication";
      const std::size_t at = pick(rng, n), len = 1 + pick(rng, std::min<std::size_t>(n - at, 256));
      s.insert(pick(rng, n + 1), s.substr(at, len));
      return "span duplication";
    }
    case 6: {
      const int widths[] = {1, 2, 4, 8};
      const int w = widths[pick(rng, 4)];
      if (n >= static_cast<std::size_t>(w)) {
        const std::uint64_t v = kInterestingInts[pick(rng, std::size(kInterestingInts))];
        put_le(s, pick(rng, n - w + 1), rng() % 4 == 0 ? ~v : v, w);
      }
      return "interesting integer";
    }
    default: {
      // An integer near the input's own size: offsets and lengths that almost fit.
      if (n >= 8) put_le(s, pick(rng, n - 7) & ~std::size_t{7}, n + (rng() % 129) - 64, 8);
      return "size-like integer";
    }
  }
}

// ---- JSON-aware mutations ----

struct Token {
  std::size_t begin, end;
  bool is_key;
};

// Value tokens (numbers, strings, literals) of a JSON text, outside strings; tolerant of broken input.
inline std::vector<Token> json_tokens(const std::string& s) {
  std::vector<Token> out;
  for (std::size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (c == '"') {
      std::size_t j = i + 1;
      while (j < s.size() && s[j] != '"') j += s[j] == '\\' ? 2 : 1;
      j = std::min(j + 1, s.size());
      std::size_t k = j;
      while (k < s.size() && (s[k] == ' ' || s[k] == '\n')) ++k;
      out.push_back({i, j, k < s.size() && s[k] == ':'});
      i = j;
    } else if (c == '-' || (c >= '0' && c <= '9') || c == 't' || c == 'f' || c == 'n') {
      std::size_t j = i;
      while (j < s.size() && std::strchr(",]} \n\t\r:", s[j]) == nullptr) ++j;
      out.push_back({i, j, false});
      i = j;
    } else {
      ++i;
    }
  }
  return out;
}

// Numbers at the edges of int32, int64, uint64 and double, written as text no serializer would produce.
inline constexpr const char* kNastyNumbers[] = {
    "0", "-0", "-1", "1", "0.5", "1.0", "3", "-1e-300", "1e-400", "1e308", "1e400", "-1e400", "1e9", "1e20",
    "2147483647", "2147483648", "-2147483649", "4294967296", "9223372036854775807", "9223372036854775808",
    "-9223372036854775808", "-9223372036854775809", "9.223372036854775807e18", "9.2233720368547758e18",
    "18446744073709551615", "18446744073709551616", "1.8446744073709552e19", "-1.8446744073709552e19",
    "4.2e15", "NaN", "Infinity", "-Infinity", "0x10", "1e", "--1", "00", ".5"};
inline constexpr const char* kWrongTypes[] = {
    "\"x\"", "\"\"", "\"auto\"", "\"nvme\"", "\"cpu\"", "\"AdamW\"", "true", "false", "null", "[]", "{}", "[1,2]",
    "[0.9,0.999,0.5]", "{\"a\":1}", "[\"/tmp\",\"/tmp\"]", "\"\\u0000\"", "\"\\ud800\"", "\"\xC3\x28\""};

// Deeply nested arrays or objects: what recursive code (dump, destructors, validators) meets.
inline constexpr std::size_t kMaxNesting = 60000;
inline std::string deep(Rng& rng, std::size_t max_depth) {
  static constexpr std::size_t kDepths[] = {64, 1000, 20000, kMaxNesting};
  std::size_t d = kDepths[pick(rng, std::size(kDepths))];
  d = std::min(d, max_depth);
  const bool objects = rng() % 2 == 0;
  std::string s;
  s.reserve(d * 6 + 4);
  for (std::size_t i = 0; i < d; ++i) s += objects ? "{\"a\":" : "[";
  s += "1";
  for (std::size_t i = 0; i < d; ++i) s += objects ? "}" : "]";
  return s;
}

// A random node of a parsed document (pointers stay valid until the document changes).
inline nlohmann::json* random_node(nlohmann::json& root, Rng& rng) {
  std::vector<nlohmann::json*> nodes;
  std::vector<nlohmann::json*> todo{&root};
  while (!todo.empty()) {
    nlohmann::json* j = todo.back();
    todo.pop_back();
    nodes.push_back(j);
    if (j->is_structured()) {
      for (auto& child : *j) todo.push_back(&child);
    }
  }
  return nodes[pick(rng, nodes.size())];
}

// Structural edits on the parsed document: wrong types, removed members, moved subtrees, keys from one
// level put at another. The result is valid JSON whose meaning is wrong.
// How deeply brackets nest outside strings.
inline std::size_t json_depth(const std::string& s) {
  std::size_t depth = 0, most = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (in_string) {
      if (s[i] == '\\') ++i;
      else if (s[i] == '"') in_string = false;
    } else if (s[i] == '"') {
      in_string = true;
    } else if (s[i] == '[' || s[i] == '{') {
      most = std::max(most, ++depth);
    } else if ((s[i] == ']' || s[i] == '}') && depth > 0) {
      --depth;
    }
  }
  return most;
}

inline const char* mutate_tree(std::string& s, Rng& rng) {
  // nlohmann::json copies recursively, and every subtree is copied below: not for inputs already made deep.
  if (json_depth(s) > 100) return mutate_bytes(s, rng);
  nlohmann::json root = nlohmann::json::parse(s, nullptr, false);
  if (root.is_discarded()) return mutate_bytes(s, rng);
  std::vector<std::string> keys;
  std::vector<nlohmann::json> values;
  std::vector<nlohmann::json*> todo{&root};
  while (!todo.empty()) {
    nlohmann::json* j = todo.back();
    todo.pop_back();
    values.push_back(*j);
    if (j->is_object()) {
      for (auto& [k, v] : j->items()) keys.push_back(k);
    }
    if (j->is_structured()) {
      for (auto& child : *j) todo.push_back(&child);
    }
  }
  nlohmann::json* node = random_node(root, rng);
  const char* what = "";
  switch (rng() % 5) {
    case 0:
      *node = nlohmann::json::parse(kWrongTypes[pick(rng, std::size(kWrongTypes))], nullptr, false, true);
      what = "value replaced by another type";
      break;
    case 1:
      *node = values[pick(rng, values.size())];
      what = "value replaced by another subtree";
      break;
    case 2:
      if (node->is_object() && !node->empty()) {
        auto it = node->begin();
        std::advance(it, static_cast<std::ptrdiff_t>(pick(rng, node->size())));
        node->erase(it);
      } else if (node->is_array() && !node->empty()) {
        node->erase(pick(rng, node->size()));
      }
      what = "member removed";
      break;
    case 3:
      if (node->is_object() && !keys.empty()) (*node)[keys[pick(rng, keys.size())]] = values[pick(rng, values.size())];
      what = "known key added at another level";
      break;
    default:
      if (node->is_array()) node->push_back(values[pick(rng, values.size())]);
      what = "array element added";
      break;
  }
  s = root.dump(rng() % 2 == 0 ? -1 : 2, ' ', false, nlohmann::json::error_handler_t::replace);
  return what;
}

// Text edits nlohmann::json would never write: nasty numbers, duplicate keys, deep nesting in place of
// a value.
inline const char* mutate_json_text(std::string& s, Rng& rng, std::size_t max_depth) {
  const std::vector<Token> tokens = json_tokens(s);
  if (tokens.empty()) return mutate_bytes(s, rng);
  const Token& t = tokens[pick(rng, tokens.size())];
  switch (rng() % 4) {
    case 0: {
      // Prefer a number: that is where range checks live.
      std::vector<const Token*> numbers;
      for (const Token& k : tokens) {
        if (s[k.begin] == '-' || (s[k.begin] >= '0' && s[k.begin] <= '9')) numbers.push_back(&k);
      }
      const Token& n = numbers.empty() ? t : *numbers[pick(rng, numbers.size())];
      s.replace(n.begin, n.end - n.begin, kNastyNumbers[pick(rng, std::size(kNastyNumbers))]);
      return "number replaced by an edge value";
    }
    case 1:
      if (t.is_key) return "key left alone";
      s.replace(t.begin, t.end - t.begin, kWrongTypes[pick(rng, std::size(kWrongTypes))]);
      return "value replaced by another type (text)";
    case 2: {
      // The same key again, later in its object: which value wins is the reader's to say.
      std::vector<const Token*> keys;
      for (const Token& k : tokens) {
        if (k.is_key) keys.push_back(&k);
      }
      if (keys.empty()) return "no key to duplicate";
      const Token& k = *keys[pick(rng, keys.size())];
      const std::string dup = s.substr(k.begin, k.end - k.begin) + ":" + kNastyNumbers[pick(rng, std::size(kNastyNumbers))] + ",";
      s.insert(k.begin, dup);
      return "duplicate key";
    }
    default:
      if (t.is_key) return "key left alone";
      s.replace(t.begin, t.end - t.begin, deep(rng, max_depth));
      return "value replaced by deep nesting";
  }
}

// 1 to 3 edits, JSON-aware ones three times in four.
// `max_depth` bounds the nesting put in place of a value (a reader with a known limit, named where it is
// lowered).
inline std::string mutate_json(const std::string& valid, Rng& rng, std::string* what,
                               std::size_t max_depth = kMaxNesting) {
  std::string s = valid;
  const int edits = 1 + static_cast<int>(rng() % 3);
  for (int e = 0; e < edits; ++e) {
    const std::uint64_t kind = rng() % 4;
    const char* w = kind == 0 ? mutate_bytes(s, rng) : kind == 1 ? mutate_json_text(s, rng, max_depth) : mutate_tree(s, rng);
    *what += (e ? " + " : "") + std::string(w);
  }
  return s;
}

inline std::string mutate_binary(const std::string& valid, Rng& rng, std::string* what) {
  std::string s = valid;
  const int edits = 1 + static_cast<int>(rng() % 3);
  for (int e = 0; e < edits; ++e) *what += (e ? " + " : "") + std::string(mutate_bytes(s, rng));
  return s;
}

// ---- the driver ----

// What a crash handler may touch: plain data set before each case.
struct CrashContext {
  const char* reader = "";
  const std::string* input = nullptr;
  std::int64_t iteration = -1;
  char path[256] = {};
};
inline CrashContext g_crash;

inline void write_str(const char* s) { (void)!::write(2, s, std::strlen(s)); }

inline void write_case_number() {
  char num[24];
  int len = 0;
  for (std::uint64_t v = static_cast<std::uint64_t>(g_crash.iteration); len == 0 || v > 0; v /= 10) num[len++] = static_cast<char>('0' + v % 10);
  for (int i = len - 1; i >= 0; --i) (void)!::write(2, &num[i], 1);
}

// Async-signal-safe: names the case and saves its input, then lets the signal do what it would have done.
inline void on_crash(int sig) {
  write_str("\nfuzz: reader '");
  write_str(g_crash.reader);
  write_str("' crashed on case ");
  write_case_number();
  if (g_crash.input != nullptr) {
    const int fd = ::open(g_crash.path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      (void)!::write(fd, g_crash.input->data(), g_crash.input->size());
      ::close(fd);
      write_str("; input saved to ");
      write_str(g_crash.path);
    }
  } else {
    write_str(" while making its input (the test's own code)");
  }
  write_str("; replay: ZOE_FUZZ_ITERATION=");
  write_case_number();
  write_str("\n");
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

inline void install_crash_handlers() {
  // Under ASan its own handlers report SIGSEGV/SIGBUS/SIGFPE and then abort (abort_on_error=1): catching
  // SIGABRT is enough there and keeps its report whole.
#if defined(__SANITIZE_ADDRESS__)
  const int signals[] = {SIGABRT};
#else
  const int signals[] = {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL};
#endif
  // A stack overflow leaves no stack to run the handler on: it gets one of its own (this thread's, where
  // the readers run).
  static char alt_stack[1 << 16];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  ::sigaltstack(&ss, nullptr);
  for (int sig : signals) {
    struct sigaction sa {};
    sa.sa_handler = on_crash;
    sa.sa_flags = SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, nullptr);
  }
}

struct Case {
  std::string input;
  std::string mutation;  // what was done to the valid input
};

struct Tally {
  std::uint64_t cases = 0, accepted = 0, refused = 0;
  double seconds = 0;
  bool replay = false;  // one case (ZOE_FUZZ_ITERATION)
};

// A run where every case was refused (or none was) has mutations that miss the reader's logic, or a valid
// input that is not: either way the run proved little.
inline void expect_both_outcomes(const Tally& t) {
  if (t.replay) return;
  EXPECT_GT(t.refused, 0u) << "no case was refused: do the mutations reach the reader?";
  EXPECT_GT(t.accepted, 0u) << "no case was accepted: is the starting input valid?";
}

enum class Verdict { accepted, refused };

// A call slower than this on inputs of at most a few hundred KB is a hang in the making (quadratic work,
// unbounded retries); one still running after kHangSeconds is stopped (abort names the case).
inline constexpr double kSlowCaseSeconds = 5.0;
inline constexpr int kHangSeconds = 30;
// A reader may hold a few times its input; more than this for one case is unbounded growth.
inline constexpr long kCaseMemoryKiB = 512 << 10;

inline long peak_rss_kib() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// Aborts the process (the crash handler then names the case) if one case runs longer than kHangSeconds.
class Watchdog {
 public:
  Watchdog() : thread_([this] { watch(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void start_case() { started_.store(std::chrono::steady_clock::now().time_since_epoch().count()); }
  void end_case() { started_.store(kIdle); }

 private:
  static constexpr std::int64_t kIdle = -1;
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(200), [this] { return done_; })) {
      const std::int64_t t0 = started_.load();
      const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
      if (t0 != kIdle && std::chrono::steady_clock::duration(now - t0) > std::chrono::seconds(kHangSeconds)) {
        std::fprintf(stderr, "\nfuzz: one case has run for %d s: a hang\n", kHangSeconds);
        std::abort();
      }
    }
  }
  std::atomic<std::int64_t> started_{kIdle};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::thread thread_;
};

// Runs make(rng) then check(case) for each case of the budget. check returns the reader's verdict and
// reports broken promises (an empty error message, an accepted input that breaks an invariant) through
// gtest; an exception escaping it, a slow case or one that grew the process by kCaseMemoryKiB fails the
// test here. Stops at the first failing case.
inline Tally run(const char* reader, const Budget& budget, const std::function<Case(Rng&)>& make,
                 const std::function<Verdict(const Case&)>& check) {
  install_crash_handlers();
  g_crash.reader = reader;
  std::snprintf(g_crash.path, sizeof g_crash.path, "/tmp/zoe-fuzz-%s.crash", reader);
  Watchdog watchdog;
  Tally t;
  t.replay = budget.only >= 0;
  const auto start = std::chrono::steady_clock::now();
  const std::uint64_t first = budget.only >= 0 ? static_cast<std::uint64_t>(budget.only) : 0;
  const std::uint64_t last = budget.only >= 0 ? first + 1 : budget.iterations;
  for (std::uint64_t i = first; i < last; ++i) {
    if (budget.only < 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > budget.seconds) break;
    std::seed_seq seq{budget.seed, static_cast<std::uint64_t>(i)};
    Rng rng(seq);
    g_crash.input = nullptr;  // a crash while mutating is the test's own
    g_crash.iteration = static_cast<std::int64_t>(i);
    const Case c = make(rng);
    g_crash.input = &c.input;
    const std::string where = std::string(reader) + " case " + std::to_string(i) + " (" + c.mutation +
                              "; replay: ZOE_FUZZ_ITERATION=" + std::to_string(i) + ")";
    const long rss0 = peak_rss_kib();
    const auto t0 = std::chrono::steady_clock::now();
    watchdog.start_case();
    try {
      (check(c) == Verdict::accepted ? t.accepted : t.refused)++;
    } catch (const std::exception& e) {
      ADD_FAILURE() << where << ": exception escaped the reader: " << e.what();
    } catch (...) {
      ADD_FAILURE() << where << ": a non-std exception escaped the reader";
    }
    watchdog.end_case();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(took, kSlowCaseSeconds) << where << ": one input of " << c.input.size() << " bytes took " << took << " s";
    const long grew = peak_rss_kib() - rss0;
    EXPECT_LT(grew, kCaseMemoryKiB) << where << ": one input of " << c.input.size() << " bytes grew the process by "
                                    << grew / 1024 << " MiB";
    ++t.cases;
    if (::testing::Test::HasFailure()) {
      std::fprintf(stderr, "fuzz: stopping %s at its first failure: %s\n", reader, where.c_str());
      break;
    }
  }
  g_crash.input = nullptr;
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("fuzz %-18s %6llu cases in %5.1f s: %6llu refused with an error, %6llu accepted (seed 0x%llx)\n", reader,
              static_cast<unsigned long long>(t.cases), t.seconds, static_cast<unsigned long long>(t.refused),
              static_cast<unsigned long long>(t.accepted), static_cast<unsigned long long>(budget.seed));
  ::testing::Test::RecordProperty(std::string(reader) + "_cases", static_cast<int>(t.cases));
  return t;
}

}  // namespace zoe::fuzz
