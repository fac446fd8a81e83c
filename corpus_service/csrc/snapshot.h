// Snapshot files: a versioned header, a payload and a checksum over the payload.
//
//   magic "NGCORPUS" | u32 format version | u32 reserved | u64 payload bytes | u64 checksum | payload
//
// Versions: 1 holds the learned and external corpora; 2 adds the policy version and the prompt history
// (prompt_history.h); 3 adds the rank model (rank_model.h); 4 its source-pair table and 17 weights (a
// format 3 file's model loads with those empty). Files of every version up to kSnapshotVersion load; new
// files are written in it.
// A file with another magic, an unknown version, a short payload or a checksum mismatch is refused
// with CorruptSnapshot before anything is built from it, so a corrupt or truncated file can
// never be half-loaded. Files are written to a temporary name, fsync'd and renamed into place.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "errors.h"

namespace ngc {

constexpr uint32_t kSnapshotVersion = 4;

// 64-bit checksum over 8-byte words (multiply-xorshift mixing): detects corruption, not tampering.
uint64_t checksum64(const uint8_t* data, size_t n);

class ByteWriter {
 public:
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  template <class T>
  void put_range(const T* data, size_t n) {
    put<uint64_t>(n);
    const auto* p = reinterpret_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + n * sizeof(T));
  }
  template <class T>
  void put_vec(const std::vector<T>& v) { put_range(v.data(), v.size()); }
  void put_str(const std::string& s) { put_range(s.data(), s.size()); }
  const std::vector<uint8_t>& bytes() const { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t n) : p_(data), end_(data + n) {}
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> get_vec() {
    uint64_t n = get<uint64_t>();
    if (n > static_cast<uint64_t>(end_ - p_) / sizeof(T)) throw CorruptSnapshot("corrupt snapshot: array runs past the end");
    std::vector<T> v(n);
    std::memcpy(v.data(), p_, n * sizeof(T));
    p_ += n * sizeof(T);
    return v;
  }
  std::string get_str() {
    auto v = get_vec<char>();
    return std::string(v.begin(), v.end());
  }
  bool done() const { return p_ == end_; }

 private:
  void need(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) throw CorruptSnapshot("corrupt snapshot: truncated payload");
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

// Writes header + payload atomically (temporary file, fsync, rename, fsync of the directory).
void write_snapshot_file(const std::string& path, const std::vector<uint8_t>& payload);
// Reads and verifies a snapshot file; returns its payload (and its format version in *version).
std::vector<uint8_t> read_snapshot_file(const std::string& path, uint32_t* version = nullptr);

}  // namespace ngc
