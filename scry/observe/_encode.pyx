# cython: language_level=3, boundscheck=False, wraparound=False
"""``scry.observe.events.py_encode_columns`` compiled: a batch's string table
and column bytes in one walk per column.

The reference is the pure-Python ``py_encode_columns``; this takes the same
arguments and returns equal values (tests/unit/test_observe_events.py). Why:
the file sink encodes every event, and in Python that is a list and an
``array`` per column per batch plus a ``dict.setdefault`` per string value,
~0.4 µs an event with the slicing that cut the batches out of the ring's
blocks; here the columns are read in place and written straight into the
output.

Anything the Python twin would not encode the same way (a number out of
its column's range, a value of the wrong type) raises OverflowError,
TypeError or ValueError, and ``events`` then asks the Python twin, which
raises or encodes as it always did. Built for little-endian machines only
(the format's byte order); elsewhere the twin is used.
"""

from cpython cimport array as carray
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.float cimport PyFloat_AsDouble
from cpython.long cimport PyLong_AsLong, PyLong_AsLongLong
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from libc.string cimport memcpy


cdef extern from "Python.h":
    PyObject* PyDict_SetDefault(object d, object key, object default) except NULL


cdef inline Py_ssize_t _item_size(unsigned char code) except -1:
    if code == b"d" or code == b"q":
        return 8
    if code == b"i" or code == b"S" or code == b"s" or code == b"L":
        return 4
    if code == b"?":
        return 1
    raise ValueError(f"unknown layout code {chr(code)!r}")


cdef inline bint _is_array_of(object column, unsigned char code):
    """Whether ``column`` is an array whose items are the format's for ``code``."""
    if type(column) is not carray.array:
        return False
    cdef str typecode = (<carray.array>column).typecode
    if code == b"d":
        return typecode == "d"
    if code == b"q":
        return typecode == "q"
    if code == b"i":
        return typecode == "i"
    return False


cdef inline uint32_t _index(dict strings, object value):
    return <uint32_t><object>PyDict_SetDefault(strings, value, len(strings))


def encode_columns(list parts, bytes codes):
    """See ``scry.observe.events.py_encode_columns``."""
    cdef Py_ssize_t ncols = len(codes), n = 0, row = 0, c, i, start, stop, size
    cdef unsigned char code
    for c in range(ncols):
        row += _item_size(codes[c])
    for part in parts:
        columns, start, stop = part
        if start < 0 or stop < start or (stop > start and len(columns) != ncols):
            raise ValueError("a part is not a slice of a block of every column")
        n += stop - start
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n * row)
    cdef char* p = PyBytes_AS_STRING(out)
    cdef dict strings = {"": 0}
    cdef object value, last
    cdef uint32_t last_index = 0
    cdef long small
    for c in range(ncols):
        code = codes[c]
        size = _item_size(code)
        for part in parts:
            columns, start, stop = part
            if stop == start:
                continue
            column = columns[c]
            if stop > len(column):
                raise ValueError("a part reaches past its block")
            if _is_array_of(column, code):
                memcpy(p, (<carray.array>column).data.as_chars + start * size, (stop - start) * size)
                p += (stop - start) * size
                continue
            if code == b"S" or code == b"s" or code == b"L":
                last = None  # (no value is None here but the nulls of "s")
                for i in range(start, stop):
                    value = column[i]
                    if code == b"s" and value is None:
                        (<int32_t*>p)[0] = -1
                    else:
                        if code == b"L":
                            value = ",".join(value) if value else ""
                        if value is not last or last is None:
                            last_index = _index(strings, value)
                            last = value
                        (<uint32_t*>p)[0] = last_index
                    p += 4
            elif code == b"d":
                for i in range(start, stop):
                    (<double*>p)[0] = PyFloat_AsDouble(column[i])
                    p += 8
            elif code == b"q":
                for i in range(start, stop):
                    (<int64_t*>p)[0] = PyLong_AsLongLong(column[i])
                    p += 8
            elif code == b"i":
                for i in range(start, stop):
                    small = PyLong_AsLong(column[i])
                    if small < -2147483648 or small > 2147483647:
                        raise OverflowError("an int32 column value out of range")
                    (<int32_t*>p)[0] = <int32_t>small
                    p += 4
            else:  # "?"
                for i in range(start, stop):
                    small = PyLong_AsLong(column[i])
                    if small < 0 or small > 255:
                        raise OverflowError("a bool column value out of range")
                    (<uint8_t*>p)[0] = <uint8_t>small
                    p += 1
    table = "\0".join(strings).encode("utf-8", "surrogatepass")
    return table, out
