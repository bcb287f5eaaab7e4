// pybind11 glue for foresight._core: the only file that includes pybind11.
// Arguments are unwrapped with the GIL held, then every loop over data runs with it released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "arena.hpp"
#include "coalesce.hpp"
#include "errors.hpp"
#include "kernels.hpp"

namespace py = pybind11;
using namespace foresight;

namespace {

// A 1-D C-contiguous array of exactly dtype T (no silent casts: the Python faces convert on purpose).
template <class T>
const T* input_array(const py::array& a, const char* fn, const char* name, const char* dtype) {
    if (!py::isinstance<py::array_t<T>>(a) || !a.dtype().is(py::dtype::of<T>()))
        throw py::type_error(cat(fn, ": ", name, " must be an array of dtype ", dtype, ", got ",
                                 std::string(py::str(a.dtype()))));
    if (a.ndim() != 1) throw InputError(cat(fn, ": ", name, " must be 1-D, got ", a.ndim(), " dimensions"));
    if (a.shape(0) > 1 && a.strides(0) != static_cast<py::ssize_t>(sizeof(T)))
        throw InputError(cat(fn, ": ", name, " must be contiguous"));
    return static_cast<const T*>(a.data());
}

void same_length(const char* fn, size_t n, const py::array& a, const char* name) {
    if (static_cast<size_t>(a.shape(0)) != n)
        throw InputError(cat(fn, ": ", name, " has ", a.shape(0), " entries, expected ", n));
}

// Hands a vector to numpy without copying: the array's base owns the vector.
template <class T>
py::array_t<T> to_numpy(std::vector<T>&& v) {
    auto* owned = new std::vector<T>(std::move(v));
    py::capsule base(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
    return py::array_t<T>({static_cast<py::ssize_t>(owned->size())}, {static_cast<py::ssize_t>(sizeof(T))},
                          owned->data(), base);
}

// A contiguous buffer-protocol view (bytes, bytearray, numpy, memoryview, mmap, ...), released on scope exit.
class Buffer {
public:
    Buffer(const py::object& obj, bool writable, const char* fn, const char* name) {
        int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
            PyErr_Clear();
            throw py::type_error(cat(fn, ": ", name, " must be a contiguous", writable ? " writable" : "",
                                     " buffer (bytes, bytearray, numpy array, memoryview), got ",
                                     std::string(py::str(py::type::of(obj).attr("__name__")))));
        }
    }
    ~Buffer() { PyBuffer_Release(&view_); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    uint8_t* data() const { return static_cast<uint8_t*>(view_.buf); }
    size_t size() const { return static_cast<size_t>(view_.len); }

private:
    Py_buffer view_{};
};

py::dict transfers_to_dict(Transfers&& t) {
    py::dict d;
    d["t_file"] = to_numpy(std::move(t.file));
    d["t_offset"] = to_numpy(std::move(t.offset));
    d["t_length"] = to_numpy(std::move(t.length));
    d["t_needed"] = to_numpy(std::move(t.needed));
    d["t_dest"] = to_numpy(std::move(t.dest));
    d["x_dest"] = to_numpy(std::move(t.extent_dest));
    d["total_bytes"] = t.total_bytes;
    d["requested_bytes"] = t.requested_bytes;
    d["read_bytes"] = t.read_bytes;
    return d;
}

py::dict coalesce_py(const py::array& file, const py::array& offset, const py::array& length, int64_t max_gap,
                     int64_t max_transfer, int64_t align, const py::object& file_sizes) {
    const char* fn = "coalesce";
    const int32_t* f = input_array<int32_t>(file, fn, "file", "int32");
    const int64_t* o = input_array<int64_t>(offset, fn, "offset", "int64");
    const int64_t* l = input_array<int64_t>(length, fn, "length", "int64");
    const size_t n = static_cast<size_t>(file.shape(0));
    same_length(fn, n, offset, "offset");
    same_length(fn, n, length, "length");
    CoalesceOptions opts;
    opts.max_gap = max_gap;
    opts.max_transfer = max_transfer;
    opts.align = align;
    py::array sizes;
    if (!file_sizes.is_none()) {
        if (!py::isinstance<py::array>(file_sizes))
            throw py::type_error("coalesce: file_sizes must be an int64 array or None");
        sizes = py::reinterpret_borrow<py::array>(file_sizes);
        opts.file_sizes = input_array<int64_t>(sizes, fn, "file_sizes", "int64");
        opts.num_files = static_cast<size_t>(sizes.shape(0));
    }
    Transfers t;
    {
        py::gil_scoped_release nogil;
        t = coalesce(f, o, l, n, opts);
    }
    return transfers_to_dict(std::move(t));
}

py::array_t<uint64_t> xxh3_batch_py(const py::object& buffer, const py::array& offset, const py::array& length) {
    const char* fn = "xxh3_batch";
    Buffer buf(buffer, false, fn, "buffer");
    const int64_t* o = input_array<int64_t>(offset, fn, "offsets", "int64");
    const int64_t* l = input_array<int64_t>(length, fn, "lengths", "int64");
    const size_t n = static_cast<size_t>(offset.shape(0));
    same_length(fn, n, length, "lengths");
    py::array_t<uint64_t> out(static_cast<py::ssize_t>(n));
    uint64_t* dst = out.mutable_data();
    {
        py::gil_scoped_release nogil;
        xxh3_batch(buf.data(), buf.size(), o, l, n, dst);
    }
    return out;
}

int64_t gather_py(const py::object& src, const py::array& src_offset, const py::array& length,
                  const py::object& dst, const py::object& dst_offset) {
    const char* fn = "gather";
    Buffer in(src, false, fn, "src");
    Buffer out(dst, true, fn, "dst");
    const int64_t* so = input_array<int64_t>(src_offset, fn, "src_offsets", "int64");
    const int64_t* l = input_array<int64_t>(length, fn, "lengths", "int64");
    const size_t n = static_cast<size_t>(src_offset.shape(0));
    same_length(fn, n, length, "lengths");
    const int64_t* dof = nullptr;
    py::array dst_off;
    if (!dst_offset.is_none()) {
        if (!py::isinstance<py::array>(dst_offset))
            throw py::type_error("gather: dst_offsets must be an int64 array or None");
        dst_off = py::reinterpret_borrow<py::array>(dst_offset);
        dof = input_array<int64_t>(dst_off, fn, "dst_offsets", "int64");
        same_length(fn, n, dst_off, "dst_offsets");
    }
    py::gil_scoped_release nogil;
    return gather(in.data(), in.size(), so, l, dof, n, out.data(), out.size());
}

// Slot i as a writable numpy uint8 array whose base co-owns the mapping, so the memory outlives close()
// for as long as any view (or a torch tensor made from one) is alive.
py::array_t<uint8_t> arena_view(Arena& arena, uint8_t* data, size_t nbytes) {
    auto* owner = new std::shared_ptr<Mapping>(arena.mapping());
    py::capsule base(owner, [](void* p) { delete static_cast<std::shared_ptr<Mapping>*>(p); });
    return py::array_t<uint8_t>({static_cast<py::ssize_t>(nbytes)}, {static_cast<py::ssize_t>(1)}, data, base);
}

// foresight.errors.FormatError, or ValueError (its base) where the package cannot be imported (the build's
// check loads the module on its own).
PyObject* format_error_class() {
    PyObject* mod = PyImport_ImportModule("foresight.errors");
    PyObject* cls = mod ? PyObject_GetAttrString(mod, "FormatError") : nullptr;
    Py_XDECREF(mod);
    if (!cls) {
        PyErr_Clear();
        Py_INCREF(PyExc_ValueError);
        return PyExc_ValueError;
    }
    return cls;
}

// Sets the Python error for the C++ exception in p through the C API alone; handles every exception.
void translate_exception(std::exception_ptr p) {
    if (!p) return;
    try {
        std::rethrow_exception(p);
    } catch (py::error_already_set& e) {
        e.restore();
    } catch (const py::builtin_exception& e) {  // py::type_error and friends
        e.set_error();
    } catch (const foresight::FormatError& e) {
        PyObject* cls = format_error_class();
        PyErr_SetString(cls, e.what());
        Py_DECREF(cls);
    } catch (const foresight::SystemError& e) {
        PyErr_SetObject(PyExc_OSError, py::make_tuple(e.err, e.what()).ptr());
    } catch (const ClosedError& e) {
        PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::bad_alloc&) {
        PyErr_SetString(PyExc_MemoryError, "foresight._core: out of memory");
    } catch (const std::out_of_range& e) {
        PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const std::overflow_error& e) {
        PyErr_SetString(PyExc_OverflowError, e.what());
    } catch (const std::invalid_argument& e) {  // InputError
        PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::length_error& e) {
        PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "foresight._core: unknown C++ exception");
    }
}

[[noreturn]] void raise_for_check(const std::string& kind, int64_t number) {
    const std::string what = cat("check: ", kind, " error ", number, " (", -number, ") reached Python whole");
    if (kind == "input") throw InputError(what);
    if (kind == "format") throw foresight::FormatError(what);
    if (kind == "closed") throw ClosedError(what);
    if (kind == "system") throw foresight::SystemError(what, static_cast<int>(number));
    if (kind == "std") throw std::runtime_error(what);
    if (kind == "bad_alloc") throw std::bad_alloc();
    throw py::type_error(cat("_raise_for_check: unknown kind '", kind, "'"));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "foresight C++ core: extent coalescer, page-aligned arena, checksums. Use foresight.io instead.";

    // Module-local and catch-all: every exception thrown here is turned into a Python error here, by this
    // module's own C++ runtime, and never reaches another module's translators (pybind11 shares its global
    // list with every extension of the same ABI tag, which may run on another libstdc++ and crash on ours).
    py::register_local_exception_translator(translate_exception);

    m.def("_raise_for_check", &raise_for_check, py::arg("kind"), py::arg("number"),
          "Throws one C++ exception of `kind` (input, format, closed, system, std, bad_alloc) whose message\n"
          "holds `number`: lets the build and the tests check that errors cross the binding whole.");
    m.def("coalesce", &coalesce_py, py::arg("file"), py::arg("offset"), py::arg("length"), py::kw_only(),
          py::arg("max_gap"), py::arg("max_transfer"), py::arg("align"), py::arg("file_sizes") = py::none(),
          "Merge extents into aligned transfers; returns a dict of arrays (see foresight.io.coalesce).");
    m.def("xxh3_batch", &xxh3_batch_py, py::arg("buffer"), py::arg("offsets"), py::arg("lengths"),
          "XXH3-64 (seed 0) of each slice buffer[offsets[i]:offsets[i]+lengths[i]] as a uint64 array.");
    m.def("gather", &gather_py, py::arg("src"), py::arg("src_offsets"), py::arg("lengths"), py::arg("dst"),
          py::arg("dst_offsets") = py::none(),
          "Copy pieces of src into dst (back to back, or at dst_offsets); returns the bytes copied.");

    py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
        .def(py::init([](size_t slot_bytes, size_t slots, bool hugepages, bool populate) {
                 ArenaOptions o;
                 o.slot_bytes = slot_bytes;
                 o.slots = slots;
                 o.hugepages = hugepages;
                 o.populate = populate;
                 py::gil_scoped_release nogil;  // pre-touching gigabytes takes a while
                 return std::make_shared<Arena>(o);
             }),
             py::arg("slot_bytes"), py::arg("slots"), py::kw_only(), py::arg("hugepages") = false,
             py::arg("populate") = true)
        .def_property_readonly("slot_bytes", &Arena::slot_bytes)
        .def_property_readonly("slots", &Arena::slots)
        .def_property_readonly("nbytes", &Arena::nbytes)
        .def_property_readonly("page_size", &Arena::page_size)
        .def_property_readonly("hugepages_advised", &Arena::hugepages_advised)
        .def_property_readonly("closed", &Arena::closed)
        .def_property_readonly("free_slots", &Arena::free_slots)
        .def_property_readonly("live_views", &Arena::live_views)
        .def("address", [](const Arena& a, size_t i) { return reinterpret_cast<uintptr_t>(a.slot_data(i)); },
             py::arg("i"))
        .def("slot", [](Arena& a, size_t i) { return arena_view(a, a.slot_data(i), a.slot_bytes()); },
             py::arg("i"))
        .def("view", [](Arena& a) { return arena_view(a, a.mapping()->data, a.nbytes()); },
             "The whole arena as one uint8 array.")
        .def("acquire", &Arena::acquire, py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
             "Index of a free slot, blocking up to timeout seconds (< 0: forever); -1 on timeout.")
        .def("release", &Arena::release, py::arg("i"))
        .def("close", &Arena::close);
}
