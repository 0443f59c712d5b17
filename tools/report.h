// How every zoe command writes what it found: with --json one JSON object per result, each on a line of its
// own and nothing else on stdout (scripts read it line by line); otherwise the command's table or lines, with
// progress notes on stderr. Errors go to stderr as "zoe COMMAND: ..." with the exit status exit_status() gives.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "tools/args.h"
#include "zoe/status.h"

namespace zoe::cli {

// printf into a string: the commands build their table rows and lines with it, one format per row.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// A command's --help: `head` (its usage line and what it does), the options, then `tail`, on stdout.
void print_help(std::string_view head, std::span<const Option> options, std::string_view tail);

// A failed command on stderr, "zoe bench adam: invalid argument: --n 0: ...", and its exit status: fail with
// the status code's name (and errno), fail_message with the message alone.
int fail(std::string_view command, const Status& s);
int fail_message(std::string_view command, const Status& s);

class Report {
 public:
  Report(std::string_view command, bool json) : command_(command), json_(json) {}

  bool json() const { return json_; }
  // The header of the table the text results are rows of, printed before the first of them.
  void header(std::string text) { header_ = std::move(text); }
  // One result: its JSON object (one line) with --json, else `text` (whole lines), flushed so that a long
  // run shows each case as it is measured.
  void result(std::string_view json_object, std::string_view text);
  void result(const JsonLine& json, std::string_view text) { result(json.str(), text); }
  // Lines on stdout that are not a result (a run's description, a file written); --json leaves them out.
  void lines(std::string_view text);
  // What the command is doing, on stderr as "zoe plan: measuring ..."; --json keeps stderr for errors.
  void progress(std::string_view what) const;

 private:
  void text(std::string_view text);

  std::string command_;
  bool json_ = false;
  std::string header_;
};

}  // namespace zoe::cli
