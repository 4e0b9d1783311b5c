// examples/common/data/csv.hpp — a small CSV reader for time series (the vega-datasets CSV files).
//
// One sentence: `read_csv(path)` loads a CSV file with a header row into string columns, and
// `numeric_column` / `numeric_columns_by` turn columns into series of doubles, throwing
// loom::DataError naming the file, the line and the column for anything that is not a number.
//
// Example:
//   auto dir = examples::data::find_vega_datasets();
//   auto employment = examples::data::read_csv(dir / "us-employment.csv");
//   std::vector<double> jobs = employment.numeric_column("nonfarm");        // 120 monthly values
//   auto stocks = examples::data::read_csv(dir / "stocks.csv");
//   auto prices = stocks.numeric_columns_by("symbol", "price");             // {"AAPL": [...], ...}
//
// Format: RFC 4180 (comma separator, optional double quotes, "" inside quotes is a quote,
// LF or CRLF line ends); the first row names the columns; blank lines are ignored.
// Source: RFC 4180; pandas.read_csv's header-row convention.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/error.hpp>

namespace examples::data {

/// A CSV file's columns as strings, plus the file name for error messages.
///
/// Example: `read_csv("stocks.csv").column("symbol")[0] == "MSFT"`.
class CsvTable {
 public:
  CsvTable(std::filesystem::path path, std::vector<std::string> names, std::vector<std::vector<std::string>> columns,
           std::vector<std::size_t> lines)
      : path_(std::move(path)), names_(std::move(names)), columns_(std::move(columns)), lines_(std::move(lines)) {}

  /// The file this table was read from.
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  /// Column names, in file order.
  [[nodiscard]] const std::vector<std::string>& column_names() const noexcept { return names_; }
  /// Number of data rows (the header is not counted).
  [[nodiscard]] std::size_t rows() const noexcept { return lines_.size(); }

  /// The cells of column `name`, one per row, unparsed.
  /// Throws: loom::DataError naming the file, the column and the columns that exist.
  [[nodiscard]] const std::vector<std::string>& column(std::string_view name) const { return columns_[index_of(name)]; }

  /// Column `name` parsed as doubles, one per row.
  ///
  /// Example: `read_csv("seattle-temps.csv").numeric_column("temp").size() == 8759`.
  /// Units: whatever the file stores (the vega files: degrees Fahrenheit, thousands of jobs, USD).
  /// Throws: loom::DataError naming the file and the column if the column has no value at all
  ///         ("empty column": no rows, or every cell blank); naming file:line, the column and the
  ///         cell if one cell is blank or not a number.
  [[nodiscard]] std::vector<double> numeric_column(std::string_view name) const {
    const std::size_t c = index_of(name);
    return parse_numbers(c);
  }

  /// For a "long" table (one row per (key, value)), the numeric column `value` grouped by the
  /// string column `key`, each group in file order.
  ///
  /// Example: `read_csv("stocks.csv").numeric_columns_by("symbol", "price").at("IBM").size() == 123`.
  /// Throws: as numeric_column, and loom::DataError if `key` has a blank cell.
  [[nodiscard]] std::map<std::string, std::vector<double>> numeric_columns_by(std::string_view key,
                                                                              std::string_view value) const {
    const std::size_t k = index_of(key);
    const std::size_t v = index_of(value);
    std::vector<double> all = parse_numbers(v);
    std::map<std::string, std::vector<double>> out;
    for (std::size_t r = 0; r < rows(); ++r) {
      const std::string& group = columns_[k][r];
      if (group.empty())
        throw loom::DataError(fmt::format("{}:{}: column '{}' has a blank cell", path_.string(), lines_[r], names_[k]));
      out[group].push_back(all[r]);
    }
    return out;
  }

 private:
  [[nodiscard]] std::size_t index_of(std::string_view name) const {
    for (std::size_t i = 0; i < names_.size(); ++i)
      if (names_[i] == name) return i;
    throw loom::DataError(
        fmt::format("{}: no column '{}' (columns: {})", path_.string(), name, fmt::join(names_, ", ")));
  }

  [[nodiscard]] std::vector<double> parse_numbers(std::size_t c) const {
    const auto& cells = columns_[c];
    const std::size_t begin = 0, end = cells.size();
    bool any = false;
    for (std::size_t r = begin; r < end; ++r) any = any || !trim(cells[r]).empty();
    if (!any)
      throw loom::DataError(
          fmt::format("{}: column '{}' is empty ({} data rows, no values)", path_.string(), names_[c], end - begin));
    std::vector<double> out;
    out.reserve(end - begin);
    for (std::size_t r = begin; r < end; ++r) {
      const std::string_view cell = trim(cells[r]);
      if (cell.empty())
        throw loom::DataError(fmt::format("{}:{}: column '{}' has a blank cell", path_.string(), lines_[r], names_[c]));
      double x = 0;
      const char* first = cell.data();
      if (!cell.empty() && cell.front() == '+') ++first;
      const auto [ptr, ec] = std::from_chars(first, cell.data() + cell.size(), x);
      if (ec != std::errc() || ptr != cell.data() + cell.size())
        throw loom::DataError(fmt::format("{}:{}: column '{}' holds '{}', which is not a number", path_.string(),
                                          lines_[r], names_[c], cell));
      out.push_back(x);
    }
    return out;
  }

  static std::string_view trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
  }

  std::filesystem::path path_;
  std::vector<std::string> names_;
  std::vector<std::vector<std::string>> columns_;  // columns_[column][row]
  std::vector<std::size_t> lines_;                 // 1-based file line of each data row
};

namespace detail {
/// Splits CSV text into records of fields (RFC 4180). Each record carries its 1-based first line.
inline std::vector<std::pair<std::size_t, std::vector<std::string>>> split_csv(std::string_view text,
                                                                               const std::filesystem::path& path) {
  std::vector<std::pair<std::size_t, std::vector<std::string>>> records;
  std::vector<std::string> fields;
  std::string field;
  bool in_quotes = false, record_has_content = false;
  std::size_t line = 1, record_line = 1;
  auto end_record = [&] {
    fields.push_back(std::move(field));
    field.clear();
    if (record_has_content) records.emplace_back(record_line, std::move(fields));
    fields.clear();
    record_has_content = false;
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_quotes) {
      if (ch == '"') {
        if (i + 1 < text.size() && text[i + 1] == '"') {
          field.push_back('"');
          ++i;
        } else {
          in_quotes = false;
        }
      } else {
        if (ch == '\n') ++line;
        field.push_back(ch);
      }
      continue;
    }
    switch (ch) {
      case '"':
        in_quotes = true;
        record_has_content = true;
        break;
      case ',':
        fields.push_back(std::move(field));
        field.clear();
        record_has_content = true;
        break;
      case '\r': break;
      case '\n':
        end_record();
        ++line;
        record_line = line;
        break;
      default: field.push_back(ch); record_has_content = true;
    }
  }
  if (in_quotes) throw loom::DataError(fmt::format("{}:{}: unterminated quoted field", path.string(), record_line));
  end_record();
  return records;
}
}  // namespace detail

/// Reads a CSV file whose first row names the columns.
///
/// Example: `read_csv(find_vega_datasets() / "us-employment.csv").rows() == 120`.
/// Throws: loom::DataError naming the file if it is missing or unreadable, has no header row,
///         a duplicate or blank column name, or a row whose field count differs from the header's
///         (naming file:line and both counts).
inline CsvTable read_csv(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw loom::DataError(fmt::format("{}: no such CSV file", path.string()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw loom::DataError(fmt::format("{}: cannot open CSV file", path.string()));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) throw loom::DataError(fmt::format("{}: read error", path.string()));
  std::string text = std::move(buf).str();
  if (text.size() >= 3 && text.compare(0, 3, "\xEF\xBB\xBF") == 0) text.erase(0, 3);  // UTF-8 byte order mark

  auto records = detail::split_csv(text, path);
  if (records.empty()) throw loom::DataError(fmt::format("{}: empty CSV file (no header row)", path.string()));
  std::vector<std::string> names = std::move(records.front().second);
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i].empty())
      throw loom::DataError(
          fmt::format("{}:{}: column {} has a blank name", path.string(), records.front().first, i + 1));
    for (std::size_t j = 0; j < i; ++j)
      if (names[j] == names[i])
        throw loom::DataError(
            fmt::format("{}:{}: column name '{}' appears twice", path.string(), records.front().first, names[i]));
  }
  std::vector<std::vector<std::string>> columns(names.size());
  std::vector<std::size_t> lines;
  for (std::size_t r = 1; r < records.size(); ++r) {
    auto& [line, fields] = records[r];
    if (fields.size() != names.size())
      throw loom::DataError(fmt::format("{}:{}: {} fields, but the header has {} columns", path.string(), line,
                                        fields.size(), names.size()));
    for (std::size_t c = 0; c < fields.size(); ++c) columns[c].push_back(std::move(fields[c]));
    lines.push_back(line);
  }
  return CsvTable(path, std::move(names), std::move(columns), std::move(lines));
}

/// Where Debian's python3-vega-datasets keeps its CSV files.
inline const std::filesystem::path kDebianVegaDatasetsDir = "/usr/lib/python3/dist-packages/vega_datasets/_data";

/// Finds the vega-datasets CSV folder: $LOOM_VEGA_DATASETS, then Debian's package folder, then
/// `third_party_data/vega_datasets` (where scripts/setup.sh unpacks the CSVs alone) under the
/// current directory and under each of `extra_roots`.
///
/// Example: `read_csv(find_vega_datasets({LOOM_SOURCE_ROOT}) / "stocks.csv")`.
/// Throws: loom::DataError listing every folder tried when none holds us-employment.csv.
inline std::filesystem::path find_vega_datasets(const std::vector<std::filesystem::path>& extra_roots = {}) {
  std::vector<std::filesystem::path> tried;
  if (const char* env = std::getenv("LOOM_VEGA_DATASETS"); env != nullptr && *env != '\0') tried.emplace_back(env);
  tried.push_back(kDebianVegaDatasetsDir);
  tried.emplace_back("third_party_data/vega_datasets");
  for (const auto& root : extra_roots) tried.push_back(root / "third_party_data" / "vega_datasets");
  std::error_code ec;
  for (const auto& dir : tried)
    if (std::filesystem::is_regular_file(dir / "us-employment.csv", ec)) return dir;
  std::vector<std::string> names;
  for (const auto& d : tried) names.push_back(d.string());
  throw loom::DataError(fmt::format(
      "vega-datasets CSV files not found (us-employment.csv) in: {}; run scripts/setup.sh", fmt::join(names, ", ")));
}

}  // namespace examples::data
