# cython: language_level=3, boundscheck=False, wraparound=False
"""scry.accept's per-connection work, compiled: ``Acceptor`` (a listening
socket's reader callback) and ``EarlyTransport``. The pure-Python twins in
scry/accept.py do the same and are the reference (tests/unit/test_accept.py
runs both). Why compiled: in Python, the accept callback, the early
transport and the hand-over to uvloop cost ~20 µs of CPU a login at
``pgbench -C``, more than the wait they save; here they are a few system
calls, a C struct and the coroutine uvloop's ``connect_accepted_socket``
needs.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.errno cimport EAGAIN, EINTR, EMFILE, ENFILE, ENOBUFS, ENOMEM, errno
from libc.string cimport memcpy


cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    ctypedef unsigned short sa_family_t
    struct sockaddr:
        sa_family_t sa_family
    struct sockaddr_storage:
        sa_family_t ss_family
    int accept4(int fd, sockaddr* addr, socklen_t* addrlen, int flags)
    int getsockname(int fd, sockaddr* addr, socklen_t* addrlen)
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    enum: SOCK_CLOEXEC
    enum: SOCK_STREAM
    enum: MSG_PEEK
    enum: MSG_DONTWAIT
    enum: MSG_NOSIGNAL
    enum: AF_INET
    enum: AF_INET6

cdef extern from "<netinet/in.h>" nogil:
    struct in_addr:
        pass
    struct in6_addr:
        pass
    struct sockaddr_in:
        unsigned short sin_port
        in_addr sin_addr
    struct sockaddr_in6:
        unsigned short sin6_port
        unsigned int sin6_flowinfo
        in6_addr sin6_addr
        unsigned int sin6_scope_id
    unsigned short ntohs(unsigned short)
    unsigned int ntohl(unsigned int)

cdef extern from "<arpa/inet.h>" nogil:
    const char* inet_ntop(int af, const void* src, char* dst, socklen_t size)

cdef extern from "<unistd.h>" nogil:
    int close(int fd)

# (scry.accept.PEEK_SIZE and OUT_OF_DESCRIPTORS)
cdef enum:
    _PEEK_SIZE = 2048
cdef frozenset _OUT_OF_DESCRIPTORS = frozenset({EMFILE, ENFILE, ENOBUFS, ENOMEM})


cdef inline unsigned int _length_at(const unsigned char* p) noexcept nogil:
    return (<unsigned int>p[0] << 24) | (<unsigned int>p[1] << 16) | (<unsigned int>p[2] << 8) | p[3]


cdef inline bint _whole_startup(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    # scry.accept.whole_startup_message
    return n >= 8 and _length_at(p) == <unsigned int>n and _length_at(p + 4) == 196608


cdef object _address(sockaddr_storage* addr):
    """A sockaddr as the socket module gives it: (host, port[, flowinfo, scope_id])."""
    cdef char text[64]
    cdef sockaddr_in* v4
    cdef sockaddr_in6* v6
    if addr.ss_family == AF_INET:
        v4 = <sockaddr_in*>addr
        inet_ntop(AF_INET, &v4.sin_addr, text, sizeof(text))
        return ((<bytes>text).decode("ascii"), ntohs(v4.sin_port))
    if addr.ss_family == AF_INET6:
        v6 = <sockaddr_in6*>addr
        inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof(text))
        return ((<bytes>text).decode("ascii"), ntohs(v6.sin6_port),
                ntohl(v6.sin6_flowinfo), v6.sin6_scope_id)
    return None


cdef class AcceptedSocket:
    """What ``connect_accepted_socket`` needs of a socket. libuv closes the
    descriptor with its transport, and uvloop then calls ``close()`` here,
    which must not close it again (the number may be reused by then)."""

    cdef readonly int family
    cdef readonly int type
    cdef int fd

    def fileno(self):
        return self.fd

    def close(self):
        pass


cdef AcceptedSocket _accepted(int fd, int family):
    cdef AcceptedSocket sock = AcceptedSocket.__new__(AcceptedSocket)
    sock.fd = fd
    sock.family = family
    sock.type = SOCK_STREAM
    return sock


cdef class Adoption:
    """``connect_accepted_socket`` run without a Task: it sets the transport
    up at once, then only waits for ``connection_made``; its end is resumed
    from the wait's done callback."""

    cdef object _coro
    cdef EarlyTransport _early  # (told if the transport failed before connection_made)

    cdef start(self, coro, EarlyTransport early):
        self._early = early
        try:
            waiter = coro.send(None)
        except StopIteration:
            return
        except Exception as exc:
            self._failed(exc)
            return
        self._coro = coro
        waiter.add_done_callback(self._resume)

    def _resume(self, waiter):
        coro, self._coro = self._coro, None
        try:
            coro.send(None)
        except StopIteration:
            pass
        except Exception as exc:
            self._failed(exc)

    cdef _failed(self, exc):
        if self._early is not None:
            self._early._adoption_failed(exc)
        self._early = None


cdef class Acceptor:
    """A listening socket's reader callback: one connection per call (the
    reader is level-triggered, so a backlog drains over the next turns)."""

    cdef int _fd
    cdef int _family
    cdef object _loop, _new_client, _failed

    def __init__(self, listening, loop, new_client, failed):
        self._fd = listening.fileno()
        self._family = listening.family
        self._loop = loop
        self._new_client = new_client
        self._failed = failed  # failed(errno): accept() is out of descriptors

    def __call__(self):
        cdef sockaddr_storage peer
        cdef socklen_t peer_len = sizeof(peer)
        cdef unsigned char head[_PEEK_SIZE]
        cdef int fd = accept4(self._fd, <sockaddr*>&peer, &peer_len, SOCK_CLOEXEC)
        cdef int err
        if fd < 0:
            err = errno
            if err in _OUT_OF_DESCRIPTORS:
                self._failed(err)
            return  # EAGAIN, or the connection went before we took it
        cdef Py_ssize_t n = recv(fd, head, _PEEK_SIZE, MSG_PEEK | MSG_DONTWAIT)
        if n < 0:
            err = errno
            if err != EAGAIN and err != EINTR:  # (EWOULDBLOCK is EAGAIN on Linux)
                close(fd)  # reset before we read: nobody to tell
                return
            n = 0
        sock = _accepted(fd, self._family)
        if not _whole_startup(head, n):  # left for uvloop's transport to read
            Adoption().start(self._loop.connect_accepted_socket(self._new_client, sock), None)
            return
        data = PyBytes_FromStringAndSize(NULL, n)
        if recv(fd, PyBytes_AS_STRING(data), n, MSG_DONTWAIT) != n:  # (the bytes peeked at)
            close(fd)
            return
        protocol = self._new_client()
        cdef EarlyTransport early = EarlyTransport.__new__(EarlyTransport)
        early._fd = fd
        early._sock = sock
        early._loop = self._loop
        early._protocol = protocol
        memcpy(&early._peer_addr, &peer, sizeof(peer))
        try:
            protocol.connection_made(early)
            protocol.data_received(data)
        except BaseException:
            early.abort()
            raise
        early._adopt()


cdef class EarlyTransport:
    """scry.accept.PyEarlyTransport, compiled."""

    cdef int _fd
    cdef AcceptedSocket _sock
    cdef sockaddr_storage _peer_addr
    cdef object _loop, _protocol, _real, _held
    cdef bytearray _unsent
    cdef bint _paused, _closing, _aborting, _adopting, _handed, _fd_closed

    # --- the transport the client sees ----------------------------------------------

    def write(self, data):
        if self._real is not None:
            self._real.write(data)
            return
        if self._closing or not data:
            return
        if self._unsent is not None:
            self._unsent += data
            return
        cdef bytes chunk = data if type(data) is bytes else bytes(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(chunk)
        cdef Py_ssize_t sent = send(
            self._fd, PyBytes_AS_STRING(chunk), n, MSG_DONTWAIT | MSG_NOSIGNAL
        )
        cdef int err
        if sent < 0:
            err = errno
            if err != EAGAIN and err != EINTR:  # (EWOULDBLOCK is EAGAIN on Linux)
                self._lost(OSError(err, "send failed"))
                return
            sent = 0
        if sent < n:
            self._unsent = bytearray(chunk[sent:])

    def close(self):
        if self._real is not None:
            self._real.close()
            return
        self._closing = True
        if not self._unsent:  # (else once uvloop's transport has sent it)
            self._close_now(None)

    def abort(self):
        if self._real is not None:
            self._real.abort()
            return
        self._closing = self._aborting = True
        self._unsent = None
        self._close_now(None)

    def is_closing(self):
        return self._real.is_closing() if self._real is not None else self._closing

    def pause_reading(self):
        self._paused = True

    def resume_reading(self):
        self._paused = False
        if self._held is not None:
            self._release_reads()

    def is_reading(self):
        return not (self._paused or self._closing)

    def get_write_buffer_size(self):
        if self._real is not None:
            return self._real.get_write_buffer_size()
        return len(self._unsent) if self._unsent else 0

    def get_extra_info(self, name, default=None):
        if self._real is not None:
            return self._real.get_extra_info(name, default)
        cdef sockaddr_storage local
        cdef socklen_t local_len = sizeof(local)
        if name == "peername":
            return _address(&self._peer_addr)
        if name == "sockname":
            if getsockname(self._fd, <sockaddr*>&local, &local_len) != 0:
                return default
            return _address(&local)
        if name == "socket":
            return self._sock
        return default

    # --- the hand-over to uvloop's transport ----------------------------------------------

    def set_protocol(self, protocol):
        self._protocol = protocol

    def get_protocol(self):
        return self._protocol

    cdef _adopt(self):
        if self._fd_closed:
            return
        self._adopting = True
        Adoption().start(self._loop.connect_accepted_socket(self, self._sock), self)

    def __call__(self):
        """(The protocol factory given to connect_accepted_socket.)"""
        return self

    # --- uvloop's transport's first protocol: the hand-over -------------------------------

    def connection_made(self, real):
        self._handed = True
        if self._unsent:
            real.write(bytes(self._unsent))
        self._unsent = None
        if self._closing:
            real.abort() if self._aborting else real.close()
        elif self._paused:
            self._real = real
            self._held = []
        else:
            self._protocol.transport = real
            real.set_protocol(self._protocol)

    cdef _release_reads(self):
        real, held, protocol = self._real, self._held, self._protocol
        self._held = None
        protocol.transport = real
        real.set_protocol(protocol)
        for data in held:
            if real.is_closing():
                break
            protocol.data_received(data)
        real.resume_reading()

    # (While reads are held.)

    def data_received(self, data):
        self._real.pause_reading()
        self._held.append(data)

    def eof_received(self):
        return None

    def connection_lost(self, exc):
        self._protocol.connection_lost(exc)

    def pause_writing(self):
        self._protocol.pause_writing()

    def resume_writing(self):
        self._protocol.resume_writing()

    # --- the end before uvloop's transport -------------------------------------------------

    cdef _close_now(self, exc):
        if self._adopting or self._fd_closed:
            return
        self._fd_closed = True
        close(self._fd)
        self._loop.call_soon(self._protocol.connection_lost, exc)

    cdef _lost(self, exc):
        self._closing = True
        self._unsent = None
        self._close_now(exc)

    cdef _adoption_failed(self, exc):
        if not self._handed:
            self._protocol.connection_lost(exc)
