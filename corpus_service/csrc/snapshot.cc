#include "snapshot.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>

namespace ngc {

namespace {
constexpr char kMagic[8] = {'N', 'G', 'C', 'O', 'R', 'P', 'U', 'S'};
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8 + 8;

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " '" + path + "': " + std::strerror(errno);
}

void write_all(int fd, const uint8_t* p, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IOFailure(errno_text("cannot write", path));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}
}  // namespace

uint64_t checksum64(const uint8_t* data, size_t n) {
  uint64_t h = 0x243F6A8885A308D3ull ^ (n * 0x9E3779B97F4A7C15ull);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, data + i, n - i);
  h = (h ^ tail) * 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 29;
  return h;
}

void write_snapshot_file(const std::string& path, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> header(kHeaderBytes);
  uint32_t version = kSnapshotVersion, reserved = 0;
  uint64_t size = payload.size(), sum = checksum64(payload.data(), payload.size());
  std::memcpy(header.data(), kMagic, 8);
  std::memcpy(header.data() + 8, &version, 4);
  std::memcpy(header.data() + 12, &reserved, 4);
  std::memcpy(header.data() + 16, &size, 8);
  std::memcpy(header.data() + 24, &sum, 8);

  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IOFailure(errno_text("cannot create", tmp));
  try {
    write_all(fd, header.data(), header.size(), tmp);
    write_all(fd, payload.data(), payload.size(), tmp);
    if (::fsync(fd) != 0) throw IOFailure(errno_text("cannot fsync", tmp));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw IOFailure(errno_text("cannot rename into", path));
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::vector<uint8_t> read_snapshot_file(const std::string& path, uint32_t* version_out) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw IOFailure(errno_text("cannot open snapshot", path));
  std::vector<uint8_t> header(kHeaderBytes);
  size_t got = std::fread(header.data(), 1, kHeaderBytes, f);
  if (got != kHeaderBytes || std::memcmp(header.data(), kMagic, 8) != 0) {
    std::fclose(f);
    throw CorruptSnapshot("not a corpus snapshot (bad or missing header): '" + path + "'");
  }
  uint32_t version;
  uint64_t size, sum;
  std::memcpy(&version, header.data() + 8, 4);
  std::memcpy(&size, header.data() + 16, 8);
  std::memcpy(&sum, header.data() + 24, 8);
  if (version < 1 || version > kSnapshotVersion) {
    std::fclose(f);
    throw CorruptSnapshot("unsupported snapshot version " + std::to_string(version) + " (expected 1 to " +
                             std::to_string(kSnapshotVersion) + "): '" + path + "'");
  }
  if (version_out) *version_out = version;
  std::error_code ec;
  auto file_size = std::filesystem::file_size(path, ec);
  if (ec || file_size != kHeaderBytes + size) {
    std::fclose(f);
    throw CorruptSnapshot("truncated or oversized snapshot: header says " + std::to_string(size) +
                             " payload bytes, file holds " + std::to_string(ec ? 0 : file_size - kHeaderBytes) +
                             ": '" + path + "'");
  }
  std::vector<uint8_t> payload(size);
  got = std::fread(payload.data(), 1, size, f);
  std::fclose(f);
  if (got != size) throw CorruptSnapshot("truncated snapshot: '" + path + "'");
  if (checksum64(payload.data(), payload.size()) != sum)
    throw CorruptSnapshot("corrupt snapshot (checksum mismatch): '" + path + "'");
  return payload;
}

}  // namespace ngc
