# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""``scry.observe.histogram.count_positions`` compiled: where each duration
falls among a histogram's bounds, with no sort and no Python call per value.

The reference is ``histogram.py_count_positions`` (``bisect_right`` per value,
counted with ``collections``' C counter); this returns the same dict
(tests/unit/test_observe_stats.py). Why: the drain sorted every chunk's
latencies three times over (per shape, per database, for the health
monitor) to count them a bucket at a time; the sorts were ~0.25 µs a
statement at 50 clients, and this binary search is a few compares in C.

The values come as a list of ints or, from the compiled column walk
(``_columns.pyx``), as an ``array('q')``, read in place: no int object per
value to make, chase or free.
"""

from cpython cimport array as carray
from cpython.long cimport PyLong_AsLongLong
from cpython.mem cimport PyMem_Calloc, PyMem_Free


cdef inline Py_ssize_t _position(long long v, const long long[::1] bounds) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = bounds.shape[0], mid
    while lo < hi:  # bisect_right
        mid = (lo + hi) >> 1
        if v < bounds[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def count_positions(values, const long long[::1] bounds):
    """``{bisect_right(bounds, v): how many v}`` over ``values`` (a list of
    int64s or an ``array('q')``; ``bounds`` ascending). Raises OverflowError
    or TypeError for a value that is not an int64, before counting anything."""
    cdef Py_ssize_t m = bounds.shape[0]
    cdef Py_ssize_t i, n, position
    cdef list listed = None
    cdef const long long[::1] packed
    cdef Py_ssize_t* tally
    cdef dict positions = {}
    if type(values) is list:
        listed = <list>values
        n = len(listed)
    elif type(values) is carray.array and values.typecode == "q":
        packed = values
        n = packed.shape[0]
    else:
        raise TypeError("values are a list of ints or an array('q')")
    if n == 0:
        return positions
    tally = <Py_ssize_t*>PyMem_Calloc(m + 1, sizeof(Py_ssize_t))
    if tally == NULL:
        raise MemoryError()
    try:
        if listed is not None:
            for i in range(n):
                tally[_position(PyLong_AsLongLong(listed[i]), bounds)] += 1
        else:
            for i in range(n):
                tally[_position(packed[i], bounds)] += 1
        for position in range(m + 1):
            if tally[position]:
                positions[position] = tally[position]
    finally:
        PyMem_Free(tally)
    return positions
