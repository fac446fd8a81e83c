// Python bindings of the corpus engine. No logic here: conversion, GIL release, and wiring.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "corpus.h"
#include "errors.h"
#include "pyconvert.h"
#include "tree_merge.h"

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
        if (f_tokens.ndim() != 2 || e_tokens.ndim() != 2) throw py::value_error("trees: expected [n, width] arrays");
        const auto n = f_tokens.shape(0);
        const auto wf = f_tokens.shape(1), we = e_tokens.shape(1);
        auto same = [](const py::array& a, py::ssize_t r, py::ssize_t c) {
          return a.ndim() == 2 && a.shape(0) == r && a.shape(1) == c;
        };
        if (!same(f_parents, n, wf) || !same(f_probs, n, wf) || f_counts.size() != n || !same(e_tokens, n, we) ||
            !same(e_parents, n, we) || !same(e_probs, n, we) || e_counts.size() != n)
          throw py::value_error("trees: tokens, parents and probs must have one shape and counts one entry per row");
        if (budget < 1) throw py::value_error("budget: expected >= 1");
        const int32_t* fc = f_counts.data();
        const int32_t* ec = e_counts.data();
        for (py::ssize_t i = 0; i < n; ++i) {
          if (fc[i] < 0 || fc[i] > wf || ec[i] < 0 || ec[i] > we)
            throw py::value_error("counts: expected 0 <= count <= width");
        }
        // since: one sequence of token ids per row, read through the C API (this runs every
        // remote-drafting step; packing it with numpy in Python cost more than the merge itself).
        std::vector<int32_t> since;
        std::vector<int64_t> off{0};
        {
          py::object rows = py::reinterpret_steal<py::object>(PySequence_Fast(since_rows.ptr(), "since: expected a sequence"));
          if (!rows) throw py::error_already_set();
          if (PySequence_Fast_GET_SIZE(rows.ptr()) != n)
            throw py::value_error("since: expected one sequence of token ids per row");
          for (py::ssize_t i = 0; i < n; ++i) {
            py::object row = py::reinterpret_steal<py::object>(
                PySequence_Fast(PySequence_Fast_GET_ITEM(rows.ptr(), i), "since: expected sequences of token ids"));
            if (!row) throw py::error_already_set();
            const py::ssize_t m = PySequence_Fast_GET_SIZE(row.ptr());
            PyObject** items = PySequence_Fast_ITEMS(row.ptr());
            for (py::ssize_t j = 0; j < m; ++j) {
              const long long v = PyLong_AsLongLong(items[j]);
              if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
              if (v < 0 || v > INT32_MAX) throw py::value_error("since: expected token ids in [0, 2^31)");
              since.push_back(static_cast<int32_t>(v));
            }
            off.push_back(static_cast<int64_t>(since.size()));
          }
        }
        std::vector<int32_t> tokens(static_cast<size_t>(n * budget), -1), parents(tokens.size(), -1);
        std::vector<float> probs(tokens.size(), 0.f);
        std::vector<int32_t> counts(static_cast<size_t>(n), 0);
        {
          py::gil_scoped_release nogil;
          std::vector<int32_t> t, p;
          std::vector<float> q;
          for (py::ssize_t i = 0; i < n; ++i) {
            t.clear(), p.clear(), q.clear();
            const TreeView fresh{f_tokens.data() + i * wf, f_parents.data() + i * wf, f_probs.data() + i * wf, fc[i]};
            const TreeView earlier{e_tokens.data() + i * we, e_parents.data() + i * we, e_probs.data() + i * we, ec[i]};
            const int k = merge_with_earlier(fresh, earlier, since.data() + off[i], static_cast<int>(off[i + 1] - off[i]),
                                             budget, t, p, q);
            std::copy(t.begin(), t.end(), tokens.begin() + i * budget);
            std::copy(p.begin(), p.end(), parents.begin() + i * budget);
            std::copy(q.begin(), q.end(), probs.begin() + i * budget);
            counts[static_cast<size_t>(i)] = k;
          }
        }
        return py::make_tuple(to_array(std::move(tokens), {n, budget}), to_array(std::move(parents), {n, budget}),
                              to_array(std::move(probs), {n, budget}), to_array(std::move(counts), {n}));
      },
      "Per row: the fresh tree united with the earlier tree re-rooted along `since` (tree_merge.h).");

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
      .def_readwrite("max_external_tokens", &CorpusConfig::max_external_tokens);

  py::class_<Corpus>(m, "Corpus")
      .def(py::init<CorpusConfig>())
      .def("start_request",
           [](Corpus& c, const std::string& id, py::handle prompt, int learn_prompt, const std::string& group,
              bool learn) {
             auto t = to_tokens(prompt, "prompt_ids");
             py::gil_scoped_release nogil;
             c.start_request(id, t.data(), t.size(), learn_prompt, group, learn);
           },
           py::arg("req_id"), py::arg("prompt_ids"), py::arg("learn_prompt") = -1, py::arg("group") = "",
           py::arg("learn") = true)
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
      .def("extend",
           [](Corpus& c, const std::string& id, py::handle tokens) {
             auto t = to_tokens(tokens, "token_ids");
             py::gil_scoped_release nogil;
             c.extend(id, t.data(), t.size());
           })
      .def("finish", &Corpus::finish, py::call_guard<py::gil_scoped_release>())
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
             auto n = static_cast<py::ssize_t>(ids.size());
             return py::make_tuple(to_array(std::move(d.tokens), {n, budget}),
                                   to_array(std::move(d.parents), {n, budget}),
                                   to_array(std::move(d.probs), {n, budget}),
                                   to_array(std::move(d.counts), {n}));
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
             if (!py::isinstance<py::sequence>(seqs) || py::isinstance<py::str>(seqs))
               throw py::type_error("batch_tokens: expected a sequence of token sequences");
             std::vector<std::vector<int32_t>> v;
             for (auto s : py::reinterpret_borrow<py::sequence>(seqs)) v.push_back(to_tokens(s, "batch_tokens"));
             py::gil_scoped_release nogil;
             c.put(std::move(v));
           })
      .def("synchronize", &Corpus::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("reset", &Corpus::reset, py::call_guard<py::gil_scoped_release>())
      .def("begin_external", &Corpus::begin_external)
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
