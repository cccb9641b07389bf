# The compiled scanner's fields, for modules that cimport it (scry/_relay.pyx
# reads them to tell whether a chunk is whole messages at a boundary).

cdef class MessageScanner:
    cdef signed char _table[256]  # message type -> -1 not wanted, 0 reported bare, 1 with body
    cdef Py_ssize_t _max
    cdef Py_ssize_t _max_collect
    cdef bytes _held  # an incomplete header from the previous chunk
    cdef readonly Py_ssize_t _remaining  # body bytes of the current message still to come
    cdef readonly object _collect  # a wanted body being gathered across chunks, or None
    cdef Py_ssize_t _collect_limit
    cdef int _kind

    cdef void _gather(self, bytearray collect, bytes part)
