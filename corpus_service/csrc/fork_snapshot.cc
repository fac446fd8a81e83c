#include "fork_snapshot.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "errors.h"

namespace ngc {

namespace {
[[noreturn]] void child(const std::vector<Corpus*>& corpora, const std::vector<std::string>& paths, int err_fd,
                        pid_t parent) {
  // The parent's signal handlers write to its event loop's wakeup socket, which the child shares:
  // a Ctrl-C to the process group must not look like a second signal to the parent.
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the server (it holds the server's sockets)
  if (::getppid() != parent) ::_exit(3);
  int code = 0;
  try {
    for (size_t i = 0; i < corpora.size(); ++i) corpora[i]->save_frozen(paths[i]);
  } catch (const std::exception& e) {
    ssize_t ignored = ::write(err_fd, e.what(), std::strlen(e.what()));
    (void)ignored;
    code = 1;
  } catch (...) {
    code = 2;
  }
  ::_exit(code);  // no destructors, no atexit handlers: they belong to the parent
}
}  // namespace

ForkedSnapshot fork_snapshot(const std::vector<Corpus*>& corpora, const std::vector<std::string>& paths) {
  if (corpora.size() != paths.size())
    throw std::invalid_argument("fork_snapshot: expected one path per corpus, got " + std::to_string(paths.size()) +
                                " paths for " + std::to_string(corpora.size()) + " corpora");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw IOFailure(std::string("fork_snapshot: pipe: ") + std::strerror(errno));
  const pid_t parent = ::getpid();
  const auto t0 = std::chrono::steady_clock::now();
  size_t frozen = 0;
  try {
    for (Corpus* c : corpora) {
      c->freeze();
      ++frozen;
    }
  } catch (...) {
    while (frozen) corpora[--frozen]->thaw();
    ::close(fds[0]);
    ::close(fds[1]);
    throw;
  }
  const pid_t pid = ::fork();
  const int fork_errno = errno;
  if (pid == 0) child(corpora, paths, fds[1], parent);
  while (frozen) corpora[--frozen]->thaw();
  ForkedSnapshot out;
  out.pause_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    throw IOFailure(std::string("fork_snapshot: fork: ") + std::strerror(fork_errno));
  }
  out.pid = pid;
  out.error_fd = fds[0];
  return out;
}

}  // namespace ngc
