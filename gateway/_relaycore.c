/* gateway._relaycore: the relay's per-chunk byte path in C (issue 15).
 *
 * Four base types, each subclassed by the Python class that owns the rest of its logic:
 *
 *   BodyFraming  base of _wire.Connection: data_received, the body's framing
 *                (Content-Length, chunked, until close) decoded here; the response
 *                head, the end of the body and failures are the Python subclass's.
 *   Tee          base of _upstream.BodyTee: per piece the capture, the optional filter
 *                and the client's writer; pausing the upstream is the subclass's.
 *   SseFilter    base of _relay.UsageEventFilter: splits whole SSE events off and passes
 *                those without a marker; marked events go to the subclass's _marked; an
 *                event past max_event_bytes passes unheld (rule 5).
 *   ClientSink   base of _relay.ClientStream: frames a piece for the client's chunked
 *                answer and writes it to the transport (or holds it until live).
 *
 * Rules:
 * 1. A piece goes from the upstream's data_received to the client's transport.write
 *    without a Python frame when the types on the way are these (a BodyFraming whose
 *    on_piece is a Tee whose filter is a SseFilter and whose out is a ClientSink); any
 *    other callable, filter or writer is called as Python.
 * 2. What happens once per answer (the head, the end, a failure, a pause) calls back into
 *    the Python subclass by method name: _outside_body, _end_body, _malformed, _hold,
 *    _stop_reading, _marked, go_live.
 * 3. Chunk sizes are at most 16 hex digits and below 2**63 (else "bad chunk size").
 * 4. The capture's common case is done here, on the slots of the Capture the Tee was given:
 *    a piece that fits under max_bytes of a capture not truncated is appended as
 *    Capture.add_chunk appends it (its time while under max_chunk_times, its length to
 *    total_bytes, its bytes to body). Anything else (truncation, no Capture, a slot that is
 *    not what the class declares) calls capture_add. Why: the call was ~7 % of the
 *    gateway's CPU per chunk in bench/proxy.py's stream scenario (an A/B with the call
 *    left out), for a few lines of bookkeeping. tests/gateway/test_relaycore.py holds the
 *    two to the same result.
 * 5. SseFilter holds at most max_event_bytes (_relay.MAX_EVENT_BYTES) of an unfinished event;
 *    one that outgrows it is counted (``oversized``) and passed on unheld, the events held
 *    before it first, the rest of it as it comes, until its blank line ends it and holding
 *    resumes with the next event (an event whole within one read, which the transport's
 *    read size bounds, is judged whole, as before). Each byte is searched for a blank line
 *    once (the pending bytes hold none: only a pair split between two reads is checked,
 *    with the byte before), and copied into the pending buffer at most once. Why: the whole
 *    pending event was copied and searched again on every read, so an 8 MiB event in 4 KiB
 *    reads cost 10-17 s of CPU (0.02 s now), and the pending bytes grew with whatever a
 *    backend sent without a blank line. tests/gateway/test_relay_sse_bound.py holds it to
 *    the old search, with the bound, on every split.
 * 6. A blank line whose read ends at a CR ends its event there (the LF, if it comes, begins
 *    the next read). When that event is the usage event the filter drops, ``_skip_lf`` (set
 *    by _relay.UsageEventFilter._marked) drops that LF too, wherever it comes: the client
 *    gets every other byte as it came, whatever the split. Why: the LF went to the client
 *    after the terminal event (\r\n\r\n\n), and an LF cut off the event before the usage
 *    event was dropped with it (\r\n\r); tests/gateway/test_fuzz_relay_units.py cuts
 *    everywhere around it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#define MAX_CHUNK_LINE_BYTES 4096
#define MAX_TRAILER_BYTES (64 * 1024)

enum { F_NONE = 0, F_LENGTH = 1, F_CHUNKED = 2, F_UNTIL_CLOSE = 3 };
enum { C_SIZE = 0, C_DATA = 1, C_DATA_END = 2, C_TRAILER = 3 };

static PyObject *s_outside_body, *s_end_body, *s_malformed, *s_hold, *s_stop_reading,
    *s_marked, *s_go_live, *s_write, *s_is_closing, *s_paused, *s_feed, *s_empty;

static PyTypeObject TeeType, SseFilterType, ClientSinkType;

/* ---------------------------------------------------------------- ClientSink */

typedef struct {
    PyObject_HEAD
    PyObject *transport;
    PyObject *protocol;
    PyObject *held;  /* list while not live, else None */
    Py_ssize_t held_bytes;
    Py_ssize_t max_held;
    char chunked;
} ClientSink;

/* The client's protocol past its high-water mark, or its transport closing: -1 on error. */
static int
sink_behind(ClientSink *self)
{
    PyObject *paused = PyObject_GetAttr(self->protocol, s_paused);
    if (paused == NULL)
        return -1;
    int behind = PyObject_IsTrue(paused);
    Py_DECREF(paused);
    if (behind)
        return behind;
    PyObject *closing = PyObject_CallMethodNoArgs(self->transport, s_is_closing);
    if (closing == NULL)
        return -1;
    behind = PyObject_IsTrue(closing);
    Py_DECREF(closing);
    return behind;
}

/* ``n`` as a chunk-size line (lower-case hex, CRLF) in ``line``; its length. By hand, not
 * snprintf: glibc's printf machinery was ~1 % of the gateway's CPU in the stream scenario
 * (perf, issue 15), for a line written once per chunk. */
static int
size_line(char line[24], size_t n)
{
    char digits[16];
    int count = 0;
    do {
        digits[count++] = "0123456789abcdef"[n & 0xf];
        n >>= 4;
    } while (n != 0);
    for (int i = 0; i < count; i++)
        line[i] = digits[count - 1 - i];
    line[count] = '\r';
    line[count + 1] = '\n';
    return count + 2;
}

/* Write ``piece`` on: 1 when the client is behind (or gone), 0 if not, -1 on error. */
static int
sink_write(ClientSink *self, PyObject *piece)
{
    if (self->held != NULL && self->held != Py_None) {
        if (PyList_Append(self->held, piece) < 0)
            return -1;
        self->held_bytes += PyBytes_GET_SIZE(piece);
        if (self->held_bytes <= self->max_held)
            return 0;
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, s_go_live);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        return sink_behind(self);
    }
    PyObject *r;
    if (self->chunked) {
        Py_ssize_t n = PyBytes_GET_SIZE(piece);
        char line[24];
        int len = size_line(line, (size_t)n);
        PyObject *frame = PyBytes_FromStringAndSize(NULL, len + n + 2);
        if (frame == NULL)
            return -1;
        char *p = PyBytes_AS_STRING(frame);
        memcpy(p, line, len);
        memcpy(p + len, PyBytes_AS_STRING(piece), n);
        memcpy(p + len + n, "\r\n", 2);
        r = PyObject_CallMethodOneArg(self->transport, s_write, frame);
        Py_DECREF(frame);
    }
    else {
        r = PyObject_CallMethodOneArg(self->transport, s_write, piece);
    }
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return sink_behind(self);
}

static PyObject *
ClientSink_write(ClientSink *self, PyObject *piece)
{
    if (!PyBytes_Check(piece)) {
        PyErr_SetString(PyExc_TypeError, "write() takes bytes");
        return NULL;
    }
    int behind = sink_write(self, piece);
    if (behind < 0)
        return NULL;
    return PyBool_FromLong(behind);
}

static int
ClientSink_init(ClientSink *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"transport", "protocol", "chunked", "max_held", NULL};
    PyObject *transport, *protocol;
    int chunked;
    Py_ssize_t max_held;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOpn", kwlist, &transport, &protocol,
                                     &chunked, &max_held))
        return -1;
    PyObject *held = PyList_New(0);
    if (held == NULL)
        return -1;
    Py_INCREF(transport);
    Py_INCREF(protocol);
    Py_XSETREF(self->transport, transport);
    Py_XSETREF(self->protocol, protocol);
    Py_XSETREF(self->held, held);
    self->held_bytes = 0;
    self->max_held = max_held;
    self->chunked = (char)chunked;
    return 0;
}

static int
ClientSink_traverse(ClientSink *self, visitproc visit, void *arg)
{
    Py_VISIT(self->transport);
    Py_VISIT(self->protocol);
    Py_VISIT(self->held);
    return 0;
}

static int
ClientSink_clear(ClientSink *self)
{
    Py_CLEAR(self->transport);
    Py_CLEAR(self->protocol);
    Py_CLEAR(self->held);
    return 0;
}

static void
ClientSink_dealloc(ClientSink *self)
{
    PyObject_GC_UnTrack(self);
    ClientSink_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
ClientSink_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    ClientSink *self = (ClientSink *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(Py_None);
    self->held = Py_None;
    Py_INCREF(Py_None);
    self->transport = Py_None;
    Py_INCREF(Py_None);
    self->protocol = Py_None;
    return (PyObject *)self;
}

static PyMethodDef ClientSink_methods[] = {
    {"write", (PyCFunction)ClientSink_write, METH_O,
     "Write a piece on; True when the client is past its high-water mark (or gone)."},
    {NULL}};

static PyMemberDef ClientSink_members[] = {
    {"_transport", T_OBJECT_EX, offsetof(ClientSink, transport), READONLY, NULL},
    {"_protocol", T_OBJECT_EX, offsetof(ClientSink, protocol), READONLY, NULL},
    {"_held", T_OBJECT_EX, offsetof(ClientSink, held), 0,
     "the pieces held until the answer goes live (a list), or None once live"},
    {"_held_bytes", T_PYSSIZET, offsetof(ClientSink, held_bytes), 0, NULL},
    {"_chunked", T_BOOL, offsetof(ClientSink, chunked), READONLY, NULL},
    {NULL}};

static PyTypeObject ClientSinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway._relaycore.ClientSink",
    .tp_basicsize = sizeof(ClientSink),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The client's transport: pieces framed and written, or held until live.",
    .tp_new = ClientSink_new,
    .tp_init = (initproc)ClientSink_init,
    .tp_dealloc = (destructor)ClientSink_dealloc,
    .tp_traverse = (traverseproc)ClientSink_traverse,
    .tp_clear = (inquiry)ClientSink_clear,
    .tp_methods = ClientSink_methods,
    .tp_members = ClientSink_members,
};

/* ---------------------------------------------------------------- SseFilter */

/* The capacity of the pending buffer that is kept once it holds no more than that: an
 * event that needed more (up to max_event) gives its memory back when it ends, so an idle
 * stream holds little beyond its unfinished event. */
#define SSE_KEPT_CAPACITY 4096

typedef struct {
    PyObject_HEAD
    char *pending;          /* the bytes after the last whole event (PyMem), no blank line */
    Py_ssize_t npending;
    Py_ssize_t cap;
    Py_ssize_t max_event;   /* the most of an unfinished event held (rule 5); 0: none */
    Py_ssize_t oversized;   /* events passed on unheld for outgrowing max_event */
    Py_ssize_t scanned;     /* bytes handed to the blank-line search, in all */
    PyObject *held;         /* list of held events */
    char done;
    char passing;           /* inside an event that outgrew max_event: it passes on */
    char last;              /* while passing: the last byte passed on */
    char skip_lf;           /* rule 6: the next byte, if an LF, is the dropped event's */
} SseFilter;

static int
has_marker(const char *p, Py_ssize_t n)
{
    static const char *markers[] = {"\"choices\":[]", "\"choices\": []",
                                    "\"finish_reason\":\"", "\"finish_reason\": \""};
    for (size_t i = 0; i < sizeof markers / sizeof markers[0]; i++)
        if (memmem(p, (size_t)n, markers[i], strlen(markers[i])) != NULL)
            return 1;
    return 0;
}

/* ``a`` then ``b`` as one bytes object (a new reference). */
static PyObject *
joined(const char *a, Py_ssize_t na, const char *b, Py_ssize_t nb)
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, na + nb);
    if (out == NULL)
        return NULL;
    if (na)
        memcpy(PyBytes_AS_STRING(out), a, na);
    if (nb)
        memcpy(PyBytes_AS_STRING(out) + na, b, nb);
    return out;
}

static PyObject *
concat(PyObject *a, PyObject *b)
{
    return joined(PyBytes_AS_STRING(a), PyBytes_GET_SIZE(a),
                  PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b));
}

/* A blank line is two line ends in a row, each CRLF, LF or CR (the SSE grammar: vLLM
 * writes \n\n, sse-starlette \r\n\r\n), so it holds one of the pairs LF LF, CR CR, LF CR,
 * and each such pair is one (a CR then LF is one line end). */
static inline int
is_blank_pair(char a, char b)
{
    return (a == '\n' && (b == '\n' || b == '\r')) || (a == '\r' && b == '\r');
}

/* Where the blank line whose pair ends at p[i] ends: a CR ending the pair takes the LF after
 * it when that came; one still to come begins the next event, which changes no event. */
static inline Py_ssize_t
pair_end(const char *p, Py_ssize_t n, Py_ssize_t i)
{
    return i + 1 + (p[i] == '\r' && i + 1 < n && p[i + 1] == '\n');
}

/* Where the last whole event of ``p`` ends (past its blank line), or -1. ``before`` is the
 * byte before ``p`` (the pending bytes' last, or 0): a pair may straddle two reads. */
static Py_ssize_t
last_event_end(const char *p, Py_ssize_t n, char before)
{
    for (Py_ssize_t i = n - 1; i >= 1; i--)
        if (is_blank_pair(p[i - 1], p[i]))
            return pair_end(p, n, i);
    if (n > 0 && is_blank_pair(before, p[0]))
        return pair_end(p, n, 0);
    return -1;
}

/* Where the first blank line of ``p`` ends, or -1; ``before`` as for last_event_end. */
static Py_ssize_t
first_event_end(const char *p, Py_ssize_t n, char before)
{
    if (n > 0 && is_blank_pair(before, p[0]))
        return pair_end(p, n, 0);
    for (Py_ssize_t i = 1; i < n; i++)
        if (is_blank_pair(p[i - 1], p[i]))
            return pair_end(p, n, i);
    return -1;
}

static void
pending_clear(SseFilter *self)
{
    self->npending = 0;
    if (self->cap > SSE_KEPT_CAPACITY) {
        PyMem_Free(self->pending);
        self->pending = NULL;
        self->cap = 0;
    }
}

/* Append ``p`` to the pending bytes, growing their buffer by doubling: each byte is copied
 * in once, however many reads an event takes. */
static int
pending_append(SseFilter *self, const char *p, Py_ssize_t n)
{
    Py_ssize_t need = self->npending + n;
    if (need > self->cap) {
        Py_ssize_t cap = self->cap < 256 ? 256 : self->cap;
        while (cap < need)
            cap = cap > PY_SSIZE_T_MAX / 2 ? need : cap * 2;
        if (cap > self->max_event && need <= self->max_event)
            cap = self->max_event;
        char *buf = PyMem_Realloc(self->pending, (size_t)cap);
        if (buf == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->pending = buf;
        self->cap = cap;
    }
    if (n)
        memcpy(self->pending + self->npending, p, n);
    self->npending = need;
    return 0;
}

/* An unfinished event has outgrown max_event (rule 5): the held events, the pending bytes and
 * ``p`` (its latest bytes, n > 0) to pass on now, and the rest of it as it comes. */
static PyObject *
give_up(SseFilter *self, const char *p, Py_ssize_t n)
{
    Py_ssize_t nheld = PyList_GET_SIZE(self->held), total = self->npending + n;
    for (Py_ssize_t i = 0; i < nheld; i++) {
        PyObject *event = PyList_GET_ITEM(self->held, i);
        if (!PyBytes_Check(event)) {
            PyErr_SetString(PyExc_TypeError, "held events are bytes");
            return NULL;
        }
        total += PyBytes_GET_SIZE(event);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    char *q = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < nheld; i++) {
        PyObject *event = PyList_GET_ITEM(self->held, i);
        memcpy(q, PyBytes_AS_STRING(event), PyBytes_GET_SIZE(event));
        q += PyBytes_GET_SIZE(event);
    }
    if (self->npending)
        memcpy(q, self->pending, self->npending);
    memcpy(q + self->npending, p, n);
    if (nheld && PyList_SetSlice(self->held, 0, nheld, NULL) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    pending_clear(self);
    self->passing = 1;
    self->last = p[n - 1];
    self->oversized++;
    return out;
}

/* Rule 6: the dropped usage event's blank line ended its read at a CR, so an LF that
 * begins the pending bytes is the rest of that line end, not the next event's. */
static void
pending_skip_lf(SseFilter *self)
{
    if (!self->skip_lf || self->npending == 0)
        return;
    self->skip_lf = 0;
    if (self->pending[0] == '\n')
        memmove(self->pending, self->pending + 1, (size_t)--self->npending);
}

/* The same for bytes not held: 1 when p[0] is that LF, to be passed over. */
static Py_ssize_t
skipped_lf(SseFilter *self, const char *p, Py_ssize_t n)
{
    if (!self->skip_lf || n == 0)
        return 0;
    self->skip_lf = 0;
    return p[0] == '\n';
}

/* What to write for chunk[off:] outside an event that outgrew max_event. */
static PyObject *
filter_scan(SseFilter *self, PyObject *chunk, Py_ssize_t off)
{
    const char *p = PyBytes_AS_STRING(chunk) + off;
    Py_ssize_t n = PyBytes_GET_SIZE(chunk) - off, npending = self->npending;
    /* Only the new bytes are searched: the pending ones hold no blank line (rule 5). */
    Py_ssize_t cut = last_event_end(p, n, npending ? self->pending[npending - 1] : 0);
    self->scanned += n;
    if (cut < 0) {
        if (npending + n <= self->max_event)
            return pending_append(self, p, n) < 0 ? NULL : Py_NewRef(s_empty);
        return give_up(self, p, n);
    }
    PyObject *complete = npending == 0 && off == 0 && cut == n
        ? Py_NewRef(chunk) : joined(self->pending, npending, p, cut);
    if (complete == NULL)
        return NULL;
    pending_clear(self);
    Py_ssize_t nrest = n - cut;
    int over = nrest > self->max_event;
    if (!over && pending_append(self, p + cut, nrest) < 0) {
        Py_DECREF(complete);
        return NULL;
    }
    PyObject *out;
    if (PyList_GET_SIZE(self->held) == 0
            && !has_marker(PyBytes_AS_STRING(complete), PyBytes_GET_SIZE(complete))) {
        out = complete;
    }
    else {
        out = PyObject_CallMethodOneArg((PyObject *)self, s_marked, complete);
        Py_DECREF(complete);
    }
    if (out == NULL)
        return NULL;
    pending_skip_lf(self);
    if (!over)
        return out;
    if (!PyBytes_Check(out)) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_TypeError, "_marked returns bytes");
        return NULL;
    }
    /* After the usage event everything passes (the done branch): nothing is given up. */
    Py_ssize_t skip = self->done ? skipped_lf(self, p + cut, nrest) : 0;
    PyObject *rest = self->done ? joined(p + cut + skip, nrest - skip, NULL, 0)
                                : give_up(self, p + cut, nrest);
    if (rest == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    Py_SETREF(out, concat(out, rest));
    Py_DECREF(rest);
    return out;
}

/* What to write for ``chunk`` (a new reference; b"" to write nothing yet). */
static PyObject *
filter_feed(SseFilter *self, PyObject *chunk)
{
    if (!PyBytes_Check(chunk)) {
        PyErr_SetString(PyExc_TypeError, "feed() takes bytes");
        return NULL;
    }
    const char *p = PyBytes_AS_STRING(chunk);
    Py_ssize_t n = PyBytes_GET_SIZE(chunk);
    if (self->done) {
        pending_skip_lf(self);
        Py_ssize_t skip = skipped_lf(self, p, n);
        if (self->npending == 0)
            return skip ? PyBytes_FromStringAndSize(p + 1, n - 1) : Py_NewRef(chunk);
        PyObject *out = joined(self->pending, self->npending, p + skip, n - skip);
        if (out != NULL)
            pending_clear(self);
        return out;
    }
    if (!self->passing)
        return filter_scan(self, chunk, 0);
    /* Inside an event past max_event: it passes as it comes, up to its blank line. */
    Py_ssize_t end = first_event_end(p, n, self->last);
    self->scanned += end < 0 ? n : end;
    if (end < 0) {
        if (n)
            self->last = p[n - 1];
        return Py_NewRef(chunk);
    }
    self->passing = 0;
    if (end == n)
        return Py_NewRef(chunk);
    PyObject *rest = filter_scan(self, chunk, end);
    if (rest == NULL)
        return NULL;
    if (!PyBytes_Check(rest)) {
        Py_DECREF(rest);
        PyErr_SetString(PyExc_TypeError, "_marked returns bytes");
        return NULL;
    }
    PyObject *out = joined(p, end, PyBytes_AS_STRING(rest), PyBytes_GET_SIZE(rest));
    Py_DECREF(rest);
    return out;
}

static int
SseFilter_traverse(SseFilter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->held);
    return 0;
}

static int
SseFilter_clear(SseFilter *self)
{
    Py_CLEAR(self->held);
    return 0;
}

static void
SseFilter_dealloc(SseFilter *self)
{
    PyObject_GC_UnTrack(self);
    SseFilter_clear(self);
    PyMem_Free(self->pending);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
SseFilter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    SseFilter *self = (SseFilter *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->held = PyList_New(0);
    if (self->held == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
SseFilter_init(SseFilter *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_event_bytes", NULL};
    Py_ssize_t max_event;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &max_event))
        return -1;
    if (max_event < 1) {
        PyErr_SetString(PyExc_ValueError, "max_event_bytes is at least 1");
        return -1;
    }
    self->max_event = max_event;
    return 0;
}

static int
SseFilter_setpending(SseFilter *self, PyObject *value, void *closure)
{
    if (value == NULL || !PyBytes_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "_pending is bytes");
        return -1;
    }
    pending_clear(self);
    return pending_append(self, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
}

static PyObject *
SseFilter_getpending(SseFilter *self, void *closure)
{
    return PyBytes_FromStringAndSize(self->pending, self->npending);
}

static int
SseFilter_setheld(SseFilter *self, PyObject *value, void *closure)
{
    if (value == NULL || !PyList_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "_held is a list");
        return -1;
    }
    Py_SETREF(self->held, Py_NewRef(value));
    return 0;
}

static PyObject *
SseFilter_getheld(SseFilter *self, void *closure)
{
    return Py_NewRef(self->held);
}

static PyGetSetDef SseFilter_getset[] = {
    {"_pending", (getter)SseFilter_getpending, (setter)SseFilter_setpending,
     "the bytes after the last whole event (a copy)", NULL},
    {"_held", (getter)SseFilter_getheld, (setter)SseFilter_setheld,
     "terminal events held back for the usage event's fingerprint", NULL},
    {NULL}};

static PyMemberDef SseFilter_members[] = {
    {"_done", T_BOOL, offsetof(SseFilter, done), 0, "the usage event was seen"},
    {"_skip_lf", T_BOOL, offsetof(SseFilter, skip_lf), 0,
     "the next byte, if an LF, ends the dropped usage event's blank line (rule 6)"},
    {"max_event_bytes", T_PYSSIZET, offsetof(SseFilter, max_event), READONLY,
     "the most of an unfinished event held"},
    {"oversized", T_PYSSIZET, offsetof(SseFilter, oversized), READONLY,
     "events passed on unheld, as they came, for outgrowing max_event_bytes"},
    {"_scanned", T_PYSSIZET, offsetof(SseFilter, scanned), READONLY,
     "bytes handed to the blank-line search, in all"},
    {NULL}};

static PyMethodDef SseFilter_methods[] = {
    {"feed", (PyCFunction)filter_feed, METH_O,
     "What to write for chunk; b'' to write nothing yet."},
    {NULL}};

static PyTypeObject SseFilterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway._relaycore.SseFilter",
    .tp_basicsize = sizeof(SseFilter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Whole SSE events passed on; marked ones to the subclass's _marked.",
    .tp_new = SseFilter_new,
    .tp_init = (initproc)SseFilter_init,
    .tp_dealloc = (destructor)SseFilter_dealloc,
    .tp_traverse = (traverseproc)SseFilter_traverse,
    .tp_clear = (inquiry)SseFilter_clear,
    .tp_methods = SseFilter_methods,
    .tp_members = SseFilter_members,
    .tp_getset = SseFilter_getset,
};

/* ---------------------------------------------------------------- BodyFraming */

typedef struct {
    PyObject_HEAD
    PyObject *on_piece;
    PyObject *buf;    /* bytes not yet decoded */
    PyObject *clock;  /* the loop's time() */
    double last_read;
    unsigned long long remaining;
    int framing;
    int chunk_state;
    char keep_alive;
    char in_body;
} BodyFraming;

/* The Capture slots rule 4 writes, in this order. */
enum { CAP_CHUNK_TIMES, CAP_MAX_CHUNK_TIMES, CAP_TOTAL_BYTES, CAP_TRUNCATED, CAP_BODY,
       CAP_MAX_BYTES, CAP_SLOTS };
static const char *capture_slot_names[CAP_SLOTS] = {
    "chunk_times", "max_chunk_times", "total_bytes", "truncated", "body", "max_bytes"};

typedef struct {
    PyObject_HEAD
    PyObject *conn;     /* a BodyFraming */
    PyObject *capture_add;
    PyObject *capture;  /* the Capture whose slots rule 4 writes, or NULL */
    Py_ssize_t capture_slots[CAP_SLOTS];  /* their offsets in the Capture */
    PyObject *out;      /* a ClientSink, another writer, or None */
    PyObject *filter;   /* a SseFilter, another filter, or None */
    PyObject *waiter;
    char paused;
} Tee;

static int tee_piece(Tee *self, PyObject *piece);

static int
deliver(BodyFraming *self, PyObject *piece)
{
    PyObject *on_piece = self->on_piece;
    if (on_piece == NULL || on_piece == Py_None) {
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, s_hold, piece);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    /* Held for the call: the callee may replace on_piece (or drop the last reference). */
    Py_INCREF(on_piece);
    int rc;
    if (PyObject_TypeCheck(on_piece, &TeeType)) {
        rc = tee_piece((Tee *)on_piece, piece);
    }
    else {
        PyObject *r = PyObject_CallOneArg(on_piece, piece);
        Py_XDECREF(r);
        rc = r == NULL ? -1 : 0;
    }
    Py_DECREF(on_piece);
    return rc;
}

static int
deliver_slice(BodyFraming *self, PyObject *data, Py_ssize_t start, Py_ssize_t end)
{
    if (start == 0 && end == PyBytes_GET_SIZE(data))
        return deliver(self, data);
    PyObject *piece = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + start, end - start);
    if (piece == NULL)
        return -1;
    int rc = deliver(self, piece);
    Py_DECREF(piece);
    return rc;
}

static PyObject *
call_self(BodyFraming *self, PyObject *name, PyObject *arg)
{
    return arg == NULL ? PyObject_CallMethodNoArgs((PyObject *)self, name)
                       : PyObject_CallMethodOneArg((PyObject *)self, name, arg);
}

static PyObject *
malformed(BodyFraming *self, const char *why)
{
    PyObject *msg = PyUnicode_FromString(why);
    if (msg == NULL)
        return NULL;
    PyObject *r = call_self(self, s_malformed, msg);
    Py_DECREF(msg);
    return r;
}

static PyObject *
end_body(BodyFraming *self)
{
    return call_self(self, s_end_body, NULL);
}

static int
parse_hex(const char *p, Py_ssize_t n, unsigned long long *out)
{
    const char *semi = memchr(p, ';', (size_t)n);
    if (semi != NULL)
        n = semi - p;
    while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == '\t'))
        n--;
    if (n < 1 || n > 16)
        return -1;
    unsigned long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        char c = p[i];
        int d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else
            return -1;
        v = (v << 4) | (unsigned long long)d;
    }
    if (v > (unsigned long long)PY_SSIZE_T_MAX)
        return -1;
    *out = v;
    return 0;
}

static const char *
find_crlf(const char *p, Py_ssize_t from, Py_ssize_t size)
{
    const char *s = p + from;
    Py_ssize_t left = size - from;
    while (left >= 2) {
        const char *cr = memchr(s, '\r', (size_t)(left - 1));
        if (cr == NULL)
            return NULL;
        if (cr[1] == '\n')
            return cr;
        left -= (cr + 1) - s;
        s = cr + 1;
    }
    return NULL;
}

static PyObject *
chunked(BodyFraming *self, PyObject *data)
{
    const char *p = PyBytes_AS_STRING(data);
    Py_ssize_t pos = 0, size = PyBytes_GET_SIZE(data);
    int state = self->chunk_state;
    while (pos < size) {
        if (state == C_DATA) {
            if ((unsigned long long)(size - pos) < self->remaining) {
                self->remaining -= (unsigned long long)(size - pos);
                self->chunk_state = state;
                if (deliver_slice(self, data, pos, size) < 0)
                    return NULL;
                pos = size;
                break;
            }
            Py_ssize_t end = pos + (Py_ssize_t)self->remaining;
            self->remaining = 0;
            self->chunk_state = state = C_DATA_END;
            if (end > pos && deliver_slice(self, data, pos, end) < 0)
                return NULL;
            pos = end;
        }
        else if (state == C_SIZE) {
            const char *eol = find_crlf(p, pos, size);
            if (eol == NULL) {
                if (size - pos > MAX_CHUNK_LINE_BYTES)
                    return malformed(self, "chunk size line too long");
                break;
            }
            unsigned long long n;
            if (parse_hex(p + pos, eol - (p + pos), &n) < 0)
                return malformed(self, "bad chunk size");
            self->remaining = n;
            pos = eol - p + 2;
            state = n ? C_DATA : C_TRAILER;
        }
        else if (state == C_DATA_END) {
            if (size - pos < 2)
                break;
            if (p[pos] != '\r' || p[pos + 1] != '\n')
                return malformed(self, "bad chunk end");
            pos += 2;
            state = C_SIZE;
        }
        else {  /* C_TRAILER: header lines until an empty one */
            const char *eol = find_crlf(p, pos, size);
            if (eol == NULL) {
                if (size - pos > MAX_TRAILER_BYTES)
                    return malformed(self, "trailers too large");
                break;
            }
            int empty = eol == p + pos;
            pos = eol - p + 2;
            if (empty) {
                if (pos < size)
                    self->keep_alive = 0;
                self->chunk_state = state;
                Py_SETREF(self->buf, Py_NewRef(s_empty));
                return end_body(self);
            }
        }
    }
    self->chunk_state = state;
    PyObject *rest = pos < size ? PyBytes_FromStringAndSize(p + pos, size - pos)
                                : Py_NewRef(s_empty);
    if (rest == NULL)
        return NULL;
    Py_SETREF(self->buf, rest);
    Py_RETURN_NONE;
}

/* The body's bytes (the head already parsed): decoded and delivered. */
static PyObject *
BodyFraming_body_received(BodyFraming *self, PyObject *data)
{
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "body_received() takes bytes");
        return NULL;
    }
    switch (self->framing) {
    case F_CHUNKED: {
        PyObject *whole = PyBytes_GET_SIZE(self->buf) ? concat(self->buf, data)
                                                       : Py_NewRef(data);
        if (whole == NULL)
            return NULL;
        PyObject *r = chunked(self, whole);
        Py_DECREF(whole);
        return r;
    }
    case F_LENGTH: {
        Py_ssize_t n = PyBytes_GET_SIZE(data);
        if ((unsigned long long)n >= self->remaining) {
            Py_ssize_t take = (Py_ssize_t)self->remaining;
            if (n > take)  /* bytes past the declared end: not reusable */
                self->keep_alive = 0;
            self->remaining = 0;
            if (take && deliver_slice(self, data, 0, take) < 0)
                return NULL;
            return end_body(self);
        }
        self->remaining -= (unsigned long long)n;
        if (deliver(self, data) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    case F_UNTIL_CLOSE:
        if (PyBytes_GET_SIZE(data) && deliver(self, data) < 0)
            return NULL;
        Py_RETURN_NONE;
    default:
        self->keep_alive = 0;  /* bytes after a body-less answer */
        return end_body(self);
    }
}

static PyObject *
BodyFraming_data_received(BodyFraming *self, PyObject *data)
{
    if (self->clock == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_time");
        return NULL;
    }
    PyObject *now = PyObject_CallNoArgs(self->clock);
    if (now == NULL)
        return NULL;
    self->last_read = PyFloat_AsDouble(now);
    Py_DECREF(now);
    if (self->last_read == -1.0 && PyErr_Occurred())
        return NULL;
    if (!self->in_body)
        return call_self(self, s_outside_body, data);
    return BodyFraming_body_received(self, data);
}

static int
BodyFraming_traverse(BodyFraming *self, visitproc visit, void *arg)
{
    Py_VISIT(self->on_piece);
    Py_VISIT(self->buf);
    Py_VISIT(self->clock);
    return 0;
}

static int
BodyFraming_clear(BodyFraming *self)
{
    Py_CLEAR(self->on_piece);
    Py_CLEAR(self->buf);
    Py_CLEAR(self->clock);
    return 0;
}

static void
BodyFraming_dealloc(BodyFraming *self)
{
    PyObject_GC_UnTrack(self);
    BodyFraming_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
BodyFraming_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    BodyFraming *self = (BodyFraming *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->on_piece = Py_NewRef(Py_None);
    self->buf = Py_NewRef(s_empty);
    self->clock = Py_NewRef(Py_None);
    return (PyObject *)self;
}

static int
BodyFraming_setbuf(BodyFraming *self, PyObject *value, void *closure)
{
    if (value == NULL || !PyBytes_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "_buf is bytes");
        return -1;
    }
    Py_SETREF(self->buf, Py_NewRef(value));
    return 0;
}

static PyObject *
BodyFraming_getbuf(BodyFraming *self, void *closure)
{
    return Py_NewRef(self->buf);
}

static PyGetSetDef BodyFraming_getset[] = {
    {"_buf", (getter)BodyFraming_getbuf, (setter)BodyFraming_setbuf,
     "bytes read and not yet decoded", NULL},
    {NULL}};

static PyMemberDef BodyFraming_members[] = {
    {"on_piece", T_OBJECT, offsetof(BodyFraming, on_piece), 0,
     "where each piece of body goes (None: held by _hold)"},
    {"_time", T_OBJECT, offsetof(BodyFraming, clock), 0, "the loop's clock"},
    {"last_read", T_DOUBLE, offsetof(BodyFraming, last_read), 0,
     "the loop's time at the last bytes read"},
    {"_remaining", T_ULONGLONG, offsetof(BodyFraming, remaining), 0,
     "bytes left of the body (Content-Length) or of the chunk"},
    {"_framing", T_INT, offsetof(BodyFraming, framing), 0, NULL},
    {"_chunk_state", T_INT, offsetof(BodyFraming, chunk_state), 0, NULL},
    {"_keep_alive", T_BOOL, offsetof(BodyFraming, keep_alive), 0, NULL},
    {"_in_body", T_BOOL, offsetof(BodyFraming, in_body), 0,
     "the head is parsed and the body not ended: data_received decodes here"},
    {NULL}};

static PyMethodDef BodyFraming_methods[] = {
    {"data_received", (PyCFunction)BodyFraming_data_received, METH_O,
     "asyncio.Protocol.data_received: the body decoded here, else _outside_body."},
    {"body_received", (PyCFunction)BodyFraming_body_received, METH_O,
     "Decode body bytes and deliver each piece to on_piece."},
    {NULL}};

static PyTypeObject BodyFramingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway._relaycore.BodyFraming",
    .tp_basicsize = sizeof(BodyFraming),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An upstream connection's body framing, decoded in data_received.",
    .tp_new = BodyFraming_new,
    .tp_dealloc = (destructor)BodyFraming_dealloc,
    .tp_traverse = (traverseproc)BodyFraming_traverse,
    .tp_clear = (inquiry)BodyFraming_clear,
    .tp_methods = BodyFraming_methods,
    .tp_members = BodyFraming_members,
    .tp_getset = BodyFraming_getset,
};

/* ---------------------------------------------------------------- Tee */

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

/* Rule 4: 1 when the piece was captured here, 0 when capture_add must do it, -1 on error. */
static int
capture_here(Tee *self, PyObject *now, PyObject *piece)
{
    PyObject *capture = self->capture;
    const Py_ssize_t *at = self->capture_slots;
    PyObject *times = SLOT(capture, at[CAP_CHUNK_TIMES]);
    PyObject *max_times = SLOT(capture, at[CAP_MAX_CHUNK_TIMES]);
    PyObject *total = SLOT(capture, at[CAP_TOTAL_BYTES]);
    PyObject *body = SLOT(capture, at[CAP_BODY]);
    PyObject *max_bytes = SLOT(capture, at[CAP_MAX_BYTES]);
    if (SLOT(capture, at[CAP_TRUNCATED]) != Py_False || times == NULL
            || !PyList_CheckExact(times) || max_times == NULL || !PyLong_CheckExact(max_times)
            || total == NULL || !PyLong_CheckExact(total) || body == NULL
            || !PyByteArray_CheckExact(body) || max_bytes == NULL
            || !PyLong_CheckExact(max_bytes))
        return 0;
    Py_ssize_t n = PyBytes_GET_SIZE(piece), held = PyByteArray_GET_SIZE(body);
    Py_ssize_t limit = PyLong_AsSsize_t(max_bytes);
    Py_ssize_t count_limit = PyLong_AsSsize_t(max_times);
    Py_ssize_t sum = PyLong_AsSsize_t(total);
    if ((limit == -1 || count_limit == -1 || sum == -1) && PyErr_Occurred()) {
        PyErr_Clear();  /* beyond a Py_ssize_t: Python's arithmetic, in add_chunk */
        return 0;
    }
    if (held + n > limit || sum > PY_SSIZE_T_MAX - n)
        return 0;  /* the truncation (or an absurd total): add_chunk's */
    if (PyList_GET_SIZE(times) < count_limit && PyList_Append(times, now) < 0)
        return -1;
    PyObject *new_total = PyLong_FromSsize_t(sum + n);
    if (new_total == NULL)
        return -1;
    Py_SETREF(SLOT(capture, at[CAP_TOTAL_BYTES]), new_total);
    if (PyByteArray_Resize(body, held + n) < 0)
        return -1;
    memcpy(PyByteArray_AS_STRING(body) + held, PyBytes_AS_STRING(piece), (size_t)n);
    return 1;
}

/* The class find_capture_slots found last, and its offsets: the same class every answer, so
 * its six lookups (~0.9 us) are done once, not per request (a strong reference, so that the
 * address cannot be another class's while cached). */
static PyTypeObject *slots_class;
static Py_ssize_t slots_of_class[CAP_SLOTS];

/* Where rule 4 finds the slots of ``capture``'s class: each a slot (a member descriptor
 * holding an object); 0 when one is not, -1 on error. */
static int
find_capture_slots(PyObject *capture, Py_ssize_t *at)
{
    PyTypeObject *type = Py_TYPE(capture);
    if (type == slots_class) {
        memcpy(at, slots_of_class, sizeof(slots_of_class));
        return 1;
    }
    for (int i = 0; i < CAP_SLOTS; i++) {
        PyObject *descr = PyObject_GetAttrString((PyObject *)type, capture_slot_names[i]);
        if (descr == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
            return 0;
        }
        int slot = Py_IS_TYPE(descr, &PyMemberDescr_Type);
        if (slot) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            slot = member->type == T_OBJECT_EX && !(member->flags & READONLY);
            at[i] = member->offset;
        }
        Py_DECREF(descr);
        if (!slot)
            return 0;
    }
    Py_INCREF(type);
    Py_XSETREF(slots_class, type);
    memcpy(slots_of_class, at, sizeof(slots_of_class));
    return 1;
}

static int
tee_piece(Tee *self, PyObject *piece)
{
    double last_read = PyObject_TypeCheck(self->conn, &BodyFramingType)
                           ? ((BodyFraming *)self->conn)->last_read : 0.0;
    PyObject *now = PyFloat_FromDouble(last_read);
    if (now == NULL)
        return -1;
    int captured = self->capture != NULL ? capture_here(self, now, piece) : 0;
    PyObject *r;
    if (captured == 0) {
        PyObject *args[2] = {now, piece};
        PyObject *capture_add = Py_NewRef(self->capture_add);
        r = PyObject_Vectorcall(capture_add, args, 2, NULL);
        Py_DECREF(capture_add);
        if (r == NULL)
            captured = -1;
        else
            Py_DECREF(r);
    }
    Py_DECREF(now);
    if (captured < 0)
        return -1;
    PyObject *out = self->out, *filter = self->filter;
    if (out == NULL || out == Py_None)
        return 0;
    /* Held for the calls: Python code on the way may replace them. */
    Py_INCREF(out);
    PyObject *filtered;
    if (filter == NULL || filter == Py_None) {
        filtered = Py_NewRef(piece);
    }
    else {
        Py_INCREF(filter);
        if (PyObject_TypeCheck(filter, &SseFilterType))
            filtered = filter_feed((SseFilter *)filter, piece);
        else
            filtered = PyObject_CallMethodOneArg(filter, s_feed, piece);
        Py_DECREF(filter);
    }
    if (filtered == NULL || !PyBytes_Check(filtered) || PyBytes_GET_SIZE(filtered) == 0) {
        if (filtered != NULL && !PyBytes_Check(filtered))
            PyErr_SetString(PyExc_TypeError, "a chunk filter returns bytes");
        int rc = (filtered == NULL || !PyBytes_Check(filtered)) ? -1 : 0;
        Py_XDECREF(filtered);
        Py_DECREF(out);
        return rc;
    }
    int behind;
    if (PyObject_TypeCheck(out, &ClientSinkType)) {
        behind = sink_write((ClientSink *)out, filtered);
    }
    else {
        r = PyObject_CallMethodOneArg(out, s_write, filtered);
        behind = r == NULL ? -1 : PyObject_IsTrue(r);
        Py_XDECREF(r);
    }
    Py_DECREF(filtered);
    Py_DECREF(out);
    if (behind <= 0)
        return behind;
    if (self->paused)
        return 0;
    r = PyObject_CallMethodNoArgs((PyObject *)self, s_stop_reading);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static PyObject *
Tee_piece(Tee *self, PyObject *piece)
{
    if (!PyBytes_Check(piece)) {
        PyErr_SetString(PyExc_TypeError, "piece() takes bytes");
        return NULL;
    }
    if (tee_piece(self, piece) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Tee_call(Tee *self, PyObject *args, PyObject *kwds)
{
    PyObject *piece;
    if (!PyArg_ParseTuple(args, "S:Tee", &piece))
        return NULL;
    return Tee_piece(self, piece);
}

static int
Tee_init(Tee *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"conn", "capture_add", "out", "chunk_filter", "capture", NULL};
    PyObject *conn, *capture_add, *out, *filter, *capture = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|O", kwlist, &conn, &capture_add, &out,
                                     &filter, &capture))
        return -1;
    Py_CLEAR(self->capture);
    if (capture != Py_None) {
        int found = find_capture_slots(capture, self->capture_slots);
        if (found < 0)
            return -1;
        if (found)
            self->capture = Py_NewRef(capture);
    }
    Py_XSETREF(self->conn, Py_NewRef(conn));
    Py_XSETREF(self->capture_add, Py_NewRef(capture_add));
    Py_XSETREF(self->out, Py_NewRef(out));
    Py_XSETREF(self->filter, Py_NewRef(filter));
    Py_XSETREF(self->waiter, Py_NewRef(Py_None));
    self->paused = 0;
    return 0;
}

static int
Tee_traverse(Tee *self, visitproc visit, void *arg)
{
    Py_VISIT(self->conn);
    Py_VISIT(self->capture_add);
    Py_VISIT(self->capture);
    Py_VISIT(self->out);
    Py_VISIT(self->filter);
    Py_VISIT(self->waiter);
    return 0;
}

static int
Tee_clear(Tee *self)
{
    Py_CLEAR(self->conn);
    Py_CLEAR(self->capture_add);
    Py_CLEAR(self->capture);
    Py_CLEAR(self->out);
    Py_CLEAR(self->filter);
    Py_CLEAR(self->waiter);
    return 0;
}

static void
Tee_dealloc(Tee *self)
{
    PyObject_GC_UnTrack(self);
    Tee_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Tee_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Tee *self = (Tee *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->conn = Py_NewRef(Py_None);
    self->capture_add = Py_NewRef(Py_None);
    self->out = Py_NewRef(Py_None);
    self->filter = Py_NewRef(Py_None);
    self->waiter = Py_NewRef(Py_None);
    return (PyObject *)self;
}

static PyMemberDef Tee_members[] = {
    {"_conn", T_OBJECT, offsetof(Tee, conn), READONLY, NULL},
    {"_out", T_OBJECT, offsetof(Tee, out), 0, "the client's writer (None: gone)"},
    {"_filter", T_OBJECT, offsetof(Tee, filter), READONLY, NULL},
    {"paused", T_BOOL, offsetof(Tee, paused), 0,
     "the upstream stopped reading for a slow client"},
    {"waiter", T_OBJECT, offsetof(Tee, waiter), 0, "what the reading task awaits"},
    {NULL}};

static PyMethodDef Tee_methods[] = {
    {"piece", (PyCFunction)Tee_piece, METH_O,
     "One piece of body: to the capture, the filter and the client."},
    {NULL}};

static PyTypeObject TeeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway._relaycore.Tee",
    .tp_basicsize = sizeof(Tee),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Each piece of an upstream body: to the capture, the filter and the client.",
    .tp_new = Tee_new,
    .tp_init = (initproc)Tee_init,
    .tp_call = (ternaryfunc)Tee_call,
    .tp_dealloc = (destructor)Tee_dealloc,
    .tp_traverse = (traverseproc)Tee_traverse,
    .tp_clear = (inquiry)Tee_clear,
    .tp_methods = Tee_methods,
    .tp_members = Tee_members,
};

/* ---------------------------------------------------------------- module */

static struct PyModuleDef relaycore_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gateway._relaycore",
    .m_doc = "The relay's per-chunk byte path in C (issue 15).",
    .m_size = -1,
};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC
PyInit__relaycore(void)
{
    INTERN(s_outside_body, "_outside_body");
    INTERN(s_end_body, "_end_body");
    INTERN(s_malformed, "_malformed");
    INTERN(s_hold, "_hold");
    INTERN(s_stop_reading, "_stop_reading");
    INTERN(s_marked, "_marked");
    INTERN(s_go_live, "go_live");
    INTERN(s_write, "write");
    INTERN(s_is_closing, "is_closing");
    INTERN(s_paused, "_paused");
    INTERN(s_feed, "feed");
    if ((s_empty = PyBytes_FromStringAndSize(NULL, 0)) == NULL)
        return NULL;
    PyTypeObject *types[] = {&BodyFramingType, &TeeType, &SseFilterType, &ClientSinkType};
    const char *names[] = {"BodyFraming", "Tee", "SseFilter", "ClientSink"};
    PyObject *m = PyModule_Create(&relaycore_module);
    if (m == NULL)
        return NULL;
    for (int i = 0; i < 4; i++) {
        if (PyType_Ready(types[i]) < 0 || PyModule_AddObjectRef(m, names[i],
                                                                (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
