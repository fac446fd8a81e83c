// Python bindings of the corpus engine. No logic here: conversion, GIL release, and wiring.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <bit>
#include <cstdint>

#include "corpus.h"
#include "errors.h"
#include "fork_snapshot.h"
#include "log_chunker.h"
#include "pyconvert.h"
#include "tree_merge.h"
#include "tree_rows.h"

namespace py = pybind11;
using namespace ngc;

namespace {
// Arrays of other dtypes or layouts are converted on the way in.
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;

template <class T>
py::array_t<T> to_array(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, heap->data(), owner);
}

// A draft's padded output as numpy: tokens, parents, probs [n, budget], counts [n].
py::tuple padded_trees(DraftOutput&& d, py::ssize_t n, int budget) {
  return py::make_tuple(to_array(std::move(d.tokens), {n, budget}), to_array(std::move(d.parents), {n, budget}),
                        to_array(std::move(d.probs), {n, budget}), to_array(std::move(d.counts), {n}));
}
// A merged draft's: padded_trees' arrays and each row's earlier_only mask (uint64 [n]).
py::tuple merged_trees(DraftOutput&& d, py::ssize_t n, int budget) {
  auto only = to_array(std::move(d.earlier_only), {n});
  return padded_trees(std::move(d), n, budget) + py::make_tuple(only);
}
// [n, width] padded trees (tree_rows.h), checked: one shape, counts within the width.
TreeRows tree_rows(const I32& tokens, const I32& parents, const F32& probs, const I32& counts, py::ssize_t n) {
  if (tokens.ndim() != 2 || tokens.shape(0) != n)
    throw py::value_error("trees: expected [n, width] arrays with one row per request");
  const auto w = tokens.shape(1);
  auto same = [&](const py::array& a) { return a.ndim() == 2 && a.shape(0) == n && a.shape(1) == w; };
  if (!same(parents) || !same(probs) || counts.ndim() != 1 || counts.shape(0) != n)
    throw py::value_error("trees: tokens, parents and probs must have one shape and counts one entry per row");
  for (py::ssize_t i = 0; i < n; ++i)
    if (counts.data()[i] < 0 || counts.data()[i] > w) throw py::value_error("counts: expected 0 <= count <= width");
  return TreeRows{tokens.data(), parents.data(), probs.data(), counts.data(), n, w};
}

// One sequence of token ids per row (`what` names the argument in errors), read through the C API:
// this runs every step (a remote step's `since`, a step's commits), where packing it with numpy in
// Python cost more than the native work. Flat ids and row offsets.
std::pair<std::vector<int32_t>, std::vector<int64_t>> read_rows(py::handle rows_obj, py::ssize_t n, const std::string& what) {
  std::vector<int32_t> since;
  std::vector<int64_t> off{0};
  const std::string seq_error = what + ": expected a sequence", row_error = what + ": expected sequences of token ids";
  py::object rows = py::reinterpret_steal<py::object>(PySequence_Fast(rows_obj.ptr(), seq_error.c_str()));
  if (!rows) throw py::error_already_set();
  if (PySequence_Fast_GET_SIZE(rows.ptr()) != n) throw py::value_error(what + ": expected one sequence of token ids per row");
  for (py::ssize_t i = 0; i < n; ++i) {
    py::object row = py::reinterpret_steal<py::object>(
        PySequence_Fast(PySequence_Fast_GET_ITEM(rows.ptr(), i), row_error.c_str()));
    if (!row) throw py::error_already_set();
    const py::ssize_t m = PySequence_Fast_GET_SIZE(row.ptr());
    PyObject** items = PySequence_Fast_ITEMS(row.ptr());
    for (py::ssize_t j = 0; j < m; ++j) {
      const long long v = PyLong_AsLongLong(items[j]);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (v < 0 || v > INT32_MAX) throw py::value_error(what + ": expected token ids in [0, 2^31)");
      since.push_back(static_cast<int32_t>(v));
    }
    off.push_back(static_cast<int64_t>(since.size()));
  }
  return {std::move(since), std::move(off)};
}
// corpus_service/engine/prompt_keys.py's default_prompt_key of validated ids: "ids:" and the BLAKE2b-128
// hex digest of the ids as little-endian int32 (hashlib's, so every language can compute the same key).
std::string default_prompt_key(const std::vector<int32_t>& ids) {
  static_assert(std::endian::native == std::endian::little, "prompt keys hash little-endian int32 ids");
  // Never destroyed: a static py::object would be released after the interpreter is gone.
  static auto* blake2b = new py::object(py::module_::import("hashlib").attr("blake2b"));
  py::bytes data(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t));
  return "ids:" + (*blake2b)(data, py::arg("digest_size") = 16).attr("hexdigest")().cast<std::string>();
}
// A sequence of token sequences (put, learn_documents).
std::vector<std::vector<int32_t>> to_token_rows(py::handle seqs, const std::string& what) {
  if (!py::isinstance<py::sequence>(seqs) || py::isinstance<py::str>(seqs))
    throw py::type_error(what + ": expected a sequence of token sequences");
  std::vector<std::vector<int32_t>> v;
  for (auto s : py::reinterpret_borrow<py::sequence>(seqs)) v.push_back(to_tokens(s, what.c_str()));
  return v;
}

py::list chunk_list(LogChunker::Chunks&& chunks) {
  py::list out;
  for (auto& c : chunks) {
    const auto n = static_cast<py::ssize_t>(c.size());
    out.append(to_array(std::move(c), {n}));
  }
  return out;
}
}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native n-gram/suffix draft corpus engine (use corpus_service.NgramCorpus)";

  py::enum_<DraftMode>(m, "DraftMode")
      .value("SCORE", DraftMode::kScore)
      .value("PROB", DraftMode::kProb)
      .value("BFS", DraftMode::kBfs);

  m.def(
      "merge_with_earlier",
      [](I32 f_tokens, I32 f_parents, F32 f_probs, I32 f_counts, I32 e_tokens, I32 e_parents, F32 e_probs,
         I32 e_counts, py::handle since_rows, int budget) {
        if (f_tokens.ndim() != 2) throw py::value_error("trees: expected [n, width] arrays");
        const auto n = f_tokens.shape(0);
        const TreeRows fresh = tree_rows(f_tokens, f_parents, f_probs, f_counts, n);
        const TreeRows earlier = tree_rows(e_tokens, e_parents, e_probs, e_counts, n);
        if (budget < 1) throw py::value_error("budget: expected >= 1");
        auto [since, off] = read_rows(since_rows, n, "since");
        std::vector<int32_t> tokens, parents, counts;
        std::vector<float> probs;
        std::vector<uint64_t> only;
        {
          py::gil_scoped_release nogil;
          merge_rows(fresh, earlier, since.data(), off.data(), budget, tokens, parents, probs, counts, only);
        }
        return py::make_tuple(to_array(std::move(tokens), {n, budget}), to_array(std::move(parents), {n, budget}),
                              to_array(std::move(probs), {n, budget}), to_array(std::move(counts), {n}),
                              to_array(std::move(only), {n}));
      },
      "Per row: the fresh tree united with the earlier tree re-rooted along `since` (tree_merge.h).");

  m.def(
      "marked_on_paths",
      [](I32 tokens, I32 parents, I32 counts, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> marked,
         py::array_t<int64_t, py::array::c_style | py::array::forcecast> rows, py::handle paths_obj) {
        if (tokens.ndim() != 2) throw py::value_error("trees: expected [n, width] arrays");
        const auto n = tokens.shape(0), w = tokens.shape(1);
        if (parents.ndim() != 2 || parents.shape(0) != n || parents.shape(1) != w || counts.ndim() != 1 ||
            counts.shape(0) != n || marked.ndim() != 1 || marked.shape(0) != n)
          throw py::value_error("marked_on_paths: expected tokens, parents [n, width], counts and marked [n]");
        if (rows.ndim() != 1) throw py::value_error("rows: expected a 1-d array");
        const auto m = rows.shape(0);
        auto [path, off] = read_rows(paths_obj, m, "paths");
        for (py::ssize_t j = 0; j < m; ++j) {
          const int64_t r = rows.data()[j];
          if (r < 0 || r >= n) throw py::value_error("rows: expected row indices in [0, n)");
        }
        for (py::ssize_t i = 0; i < n; ++i)
          if (counts.data()[i] < 0 || counts.data()[i] > w) throw py::value_error("counts: expected 0 <= count <= width");
        std::vector<int64_t> found(static_cast<size_t>(m));
        for (py::ssize_t j = 0; j < m; ++j) {
          const int64_t r = rows.data()[j];
          const TreeView t{tokens.data() + r * w, parents.data() + r * w, nullptr, counts.data()[r]};
          found[static_cast<size_t>(j)] =
              marked_on_path(t, marked.data()[r], path.data() + off[j], static_cast<int>(off[j + 1] - off[j]));
        }
        return to_array(std::move(found), {m});
      },
      "Per j: the nodes of tree rows[j] marked in marked[rows[j]] along paths[j] (tree_merge.h).");

  py::class_<ScoreParams>(m, "ScoreParams")
      .def(py::init<>())
      .def_readwrite("alpha", &ScoreParams::alpha)
      .def_readwrite("lambda_", &ScoreParams::lambda)
      .def_readwrite("match_cap", &ScoreParams::match_cap)
      .def_readwrite("depth_gain", &ScoreParams::depth_gain);

  py::class_<FeedbackParams>(m, "FeedbackParams")
      .def(py::init<>())
      .def_readwrite("enabled", &FeedbackParams::enabled)
      .def_readwrite("prior", &FeedbackParams::prior)
      .def_readwrite("token_prior", &FeedbackParams::token_prior)
      .def_readwrite("window", &FeedbackParams::window);

  m.attr("RANK_DELTA_WORDS") = py::int_(RankModel::kDeltaWords);
  m.attr("RANK_DELTA_WORDS_V1") = py::int_(RankModel::kDeltaWordsV1);
  py::class_<RankParams>(m, "RankParams")
      .def(py::init<>())
      .def_readwrite("enabled", &RankParams::enabled)
      .def_readwrite("prior", &RankParams::prior)
      .def_readwrite("token_prior", &RankParams::token_prior)
      .def_readwrite("pair_prior", &RankParams::pair_prior)
      .def_readwrite("learning_rate", &RankParams::learning_rate)
      .def_readwrite("request_decay", &RankParams::request_decay)
      .def_readwrite("window", &RankParams::window)
      .def_readwrite("learn", &RankParams::learn)
      .def_readwrite("left_out", &RankParams::left_out)
      .def_readwrite("pair_rate", &RankParams::pair_rate)
      .def_readwrite("tree_lambda", &RankParams::tree_lambda)
      .def_readwrite("max_depth", &RankParams::max_depth);

  py::class_<HistoryConfig>(m, "HistoryConfig")
      .def(py::init<>())
      .def_readwrite("max_rollouts", &HistoryConfig::max_rollouts)
      .def_readwrite("max_key_tokens", &HistoryConfig::max_key_tokens)
      .def_readwrite("max_charged_tokens", &HistoryConfig::max_charged_tokens)
      .def_readwrite("max_age", &HistoryConfig::max_age)
      .def_readwrite("context", &HistoryConfig::context);

  py::class_<CorpusConfig>(m, "CorpusConfig")
      .def(py::init<>())
      .def_readwrite("own_orders", &CorpusConfig::own_orders)
      .def_readwrite("learned_orders", &CorpusConfig::learned_orders)
      .def_readwrite("external_orders", &CorpusConfig::external_orders)
      .def_readwrite("max_candidates", &CorpusConfig::max_candidates)
      .def_readwrite("max_chain", &CorpusConfig::max_chain)
      .def_readwrite("max_match", &CorpusConfig::max_match)
      .def_readwrite("max_depth", &CorpusConfig::max_depth)
      .def_readwrite("enough_candidates", &CorpusConfig::enough_candidates)
      .def_readwrite("enough_order", &CorpusConfig::enough_order)
      .def_readwrite("draft_threads", &CorpusConfig::draft_threads)
      .def_readwrite("learned_copy_growth", &CorpusConfig::learned_copy_growth)
      .def_readwrite("mode", &CorpusConfig::mode)
      .def_readwrite("score", &CorpusConfig::score)
      .def_readwrite("shared_alpha", &CorpusConfig::shared_alpha)
      .def_readwrite("feedback", &CorpusConfig::feedback)
      .def_readwrite("rank", &CorpusConfig::rank)
      .def_readwrite("min_prob", &CorpusConfig::min_prob)
      .def_readwrite("weak_weight", &CorpusConfig::weak_weight)
      .def_readwrite("weak_depth", &CorpusConfig::weak_depth)
      .def_readwrite("own_weight", &CorpusConfig::own_weight)
      .def_readwrite("learned_weight", &CorpusConfig::learned_weight)
      .def_readwrite("external_weight", &CorpusConfig::external_weight)
      .def_readwrite("group_weight", &CorpusConfig::group_weight)
      .def_readwrite("learn_prompts", &CorpusConfig::learn_prompts)
      .def_readwrite("learned_max_tokens", &CorpusConfig::learned_max_tokens)
      .def_readwrite("flush_tokens", &CorpusConfig::flush_tokens)
      .def_readwrite("overlap", &CorpusConfig::overlap)
      .def_readwrite("vocab_size", &CorpusConfig::vocab_size)
      .def_readwrite("request_ttl_s", &CorpusConfig::request_ttl_s)
      .def_readwrite("max_requests", &CorpusConfig::max_requests)
      .def_readwrite("max_request_tokens", &CorpusConfig::max_request_tokens)
      .def_readwrite("max_external_tokens", &CorpusConfig::max_external_tokens)
      .def_readwrite("history", &CorpusConfig::history)
      .def_readwrite("history_weight", &CorpusConfig::history_weight)
      .def_readwrite("learn_source_weights", &CorpusConfig::learn_source_weights)
      .def_readwrite("source_window", &CorpusConfig::source_window);

  py::class_<LogChunker>(m, "LogChunker")
      .def(py::init<size_t, bool>(), py::arg("flush_tokens"), py::arg("learn_prompts"))
      .def("start",
           [](LogChunker& c, const std::string& rid, py::handle prompt, int learn) {
             auto t = to_tokens(prompt, "prompt");
             LogChunker::Chunks out;
             c.start(rid, t.data(), t.size(), learn, &out);
             return chunk_list(std::move(out));
           },
           py::arg("rid"), py::arg("prompt"), py::arg("learn") = -1)
      .def("extend_packed",
           [](LogChunker& c, const std::vector<std::string>& rids, py::handle lengths, py::handle tokens) {
             auto lens = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(lengths);
             if (!lens || lens.ndim() != 1 || static_cast<size_t>(lens.shape(0)) != rids.size())
               throw py::value_error("lengths: expected one int per request id");
             auto toks = to_tokens(tokens, "tokens");
             const int64_t* l = lens.data();
             size_t total = 0;
             for (size_t i = 0; i < rids.size(); ++i) {
               if (l[i] < 0) throw py::value_error("lengths: expected ints >= 0");
               total += static_cast<size_t>(l[i]);
             }
             if (total != toks.size())
               throw py::value_error("tokens: expected sum(lengths) = " + std::to_string(total) + " tokens, got " +
                                     std::to_string(toks.size()));
             LogChunker::Chunks out;
             c.extend_packed(rids, l, toks.data(), &out);
             return chunk_list(std::move(out));
           })
      .def("finish",
           [](LogChunker& c, const std::string& rid) {
             LogChunker::Chunks out;
             c.finish(rid, &out);
             return chunk_list(std::move(out));
           })
      .def("live", &LogChunker::live);

  py::class_<Corpus>(m, "Corpus")
      .def(py::init<CorpusConfig>())
      .def("start_request",
           [](Corpus& c, const std::string& id, py::handle prompt, int learn_prompt, const std::string& group,
              bool learn, const std::string& prompt_key, int64_t policy_version, bool key_group) {
             auto t = to_tokens(prompt, "prompt_ids");
             StartOptions opt{learn_prompt, group, learn, prompt_key, policy_version, key_group};
             if (opt.prompt_key.empty() && c.config().history.max_charged_tokens > 0)
               opt.prompt_key = default_prompt_key(t);
             py::gil_scoped_release nogil;
             c.start_request(id, t.data(), t.size(), opt);
           },
           py::arg("req_id"), py::arg("prompt_ids"), py::arg("learn_prompt") = -1, py::arg("group") = "",
           py::arg("learn") = true, py::arg("prompt_key") = "", py::arg("policy_version") = -1,
           py::arg("key_group") = false)
      .def("set_prompt_key", &Corpus::set_prompt_key, py::arg("req_id"), py::arg("prompt_key"),
           py::arg("policy_version"), py::arg("keep_rollout"))
      .def("rollout",
           [](Corpus& c, const std::string& id) -> py::object {
             Rollout r;
             bool ok;
             {
               py::gil_scoped_release nogil;
               ok = c.rollout(id, &r);
             }
             if (!ok) return py::none();
             const auto n = static_cast<py::ssize_t>(r.tokens.size());
             return py::make_tuple(r.key, r.version, to_array(std::move(r.tokens), {n}), r.output);
           })
      .def("announce_policy_version", &Corpus::announce_policy_version, py::arg("version"), py::arg("strict"))
      .def("policy_version", &Corpus::policy_version)
      .def("add_rollout",
           [](Corpus& c, const std::string& key, int64_t version, py::handle tokens, size_t output) {
             auto t = to_tokens(tokens, "rollout tokens");
             py::gil_scoped_release nogil;
             return c.add_rollout(key, version, t.data(), t.size(), output);
           })
      .def("history_lengths", &Corpus::history_lengths)
      .def("history_dump",
           [](Corpus& c) {
             py::list out;
             for (auto& v : c.history_dump()) {
               const auto n = static_cast<py::ssize_t>(v.tokens.size());
               out.append(py::make_tuple(v.key, v.version, v.output, to_array(std::move(v.tokens), {n})));
             }
             return out;
           })
      .def("extend_many",
           [](Corpus& c, py::handle ids_obj, py::array_t<int32_t, py::array::c_style> tokens,
              py::array_t<int64_t, py::array::c_style> lengths) {
             auto ids = to_ids(ids_obj, "req_ids");
             if (tokens.ndim() != 1 || lengths.ndim() != 1 || static_cast<size_t>(lengths.shape(0)) != ids.size())
               throw std::invalid_argument("extend_many: expected 1-D tokens and one length per request id");
             int64_t total = 0;
             for (py::ssize_t i = 0; i < lengths.shape(0); ++i) total += lengths.data()[i];
             if (total != tokens.shape(0))
               throw std::invalid_argument("extend_many: lengths add up to " + std::to_string(total) + " but " +
                                           std::to_string(tokens.shape(0)) + " tokens were given");
             py::gil_scoped_release nogil;
             c.extend_many(ids, tokens.data(), lengths.data());
           })
      .def("extend_runs",
           [](Corpus& c, py::handle ids_obj, py::handle runs_obj) {
             // extend_many from one sequence of token ids per request, read through the C API (the
             // verifier's per-step commits are lists: two numpy conversions cost more than the extend).
             auto ids = to_ids(ids_obj, "req_ids");
             const auto n = static_cast<py::ssize_t>(ids.size());
             auto [tokens, off] = read_rows(runs_obj, n, "extend_runs");
             std::vector<int64_t> lengths(static_cast<size_t>(n));
             for (py::ssize_t i = 0; i < n; ++i) lengths[static_cast<size_t>(i)] = off[i + 1] - off[i];
             py::gil_scoped_release nogil;
             c.extend_many(ids, tokens.data(), lengths.data());
           })
      .def("extend",
           [](Corpus& c, const std::string& id, py::handle tokens) {
             auto t = to_tokens(tokens, "token_ids");
             py::gil_scoped_release nogil;
             c.extend(id, t.data(), t.size());
           })
      .def("finish", &Corpus::finish, py::arg("req_id"), py::arg("rollout") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("erase", &Corpus::erase, py::call_guard<py::gil_scoped_release>())
      .def("has_request", &Corpus::has_request)
      .def("draft",
           [](Corpus& c, py::handle ids_obj, int budget) {
             auto ids = to_ids(ids_obj, "req_ids");
             DraftOutput d;
             {
               py::gil_scoped_release nogil;
               c.draft(ids, budget, &d);
             }
             return padded_trees(std::move(d), static_cast<py::ssize_t>(ids.size()), budget);
           })
      .def("draft_merged",
           [](Corpus& c, py::handle ids_obj, int budget, I32 e_tokens, I32 e_parents, F32 e_probs, I32 e_counts,
              py::handle since_rows) {
             // draft() and merge_with_earlier() in one call, each row merged as it is drafted (on the
             // draft pool's threads): a pipelined remote step's drafting (the fresh trees never cross into Python).
             auto ids = to_ids(ids_obj, "req_ids");
             const auto n = static_cast<py::ssize_t>(ids.size());
             const TreeRows earlier = tree_rows(e_tokens, e_parents, e_probs, e_counts, n);
             auto [since, off] = read_rows(since_rows, n, "since");
             DraftOutput d;
             {
               py::gil_scoped_release nogil;
               c.draft_merged(ids, budget, EarlierTrees{earlier, since.data(), off.data()}, &d);
             }
             return merged_trees(std::move(d), n, budget);
           })
      .def("draft_merged_from",
           [](Corpus& c, py::handle ids_obj, int budget, I32 e_tokens, I32 e_parents, F32 e_probs, I32 e_counts,
              py::array_t<int64_t, py::array::c_style | py::array::forcecast> since_from) {
             // draft_merged with each request's re-rooting path read from its own context (the
             // tokens after since_from[i]): the verifier keeps no per-request path in Python.
             auto ids = to_ids(ids_obj, "req_ids");
             const auto n = static_cast<py::ssize_t>(ids.size());
             const TreeRows earlier = tree_rows(e_tokens, e_parents, e_probs, e_counts, n);
             if (since_from.ndim() != 1 || since_from.shape(0) != n)
               throw py::value_error("since_from: expected one context length per request");
             DraftOutput d;
             {
               py::gil_scoped_release nogil;
               c.draft_merged(ids, budget, EarlierTrees{earlier, nullptr, nullptr, since_from.data()}, &d);
             }
             return merged_trees(std::move(d), n, budget);
           })
      .def("context_lengths",
           [](Corpus& c, py::handle ids_obj) {
             auto ids = to_ids(ids_obj, "req_ids");
             std::vector<int64_t> out(ids.size());
             {
               py::gil_scoped_release nogil;
               c.context_lengths(ids, out.data());
             }
             return to_array(std::move(out), {static_cast<py::ssize_t>(ids.size())});
           })
      .def("context_tail",
           [](Corpus& c, const std::string& id, int64_t n) {
             auto out = c.context_tail(id, n);
             const auto size = static_cast<py::ssize_t>(out.size());
             return to_array(std::move(out), {size});
           })
      .def("draft_compact",
           [](Corpus& c, py::handle ids_obj, int budget) {
             auto ids = to_ids(ids_obj, "req_ids");
             DraftOutput d;
             {
               py::gil_scoped_release nogil;
               c.draft_compact(ids, budget, &d);
             }
             auto n = static_cast<py::ssize_t>(ids.size());
             auto total = static_cast<py::ssize_t>(d.tokens.size());
             return py::make_tuple(to_array(std::move(d.counts), {n}), to_array(std::move(d.tokens), {total}),
                                   to_array(std::move(d.parents), {total}), to_array(std::move(d.probs), {total}));
           })
      .def("draft_flat",
           [](Corpus& c, py::handle ids_obj, int k) {
             auto ids = to_ids(ids_obj, "req_ids");
             std::vector<int64_t> tokens, mask;
             {
               py::gil_scoped_release nogil;
               c.draft_flat(ids, k, &tokens, &mask);
             }
             auto n = static_cast<py::ssize_t>(ids.size());
             return py::make_tuple(to_array(std::move(tokens), {n * k}), to_array(std::move(mask), {n * k * k}));
           })
      .def("sync_window",
           [](Corpus& c, const std::string& id, py::handle window, uint64_t total_len) {
             auto t = to_tokens(window, "batch_tokens");
             py::gil_scoped_release nogil;
             c.sync_window(id, t.data(), t.size(), total_len);
           })
      .def("put",
           [](Corpus& c, py::handle seqs) {
             auto v = to_token_rows(seqs, "batch_tokens");
             py::gil_scoped_release nogil;
             c.put(std::move(v));
           })
      .def("learn_documents",
           [](Corpus& c, py::handle docs) {
             auto v = to_token_rows(docs, "documents");
             py::gil_scoped_release nogil;
             c.learn_documents(std::move(v));
           })
      .def("synchronize", &Corpus::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("reset", &Corpus::reset, py::call_guard<py::gil_scoped_release>())
      .def("begin_external", &Corpus::begin_external, py::arg("name"), py::arg("replace") = false)
      .def("add_external",
           [](Corpus& c, const std::string& name, py::handle tokens) {
             auto t = to_tokens(tokens, "corpus chunk");
             py::gil_scoped_release nogil;
             c.add_external(name, t.data(), t.size());
           })
      .def("commit_external", &Corpus::commit_external)
      .def("abort_external", &Corpus::abort_external)
      .def("remove_external", &Corpus::remove_external)
      .def("list_externals", &Corpus::list_externals)
      .def("is_loading", &Corpus::is_loading)
      .def("save", &Corpus::save, py::call_guard<py::gil_scoped_release>())
      .def("load", &Corpus::load, py::call_guard<py::gil_scoped_release>())
      .def("stats", &Corpus::stats, py::call_guard<py::gil_scoped_release>())
      .def("rank_weights", &Corpus::rank_weights)
      .def("export_rank_delta",
           [](Corpus& c) {
             std::vector<int32_t> d;
             {
               py::gil_scoped_release nogil;
               d = c.export_rank_delta();
             }
             const auto n = static_cast<py::ssize_t>(d.size());
             return to_array(std::move(d), {n});
           })
      .def("apply_rank_delta",
           [](Corpus& c, py::array_t<int32_t, py::array::c_style | py::array::forcecast> words, size_t node_words) {
             if (words.ndim() != 1) throw std::invalid_argument("apply_rank_delta: expected a 1-D int32 array");
             py::gil_scoped_release nogil;
             c.apply_rank_delta(words.data(), static_cast<size_t>(words.shape(0)), node_words);
           },
           py::arg("words"), py::arg("node_words") = RankModel::kDeltaWords)
      .def("check_integrity", &Corpus::check_integrity, py::call_guard<py::gil_scoped_release>())
      .def("learned_tokens", [](Corpus& c) {
        std::vector<int32_t> t;
        {
          py::gil_scoped_release nogil;
          t = c.learned_tokens();
        }
        auto n = static_cast<py::ssize_t>(t.size());
        return to_array(std::move(t), {n});
      });

  m.def(
      "fork_snapshot",
      [](std::vector<Corpus*> corpora, std::vector<std::string> paths) {
        ForkedSnapshot s;
        {
          py::gil_scoped_release nogil;
          s = fork_snapshot(corpora, paths);
        }
        return py::make_tuple(s.pid, s.error_fd, s.pause_s);
      },
      py::arg("corpora"), py::arg("paths"));

  // Engine errors become the Python classes of corpus_service.exceptions (ValueError subclasses);
  // other std::invalid_argument / std::length_error become ValueError, IOFailure OSError, and a
  // violated invariant (std::logic_error from check_integrity) AssertionError.
  py::register_exception_translator([](std::exception_ptr p) {
    auto raise = [](const char* cls, const char* what) {
      py::object type = py::module_::import("corpus_service.exceptions").attr(cls);
      PyErr_SetString(type.ptr(), what);
    };
    try {
      if (p) std::rethrow_exception(p);
    } catch (const UnknownRequest& e) {
      raise("UnknownRequestError", e.what());
    } catch (const AlreadyExists& e) {
      raise("AlreadyExistsError", e.what());
    } catch (const NotFound& e) {
      raise("NotFoundError", e.what());
    } catch (const LimitExceeded& e) {
      raise("LimitExceededError", e.what());
    } catch (const StaleVersion& e) {
      raise("StalePolicyVersionError", e.what());
    } catch (const CorruptSnapshot& e) {
      raise("CorruptSnapshotError", e.what());
    } catch (const IOFailure& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    } catch (const std::length_error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::logic_error& e) {
      PyErr_SetString(PyExc_AssertionError, e.what());
    }
  });
}
