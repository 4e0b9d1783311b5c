// loom/train/detail/checkpoint_file.hpp — the file side of loom::save_checkpoint / load_checkpoint:
// the atomic write with its checksum trailer, rank 0's bytes broadcast to every rank, the trailer
// checked, the archive's keys read with errors that name the file, and the parameters written and
// read by position with their names checked.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unistd.h>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/detail/hash.hpp>
#include <loom/error.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/trace/recorder.hpp>

namespace loom::detail {

/// The checksum trailer that ends a checkpoint file: "\nloom-checksum fnv1a64 " + 16 hex digits of
/// FNV-1a 64 over every byte before the trailer + "\n" (40 bytes).
inline constexpr std::string_view kChecksumTag = "\nloom-checksum fnv1a64 ";
inline constexpr std::size_t kTrailerSize = 40;

inline std::string checksum_trailer(uint64_t checksum) {
  return fmt::format("{}{:016x}\n", kChecksumTag, checksum);
}

/// Creates `file`'s folder and its missing parents.
/// Throws: loom::DataError naming the folder and the system's reason.
inline void create_folder_of(const std::filesystem::path& file) {
  const std::filesystem::path folder = file.parent_path();
  if (folder.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  if (ec) throw DataError(fmt::format("cannot create the folder {}: {}", folder.string(), ec.message()));
}

/// Creates the folder (create_folder_of), writes `archive` and its checksum trailer to
/// `<file>.loom-tmp`, fsyncs it, renames it over `file`, fsyncs the folder. A failed write (a full
/// disk, a file size limit) removes the temporary file and leaves `file` as it was. LibTorch's
/// writer is never told of a failed write (its failure paths abort the process): once a write
/// fails, the rest of the archive is skipped, and the error is thrown when the writer returns.
/// Throws: loom::DataError naming the path and the system's reason.
inline void write_atomically(const std::filesystem::path& file, torch::serialize::OutputArchive& archive) {
  create_folder_of(file);
  const std::filesystem::path tmp = file.string() + ".loom-tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw DataError(fmt::format("cannot create {}: {}", tmp.string(), std::strerror(errno)));
  int error = 0;
  Fnv1a checksum;
  auto put = [&](const char* p, std::size_t left) {
    while (left > 0 && error == 0) {
      const ssize_t n = ::write(fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0)
        error = errno;
      else if (n == 0)
        error = EIO;
      else {
        p += n;
        left -= static_cast<std::size_t>(n);
      }
    }
  };
  auto discard = [&] {
    ::close(fd);
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
  };
  try {
    archive.save_to([&](const void* data, std::size_t size) -> std::size_t {
      const char* p = static_cast<const char*>(data);
      checksum.add(std::string_view(p, size));
      put(p, size);
      return size;  // also after a failed write: see the function comment
    });
  } catch (const std::exception& e) {  // LibTorch's own error (e.g. out of memory)
    discard();
    throw DataError(fmt::format("cannot write {}: {}", tmp.string(),
                                error != 0 ? std::string(std::strerror(error)) : first_line(e.what())));
  }
  const std::string trailer = checksum_trailer(checksum.value());
  put(trailer.data(), trailer.size());
  if (error == 0 && ::fsync(fd) != 0) error = errno;
  if (error != 0) {
    discard();
    throw DataError(fmt::format("cannot write {}: {}", tmp.string(), std::strerror(error)));
  }
  if (::close(fd) != 0) {
    error = errno;
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw DataError(fmt::format("cannot write {}: {}", tmp.string(), std::strerror(error)));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) throw DataError(fmt::format("cannot rename {} to {}: {}", tmp.string(), file.string(), ec.message()));
  const std::filesystem::path folder = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
}

/// The grid exponents of a checkpoint's "grid_exponents" text ("32,31,22").
/// Throws: loom::DataError naming the file when the text is not a comma-separated list of integers.
inline std::vector<int> parse_grid_exponents(const std::filesystem::path& file, const std::string& text) {
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t end = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, end - pos);
    std::size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size())
      throw DataError(fmt::format("checkpoint {}: grid_exponents '{}' is not a comma-separated list of integers",
                                  file.string(), text));
    out.push_back(v);
    pos = end + 1;
  }
  return out;
}

/// Every rank learns rank 0's save failure (empty: none). Throws loom::Error on every rank when it failed.
template <Communicator C>
void agree_on_save(C& comm, const std::filesystem::path& file, const std::string& failure) {
  trace::Scope scope(comm, trace::Context::checkpoint);
  const std::vector<std::string> all = all_gather_strings(comm, failure);
  if (!all.front().empty())
    throw Error(fmt::format("save_checkpoint: rank 0 could not save {}: {}", file.string(), all.front()));
}

/// Rank 0 reads `file`; every rank gets its bytes (broadcast_string: two broadcasts).
/// Throws: loom::DataError on every rank when rank 0 cannot read it (naming the file and why).
template <Communicator C>
std::string broadcast_file(C& comm, const std::filesystem::path& file) {
  std::string bytes, failure;
  if (comm.rank() == 0) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      failure =
          std::filesystem::exists(file) ? fmt::format("cannot open it: {}", std::strerror(errno)) : "no such file";
    } else {
      bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      if (in.bad()) failure = "a read error";
    }
  }
  trace::Scope scope(comm, trace::Context::checkpoint);
  // One leading byte says whether rank 0 sends the file ('1') or why it could not read it ('0').
  const std::string received = broadcast_string(comm, failure.empty() ? "1" + bytes : "0" + failure);
  const bool failed = received.empty() || received.front() != '1';
  if (failed) throw DataError(fmt::format("load_checkpoint: {}: {}", file.string(), received.substr(1)));
  return received.substr(1);
}

/// Opens the bytes as a LibTorch archive with every tensor mapped to `device`. A file that ends in
/// a checksum trailer (checksum_trailer) must match it; the archive is the bytes before it. A file
/// without one is opened to name what it is (format v1 files carry none).
/// Throws: loom::DataError naming the file: empty; the checksum differs from the trailer's; truncated
///         or not an archive; not a loom checkpoint; another format version (v1 included: refused);
///         a file of this format without its trailer.
inline torch::serialize::InputArchive open_checkpoint(const std::filesystem::path& file, const std::string& bytes,
                                                      const at::Device& device, const char* format) {
  if (bytes.empty()) throw DataError(fmt::format("load_checkpoint: {} is empty", file.string()));
  std::size_t size = bytes.size();
  const bool trailed =
      size >= kTrailerSize && std::string_view(bytes).substr(size - kTrailerSize, kChecksumTag.size()) == kChecksumTag;
  if (trailed) {
    size -= kTrailerSize;
    Fnv1a checksum;
    checksum.add(std::string_view(bytes.data(), size));
    const std::string expected = checksum_trailer(checksum.value());
    if (bytes.compare(size, kTrailerSize, expected) != 0)
      throw DataError(fmt::format(
          "load_checkpoint: {}: the checksum of its {} bytes is {} but its trailer says {}: the file changed after "
          "save_checkpoint wrote it (damaged storage or copy); resume from another checkpoint",
          file.string(), size, expected.substr(kChecksumTag.size(), 16), bytes.substr(size + kChecksumTag.size(), 16)));
  }
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(bytes.data(), size, device);
  } catch (const std::exception& e) {
    throw DataError(
        fmt::format("load_checkpoint: {} ({} bytes) is truncated or not a LibTorch archive (a zip file written by "
                    "save_checkpoint): {}",
                    file.string(), bytes.size(), first_line(e.what())));
  }
  c10::IValue version;
  if (!archive.try_read("loom_checkpoint", version) || !version.isString())
    throw DataError(fmt::format(
        "load_checkpoint: {} is a LibTorch archive but not a loom checkpoint (it has no loom_checkpoint key)",
        file.string()));
  if (version.toStringRef() != format)
    throw DataError(
        fmt::format("load_checkpoint: {} has format '{}'; this loom reads '{}' only (resume it with the "
                    "loom that wrote it, or start afresh)",
                    file.string(), version.toStringRef(), format));
  if (!trailed)
    throw DataError(
        fmt::format("load_checkpoint: {} lacks the checksum trailer that save_checkpoint writes (the "
                    "file was cut or changed at its end)",
                    file.string()));
  return archive;
}

/// Reads keys of an open checkpoint; a missing or mistyped key is a loom::DataError naming the file and key.
class CheckpointReader {
 public:
  CheckpointReader(std::filesystem::path file, torch::serialize::InputArchive& archive)
      : file_(std::move(file)), archive_(&archive) {}

  [[nodiscard]] std::optional<std::string> optional_text(const std::string& key) {
    c10::IValue v;
    if (!archive_->try_read(key, v)) return std::nullopt;
    if (!v.isString()) throw bad(key, "is not a string");
    return v.toStringRef();
  }
  [[nodiscard]] std::string text(const std::string& key) {
    auto v = optional_text(key);
    if (!v) throw bad(key, "is missing");
    return *v;
  }
  [[nodiscard]] int64_t integer(const std::string& key) {
    c10::IValue v;
    if (!archive_->try_read(key, v)) throw bad(key, "is missing");
    if (!v.isInt()) throw bad(key, "is not an integer");
    return v.toInt();
  }
  [[nodiscard]] at::Tensor tensor(const std::string& key) {
    at::Tensor t;
    if (!archive_->try_read(key, t)) throw bad(key, "is missing");
    return t;
  }
  void archive(const std::string& key, torch::serialize::InputArchive& out) {
    if (!archive_->try_read(key, out)) throw bad(key, "is missing");
  }
  /// The user's values (user_count, user_key_<i>, user_value_<i>).
  [[nodiscard]] std::map<std::string, std::string> user_values() {
    std::map<std::string, std::string> out;
    const int64_t n = integer("user_count");
    for (int64_t i = 0; i < n; ++i) out[text(fmt::format("user_key_{}", i))] = text(fmt::format("user_value_{}", i));
    return out;
  }
  [[nodiscard]] const std::filesystem::path& file() const noexcept { return file_; }

 private:
  [[nodiscard]] DataError bad(const std::string& key, const char* what) const {
    return DataError(fmt::format("load_checkpoint: {}: key '{}' {}", file_.string(), key, what));
  }

  std::filesystem::path file_;
  torch::serialize::InputArchive* archive_;
};

/// The user's values, in key order.
inline void write_user_values(torch::serialize::OutputArchive& archive,
                              const std::map<std::string, std::string>& user) {
  archive.write("user_count", c10::IValue(static_cast<int64_t>(user.size())));
  int64_t i = 0;
  for (const auto& [key, value] : user) {
    archive.write(fmt::format("user_key_{}", i), c10::IValue(key));
    archive.write(fmt::format("user_value_{}", i++), c10::IValue(value));
  }
}

/// Parameters and buffers by position (param_<i>, buffer_<i>, CPU copies), with the parameters' names.
inline void write_parameters(torch::serialize::OutputArchive& archive, const ParameterList& list) {
  archive.write("param_count", c10::IValue(static_cast<int64_t>(list.params.size())));
  archive.write("buffer_count", c10::IValue(static_cast<int64_t>(list.buffers.size())));
  for (std::size_t i = 0; i < list.params.size(); ++i) {
    archive.write(fmt::format("param_{}", i), list.params[i].detach().to(at::kCPU));
    archive.write(fmt::format("param_name_{}", i), c10::IValue(i < list.names.size() ? list.names[i] : std::string()));
  }
  for (std::size_t i = 0; i < list.buffers.size(); ++i)
    archive.write(fmt::format("buffer_{}", i), list.buffers[i].detach().to(at::kCPU), /*is_buffer=*/true);
}

/// The checkpoint's parameters and buffers, checked against `list` (count, name, shape, dtype);
/// copy_into() writes them in place.
class StagedParameters {
 public:
  StagedParameters(CheckpointReader& read, const ParameterList& list) {
    const int64_t params = read.integer("param_count"), buffers = read.integer("buffer_count");
    if (params != static_cast<int64_t>(list.params.size()) || buffers != static_cast<int64_t>(list.buffers.size()))
      throw InvalidArgument(
          fmt::format("load_checkpoint: {} holds {} parameters and {} buffers, but the Trainer's model has {} and {}",
                      read.file().string(), params, buffers, list.params.size(), list.buffers.size()));
    for (std::size_t i = 0; i < list.params.size(); ++i) {
      const std::string name = read.text(fmt::format("param_name_{}", i));
      const std::string mine = i < list.names.size() ? list.names[i] : std::string();
      if (name != mine)
        throw InvalidArgument(fmt::format("load_checkpoint: {}: parameter {} is '{}' there but '{}' in this model",
                                          read.file().string(), i, name, mine));
      params_.push_back(checked(read, fmt::format("param_{}", i), list.params[i], list.describe(i)));
    }
    for (std::size_t i = 0; i < list.buffers.size(); ++i)
      buffers_.push_back(checked(read, fmt::format("buffer_{}", i), list.buffers[i], fmt::format("buffer {}", i)));
  }

  void copy_into(const ParameterList& list) const {
    const at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) list.params[i].detach().copy_(params_[i]);
    for (std::size_t i = 0; i < buffers_.size(); ++i) list.buffers[i].detach().copy_(buffers_[i]);
  }

 private:
  static at::Tensor checked(CheckpointReader& read, const std::string& key, const at::Tensor& mine,
                            const std::string& what) {
    at::Tensor t = read.tensor(key);
    if (t.sizes() != mine.sizes() || t.scalar_type() != mine.scalar_type())
      throw InvalidArgument(fmt::format("load_checkpoint: {}: {} is {} [{}] there but {} [{}] in this model",
                                        read.file().string(), what, c10::toString(t.scalar_type()),
                                        fmt::join(t.sizes(), ", "), c10::toString(mine.scalar_type()),
                                        fmt::join(mine.sizes(), ", ")));
    return t;
  }

  std::vector<at::Tensor> params_, buffers_;
};

}  // namespace loom::detail
