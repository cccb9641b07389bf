# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""``scry.observe.histogram.count_positions`` compiled: where each duration
falls among a histogram's bounds, with no sort and no Python call per value.

The reference is ``histogram.py_count_positions`` (``bisect_right`` per value,
counted with ``collections``' C counter); this returns the same dict
(tests/unit/test_observe_stats.py). Why: the drain sorted every chunk's
latencies three times over (per shape, per database, for the health
monitor) to count them a bucket at a time; the sorts were ~0.25 µs a
statement at 50 clients, and this binary search is a few compares in C.
"""

from cpython.long cimport PyLong_AsLongLong
from cpython.mem cimport PyMem_Calloc, PyMem_Free


def count_positions(list values, const long long[::1] bounds):
    """``{bisect_right(bounds, v): how many v}`` over ``values`` (int64s;
    ``bounds`` ascending). Raises OverflowError or TypeError for a value that
    is not an int64, before counting anything."""
    cdef Py_ssize_t n = len(values)
    cdef Py_ssize_t m = bounds.shape[0]
    cdef Py_ssize_t i, lo, hi, mid, position
    cdef long long v
    cdef Py_ssize_t* tally
    cdef dict positions = {}
    if n == 0:
        return positions
    tally = <Py_ssize_t*>PyMem_Calloc(m + 1, sizeof(Py_ssize_t))
    if tally == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            v = PyLong_AsLongLong(values[i])
            lo = 0
            hi = m
            while lo < hi:  # bisect_right
                mid = (lo + hi) >> 1
                if v < bounds[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            tally[lo] += 1
        for position in range(m + 1):
            if tally[position]:
                positions[position] = tally[position]
    finally:
        PyMem_Free(tally)
    return positions
