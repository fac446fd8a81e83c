// Snapshots written by a forked child, so that applying commits and drafting never wait for one.
//
// fork() gives the child a copy-on-write image of the parent's memory: the corpora are frozen (their
// pending commits flushed, every writer's lock held) for the fork itself, which copies page tables,
// not data; then the parent thaws them and goes on while the child serializes and writes every file
// and exits. Pages the parent changes meanwhile are copied once (the memory a snapshot costs, on top
// of the serialized payload the child builds).
#pragma once

#include <string>
#include <vector>

#include "corpus.h"

namespace ngc {

struct ForkedSnapshot {
  int pid = -1;        // the writer; exit status 0 = every file written
  int error_fd = -1;   // read end of a pipe: the writer's error message, if it failed
  double pause_s = 0;  // how long the corpora were frozen (freeze + fork + thaw)
};

// Writes corpora[i] to paths[i] (atomically, as Corpus::save) from a forked child. The caller
// waits for the pid (waitpid) and reads error_fd, then closes it.
ForkedSnapshot fork_snapshot(const std::vector<Corpus*>& corpora, const std::vector<std::string>& paths);

}  // namespace ngc
