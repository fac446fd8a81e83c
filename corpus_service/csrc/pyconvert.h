// Conversions from Python objects to token buffers, with errors that say what was expected.
// Accepts numpy integer arrays (any int dtype, 1-D) without copying when already int32, and
// Python sequences of ints. Raises ValueError (std::invalid_argument) or TypeError.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace ngc {
namespace py = pybind11;

inline std::vector<int32_t> to_tokens(py::handle obj, const char* what) {
  std::vector<int32_t> out;
  if (py::isinstance<py::array>(obj)) {
    auto arr = py::reinterpret_borrow<py::array>(obj);
    if (arr.ndim() != 1)
      throw std::invalid_argument(std::string(what) + ": expected a 1-D array of token ids, got " +
                                  std::to_string(arr.ndim()) + " dimensions");
    char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u')
      throw std::invalid_argument(std::string(what) + ": expected an integer array, got dtype " +
                                  std::string(py::str(arr.dtype())));
    if (arr.dtype().is(py::dtype::of<int32_t>()) && (arr.flags() & py::array::c_style)) {
      // The common case (int32 token arrays): one copy, one pass for the range check.
      const auto* p = static_cast<const int32_t*>(arr.data());
      out.assign(p, p + arr.shape(0));
      for (size_t i = 0; i < out.size(); ++i)
        if (out[i] < 0)
          throw std::invalid_argument(std::string(what) + ": token ids must be in [0, 2^31), got " +
                                      std::to_string(out[i]) + " at index " + std::to_string(i));
      return out;
    }
    auto a64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    auto r = a64.unchecked<1>();
    out.resize(static_cast<size_t>(r.shape(0)));
    for (py::ssize_t i = 0; i < r.shape(0); ++i) {
      int64_t v = r(i);
      if (v < 0 || v > std::numeric_limits<int32_t>::max())
        throw std::invalid_argument(std::string(what) + ": token ids must be in [0, 2^31), got " +
                                    std::to_string(v) + " at index " + std::to_string(i));
      out[static_cast<size_t>(i)] = static_cast<int32_t>(v);
    }
    return out;
  }
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) || !py::isinstance<py::sequence>(obj))
    throw py::type_error(std::string(what) + ": expected a sequence of token ids, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  auto seq = py::reinterpret_borrow<py::sequence>(obj);
  out.resize(seq.size());
  size_t i = 0;
  for (auto item : seq) {
    if (!PyLong_Check(item.ptr()) || PyBool_Check(item.ptr()))
      throw py::type_error(std::string(what) + ": token ids must be ints, got " +
                           std::string(py::str(py::type::of(item).attr("__name__"))) + " at index " +
                           std::to_string(i));
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
    if (overflow || v < 0 || v > std::numeric_limits<int32_t>::max())
      throw std::invalid_argument(std::string(what) + ": token ids must be in [0, 2^31), got " +
                                  std::string(py::str(item)) + " at index " + std::to_string(i));
    out[i++] = static_cast<int32_t>(v);
  }
  return out;
}

inline std::vector<std::string> to_ids(py::handle obj, const char* what) {
  if (py::isinstance<py::str>(obj) || !py::isinstance<py::sequence>(obj))
    throw py::type_error(std::string(what) + ": expected a sequence of request ids");
  std::vector<std::string> out;
  for (auto item : py::reinterpret_borrow<py::sequence>(obj)) {
    if (py::isinstance<py::str>(item))
      out.push_back(item.cast<std::string>());
    else if (PyLong_Check(item.ptr()) && !PyBool_Check(item.ptr()))
      out.push_back(std::string(py::str(item)));
    else
      throw py::type_error(std::string(what) + ": request ids must be str or int, got " +
                           std::string(py::str(py::type::of(item).attr("__name__"))));
  }
  return out;
}

}  // namespace ngc
