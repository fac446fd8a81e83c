// Python bindings of the verifier's step plan (step_rows.h). No logic here: checks, conversion, wiring.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "step_rows.h"

namespace py = pybind11;
using namespace vstep;

namespace {
// Arrays of other dtypes or layouts are converted on the way in.
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;

// [n, width] padded rows, checked: one shape, counts within the width.
DraftRows draft_rows(const I32& tokens, const I32& parents, const F32& probs, const I32& counts) {
  if (tokens.ndim() != 2) throw py::value_error("rows: expected [n, width] arrays with one row per request");
  const auto n = tokens.shape(0), w = tokens.shape(1);
  auto same = [&](const py::array& a) { return a.ndim() == 2 && a.shape(0) == n && a.shape(1) == w; };
  if (!same(parents) || !same(probs) || counts.ndim() != 1 || counts.shape(0) != n)
    throw py::value_error("rows: tokens, parents and probs must have one shape and counts one entry per row");
  for (py::ssize_t i = 0; i < n; ++i)
    if (counts.data()[i] < 0 || counts.data()[i] > w) throw py::value_error("counts: expected 0 <= count <= width");
  return DraftRows{tokens.data(), parents.data(), probs.data(), counts.data(), n, w};
}

// A sequence of n ints (a list, a tuple or a 1-D integer array), read through the C API: the
// engine's per-step lists (last tokens, prefix lengths, cache slots) would cost a numpy conversion each.
std::vector<int64_t> to_int64s(py::handle obj, py::ssize_t n, const char* what) {
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), what));
  if (!seq) throw py::error_already_set();
  if (PySequence_Fast_GET_SIZE(seq.ptr()) != n)
    throw py::value_error(std::string(what) + ": expected " + std::to_string(n) + " values, got " +
                          std::to_string(PySequence_Fast_GET_SIZE(seq.ptr())));
  std::vector<int64_t> out(static_cast<size_t>(n));
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  for (py::ssize_t i = 0; i < n; ++i) {
    if (PyBool_Check(items[i]) || !PyIndex_Check(items[i]))
      throw py::type_error(std::string(what) + ": expected ints, got " +
                           std::string(py::str(py::type::of(py::handle(items[i])).attr("__name__"))));
    const long long v = PyLong_AsLongLong(items[i]);  // calls __index__ (numpy integers)
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}
}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "The verifier's step plan: draft rows summarized for the node choice, pruned and packed (step_rows.h).";
  m.def(
      "summarize_rows",
      [](F32 probs, I32 counts) {
        if (probs.ndim() != 2 || counts.ndim() != 1 || counts.shape(0) != probs.shape(0))
          throw py::value_error("summarize_rows: expected probs [n, width] and counts [n]");
        const DraftRows v{nullptr, nullptr, probs.data(), counts.data(), probs.shape(0), probs.shape(1)};
        RowsSummary s = summarize_rows(v);
        return py::make_tuple(s.nodes, s.best_first, py::cast(s.column_sums));
      },
      py::arg("probs"), py::arg("counts"), "(nodes, best_first, column_sums) of padded draft rows (step_rows.h).");
  m.def(
      "pack_plan",
      [](py::handle last_tokens, I32 tokens, I32 parents, F32 probs, I32 counts, int k, bool best_first,
         py::handle prefix_lens, py::handle slots, int k_min, int64_t rows, int64_t scratch, py::object out) {
        const DraftRows v = draft_rows(tokens, parents, probs, counts);
        if (k < 0 || k_min < 1) throw py::value_error("pack_plan: expected k >= 0 and k_min >= 1");
        if (rows != 0 && rows < v.n) throw py::value_error("pack_plan: rows must be 0 (n) or at least n");
        auto last = to_int64s(last_tokens, v.n, "last_tokens");
        auto prefix = to_int64s(prefix_lens, v.n, "prefix_lens");
        auto slot = to_int64s(slots, v.n, "slots");
        const PlanShape shape{k, k_min, std::max(rows, static_cast<int64_t>(v.n)), scratch};
        const int K = plan_width(v, k, k_min);
        const auto size = static_cast<py::ssize_t>(2 * shape.rows * K + 2 * shape.rows);
        py::array_t<int64_t> host;
        if (out.is_none()) {
          host = py::array_t<int64_t>(size);
        } else {  // the caller's buffer (a graph's pinned staging): written in place, nothing copied after
          if (!py::array_t<int64_t, py::array::c_style>::check_(out) || !py::reinterpret_borrow<py::array>(out).writeable())
            throw py::value_error("pack_plan: out must be a writable C-contiguous int64 array");
          host = py::reinterpret_borrow<py::array_t<int64_t>>(out);
          if (host.size() < size)
            throw py::value_error("pack_plan: out holds " + std::to_string(host.size()) + " values, the step needs " +
                                  std::to_string(size));
        }
        std::vector<int32_t> num_nodes;
        const double predicted =
            pack_plan(v, shape, best_first, last.data(), prefix.data(), slot.data(), host.mutable_data(), num_nodes);
        return py::make_tuple(host, K, py::cast(num_nodes), predicted);
      },
      py::arg("last_tokens"), py::arg("tokens"), py::arg("parents"), py::arg("probs"), py::arg("counts"), py::arg("k"),
      py::arg("best_first"), py::arg("prefix_lens"), py::arg("slots"), py::arg("k_min"), py::arg("rows") = 0,
      py::arg("scratch") = 0, py::arg("out") = py::none(),
      "(host int64, K, num_nodes, predicted): the rows pruned to k nodes and packed for a verify step of "
      "max(rows, n) rows (step_rows.h), into `out` if given.");
}
