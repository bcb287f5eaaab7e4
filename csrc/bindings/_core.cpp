// pybind11 glue for foresight._core: the only file that includes pybind11.
#include <pybind11/pybind11.h>
namespace py = pybind11;
PYBIND11_MODULE(_core, m) {
    m.doc() = "foresight C++ core: extent coalescer, page-aligned arena, checksums";
}
