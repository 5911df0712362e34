/* backends.engine.kv.codecs._e8core: the E8 codebook search of _e8.py in C (issue 14).
 *
 * The rules are _e8.py's (its module comment, rules 1-4); this file is their arithmetic, one
 * row of 8 at a time, so that a 16-token block (384 rows) costs microseconds, not the
 * milliseconds of numpy's per-call overhead on arrays of that size.
 *
 * Rules of the arithmetic:
 * 1. Every value is float64 and every operation is IEEE: no BLAS, no fused multiply-add
 *    (setup.py builds with -ffp-contract=off), no reassociation; the codes are the same on
 *    every machine and every call.  (-fno-trapping-math lets the compiler vectorize a
 *    select; it changes no value.)
 * 2. A squared norm is summed as numpy sums 8 values, pairwise:
 *    ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)); a dot product with a root of the
 *    descent is summed in coordinate order.  On lattice points (multiples of 1/2) every sum
 *    is exact; the order matters only where two candidates are within rounding of each other.
 * 3. Ties go to the first candidate in _e8.py's order: the worst coordinate is the first of
 *    the largest rounding errors, D8 wins over D8 + 1/2 when equally close, the first shrink
 *    fraction and the first root (in the codebook's order) win.
 * 4. A row must be finite with a finite squared norm (any float32 data is): anything else is
 *    a ValueError, not a code.
 * 5. The codebook is handed in by the caller (its sorted keys and its 240 roots, _e8.py rule
 *    3); a point's key is its doubled coordinates offset by KEY_OFFSET, read as the digits of
 *    a base-KEY_BASE number, coordinate 0 the least significant.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DIM 8
#define NORM2_INT 10
#define NORM2 ((double)NORM2_INT)
#define SHRINK_FIRST 0.9
#define NORM_SLACK 1e-9
#define KEY_BASE 13
#define KEY_OFFSET 6
#define DESCENT_STEPS 4
#define DESCENT_GAIN 1e-9
#define ROOTS 240

/* ------------------------------------------------------------------ the lattice, one row */

/* Round half to even, as numpy's rint: adding and subtracting 2^52 leaves no fraction bits. */
static inline double
round_even(double v)
{
    double a = fabs(v);
    if (!(a < 4503599627370496.0))
        return v;
    return copysign((a + 4503599627370496.0) - 4503599627370496.0, v);
}

static double
pairwise_sum(const double t[DIM])
{
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

static double
norm2(const double p[DIM])
{
    double t[DIM];
    for (int k = 0; k < DIM; k++)
        t[k] = p[k] * p[k];
    return pairwise_sum(t);
}

static double
distance2(const double x[DIM], const double p[DIM])
{
    double t[DIM];
    for (int k = 0; k < DIM; k++) {
        double d = p[k] - x[k];
        t[k] = d * d;
    }
    return pairwise_sum(t);
}

/* _e8.py rule 1: round; on an odd sum, round the worst coordinate the other way. */
static void
nearest_d8(const double x[DIM], double out[DIM])
{
    double sum = 0.0;
    for (int k = 0; k < DIM; k++) {
        out[k] = round_even(x[k]);
        sum += out[k];
    }
    if (fabs(sum) < 9007199254740992.0 ? !((int64_t)sum & 1) : fmod(sum, 2.0) == 0.0)
        return;
    int worst = 0;
    double worst_err = -1.0;
    for (int k = 0; k < DIM; k++) {
        double err = fabs(x[k] - out[k]);
        if (err > worst_err) {
            worst_err = err;
            worst = k;
        }
    }
    out[worst] += x[worst] - out[worst] >= 0.0 ? 1.0 : -1.0;
}

/* _e8.py rule 2: the closer of the nearest points of D8 and of D8 + 1/2. */
static void
nearest_e8(const double x[DIM], double out[DIM])
{
    double shifted[DIM], half[DIM];
    for (int k = 0; k < DIM; k++)
        shifted[k] = x[k] - 0.5;
    nearest_d8(x, out);
    nearest_d8(shifted, half);
    for (int k = 0; k < DIM; k++)
        half[k] += 0.5;
    if (distance2(x, half) < distance2(x, out))
        memcpy(out, half, sizeof(half));
}

static int64_t
key_of(const double p[DIM])
{
    int64_t key = 0;
    for (int k = DIM - 1; k >= 0; k--)
        key = key * KEY_BASE + ((int64_t)round_even(p[k] * 2.0) + KEY_OFFSET);
    return key;
}

/* ------------------------------------------------------------------ the codebook */

#define PAIRS 28                     /* the roots +-e_i +-e_j: 4 per pair i < j */
#define WHOLE_SUMS (4 * PAIRS)
#define HALF_SUMS 128                /* the roots (+-1/2)^8 with an even count of minuses */
#define SUMS (WHOLE_SUMS + HALF_SUMS)

typedef struct {
    const int64_t *keys; /* sorted, one per codebook point */
    Py_ssize_t size;
    const double *roots;  /* [ROOTS, DIM], in the codebook's order */
    int16_t slot[ROOTS];  /* where root_sums puts each root's product */
} Codebook;

/* The index of lattice point p, or -1 outside the ball or not in the book. */
static Py_ssize_t
index_of(const Codebook *book, const double p[DIM])
{
    if (norm2(p) > NORM2 + NORM_SLACK)
        return -1;
    int64_t key = key_of(p);
    Py_ssize_t low = 0, high = book->size;
    while (low < high) {
        Py_ssize_t mid = low + (high - low) / 2;
        if (book->keys[mid] < key)
            low = mid + 1;
        else
            high = mid;
    }
    return low < book->size && book->keys[low] == key ? low : -1;
}

/* _e8.py rule 4, first half: the closest inside the ball of the rows shrunk to each fraction. */
static double
shrunk(const double x[DIM], double best[DIM])
{
    double radius = sqrt(NORM2);
    double fractions[] = {SHRINK_FIRST, 1.0 - 1.0 / radius};
    double norm = sqrt(norm2(x));
    double best_err = INFINITY;
    for (int f = 0; f < 2; f++) {
        double fraction = fractions[f];
        double factor = fraction * radius / (norm > 1e-30 ? norm : 1e-30);
        factor = factor < 1.0 ? factor : 1.0;
        double y[DIM], candidate[DIM];
        for (int k = 0; k < DIM; k++)
            y[k] = x[k] * factor;
        nearest_e8(y, candidate);
        double err = distance2(x, candidate);
        if (norm2(candidate) <= NORM2 + NORM_SLACK && err < best_err) {
            memcpy(best, candidate, sizeof(candidate));
            best_err = err;
        }
    }
    return best_err;
}

/* r.v for all 240 roots r at once, into the slots of Codebook.slot.  Each is the sum of its 8
 * products in coordinate order (rule 2), the zero products left out (adding a zero changes no
 * sum that is not zero): a whole root's is +-v_i +-v_j; the half roots' share their prefixes,
 * kept as two lists, those with an even and those with an odd count of minuses so far, so that
 * a half root with minus mask m (an even count) lands at WHOLE_SUMS + m / 2. */
static void
root_sums(const double v[DIM], double sums[SUMS])
{
    int q = 0;
    for (int i = 0; i < DIM; i++)
        for (int j = i + 1; j < DIM; j++, q++) {
            double plus = v[i] + v[j], minus = v[i] - v[j];
            sums[4 * q] = plus;
            sums[4 * q + 1] = minus;
            sums[4 * q + 2] = -minus;
            sums[4 * q + 3] = -plus;
        }
    double half[DIM], even[HALF_SUMS / 2], odd[HALF_SUMS / 2], next_even[HALF_SUMS / 2],
        next_odd[HALF_SUMS / 2];
    for (int k = 0; k < DIM; k++)
        half[k] = 0.5 * v[k];
    even[0] = half[0];
    odd[0] = -half[0];
    int n = 1;
    for (int k = 1; k < DIM - 1; k++, n *= 2) {
        for (int i = 0; i < n; i++) {
            next_even[i] = even[i] + half[k];
            next_even[n + i] = odd[i] - half[k];
            next_odd[i] = odd[i] + half[k];
            next_odd[n + i] = even[i] - half[k];
        }
        memcpy(even, next_even, 2 * n * sizeof(double));
        memcpy(odd, next_odd, 2 * n * sizeof(double));
    }
    for (int i = 0; i < n; i++) {
        sums[WHOLE_SUMS + i] = even[i] + half[DIM - 1];
        sums[WHOLE_SUMS + n + i] = odd[i] - half[DIM - 1];
    }
}

/* Each root's slot in root_sums, or -1 if `roots` are not E8's 240 roots. */
static int
slot_roots(const double *roots, int16_t slot[ROOTS])
{
    for (int r = 0; r < ROOTS; r++) {
        const double *root = roots + r * DIM;
        int whole[2], count = 0, mask = 0, halves = 0;
        for (int k = 0; k < DIM; k++) {
            if (root[k] == 1.0 || root[k] == -1.0) {
                if (count == 2)
                    return -1;
                whole[count++] = k;
            } else if (root[k] == 0.5 || root[k] == -0.5) {
                halves++;
                mask |= (root[k] < 0.0) << k;
            } else if (root[k] != 0.0) {
                return -1;
            }
        }
        if (count == 2 && halves == 0) {
            int i = whole[0], j = whole[1];
            int q = i * (2 * DIM - i - 1) / 2 + (j - i - 1);
            slot[r] = (int16_t)(4 * q + 2 * (root[i] < 0.0) + (root[j] < 0.0));
        } else if (count == 0 && halves == DIM && !__builtin_parity((unsigned)mask)) {
            slot[r] = (int16_t)(WHOLE_SUMS + mask / 2);
        } else {
            return -1;
        }
    }
    return 0;
}

/* _e8.py rule 4, second half: step to the nearest root neighbour inside the ball while it is
 * closer.  |x - p - r|^2 = err + 2 - 2 r.(x - p) and |p + r|^2 = |p|^2 + 2 r.p + 2. */
static void
descend(const Codebook *book, const double x[DIM], double point[DIM], double err)
{
    for (int step = 0; step < DESCENT_STEPS; step++) {
        double d[DIM], toward[SUMS], along[SUMS];
        for (int k = 0; k < DIM; k++)
            d[k] = x[k] - point[k];
        root_sums(d, toward);
        root_sums(point, along);
        /* By slot, the squared distance after the step, infinite where it leaves the ball;
         * the least of them (min is exact in any order), then the first root in the
         * codebook's order at that distance (rule 3). */
        double start = err + 2.0, base = norm2(point) + 2.0, dist[SUMS];
        for (int s = 0; s < SUMS; s++) {
            double after = start - 2.0 * toward[s], norm_after = base + 2.0 * along[s];
            dist[s] = norm_after > NORM2 + NORM_SLACK ? INFINITY : after;
        }
        double low[4] = {INFINITY, INFINITY, INFINITY, INFINITY};
        for (int s = 0; s < SUMS; s += 4)
            for (int lane = 0; lane < 4; lane++)
                low[lane] = dist[s + lane] < low[lane] ? dist[s + lane] : low[lane];
        double picked = low[0];
        for (int lane = 1; lane < 4; lane++)
            picked = low[lane] < picked ? low[lane] : picked;
        if (!(picked < err - DESCENT_GAIN))
            return;
        int pick = 0;
        while (dist[book->slot[pick]] != picked)
            pick++;
        for (int k = 0; k < DIM; k++)
            point[k] += book->roots[pick * DIM + k];
        err = picked;
    }
}

/* Rules 2-4 for one row: its code, or -1 (the descent left the book: a bug). */
static Py_ssize_t
encode_row(const Codebook *book, const double x[DIM])
{
    double point[DIM];
    nearest_e8(x, point);
    Py_ssize_t index = index_of(book, point);
    if (index >= 0)
        return index;
    double err = shrunk(x, point);
    if (!isfinite(err))
        return -1;
    descend(book, x, point, err);
    return index_of(book, point);
}

/* ------------------------------------------------------------------ Python boundary */

/* A C-contiguous buffer of `itemsize`-byte items of one of `formats`, writable if asked. */
static int
get_buffer(PyObject *obj, Py_buffer *view, const char *name, const char *formats,
           Py_ssize_t itemsize, int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *format = view->format == NULL ? "B" : view->format;
    if (format[0] == '<' || format[0] == '=' || format[0] == '@')
        format++;
    if (view->itemsize != itemsize || strlen(format) != 1 || strchr(formats, format[0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must hold %zd-byte items of format '%s', got '%s'",
                     name, itemsize, formats, view->format == NULL ? "B" : view->format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Rows of 8 float64 in, `out_per_row` items per row out: the count of rows, or -1. */
static Py_ssize_t
row_count(Py_buffer *rows, Py_buffer *out, Py_ssize_t out_per_row)
{
    Py_ssize_t values = rows->len / rows->itemsize;
    if (values % DIM) {
        PyErr_Format(PyExc_ValueError, "rows hold a multiple of 8 values, got %zd", values);
        return -1;
    }
    if (out->len / out->itemsize != values / DIM * out_per_row) {
        PyErr_Format(PyExc_ValueError, "out must hold %zd items, got %zd",
                     values / DIM * out_per_row, out->len / out->itemsize);
        return -1;
    }
    return values / DIM;
}

/* Rule 4: the first row (by index) that is not finite, or -1. */
static Py_ssize_t
first_bad_row(const double *x, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (!isfinite(norm2(x + i * DIM)))
            return i;
    return -1;
}

static PyObject *
bad_row(Py_ssize_t row)
{
    PyErr_Format(PyExc_ValueError,
                 "E8 row %zd is not finite (or its squared norm overflows)", row);
    return NULL;
}

typedef void (*RowFunction)(const double *, double *);

static PyObject *
apply_rows(PyObject *args, RowFunction function)
{
    PyObject *rows_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OO", &rows_obj, &out_obj))
        return NULL;
    Py_buffer rows, out;
    if (get_buffer(rows_obj, &rows, "rows", "d", 8, 0) < 0)
        return NULL;
    if (get_buffer(out_obj, &out, "out", "d", 8, 1) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = row_count(&rows, &out, DIM);
    if (n >= 0) {
        const double *x = rows.buf;
        Py_ssize_t bad = first_bad_row(x, n);
        if (bad >= 0) {
            bad_row(bad);
        } else {
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < n; i++)
                function(x + i * DIM, (double *)out.buf + i * DIM);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *
e8core_nearest_d8(PyObject *module, PyObject *args)
{
    return apply_rows(args, nearest_d8);
}

static PyObject *
e8core_nearest_e8(PyObject *module, PyObject *args)
{
    return apply_rows(args, nearest_e8);
}

static PyObject *
e8core_keys(PyObject *module, PyObject *args)
{
    PyObject *points_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OO", &points_obj, &out_obj))
        return NULL;
    Py_buffer points, out;
    if (get_buffer(points_obj, &points, "points", "d", 8, 0) < 0)
        return NULL;
    if (get_buffer(out_obj, &out, "out", "lq", 8, 1) < 0) {
        PyBuffer_Release(&points);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = row_count(&points, &out, 1);
    if (n >= 0) {
        const double *p = points.buf;
        Py_ssize_t bad = first_bad_row(p, n);
        if (bad >= 0) {
            bad_row(bad);
        } else {
            for (Py_ssize_t i = 0; i < n; i++)
                ((int64_t *)out.buf)[i] = key_of(p + i * DIM);
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&points);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *
e8core_encode(PyObject *module, PyObject *args)
{
    PyObject *rows_obj, *keys_obj, *roots_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &rows_obj, &keys_obj, &roots_obj, &out_obj))
        return NULL;
    Py_buffer rows, keys, roots, out;
    PyObject *result = NULL;
    if (get_buffer(rows_obj, &rows, "rows", "d", 8, 0) < 0)
        return NULL;
    if (get_buffer(keys_obj, &keys, "keys", "lq", 8, 0) < 0)
        goto release_rows;
    if (get_buffer(roots_obj, &roots, "roots", "d", 8, 0) < 0)
        goto release_keys;
    if (get_buffer(out_obj, &out, "out", "H", 2, 1) < 0)
        goto release_roots;
    Py_ssize_t n = row_count(&rows, &out, 1);
    if (n < 0)
        goto release_out;
    if (roots.len != ROOTS * DIM * (Py_ssize_t)sizeof(double) || keys.len == 0
        || keys.len / keys.itemsize > 65536) {
        PyErr_SetString(PyExc_ValueError,
                         "the codebook is up to 65,536 sorted keys and 240 roots of 8");
        goto release_out;
    }
    const double *x = rows.buf;
    Py_ssize_t bad = first_bad_row(x, n);
    if (bad >= 0) {
        bad_row(bad);
        goto release_out;
    }
    Codebook book = {keys.buf, keys.len / keys.itemsize, roots.buf, {0}};
    if (slot_roots(book.roots, book.slot) < 0) {
        PyErr_SetString(PyExc_ValueError, "roots must be the 240 roots of E8");
        goto release_out;
    }
    uint16_t *codes = out.buf;
    Py_ssize_t lost = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t index = encode_row(&book, x + i * DIM);
        if (index < 0) {
            lost = i;
            break;
        }
        codes[i] = (uint16_t)index;
    }
    Py_END_ALLOW_THREADS
    if (lost >= 0)
        PyErr_Format(PyExc_AssertionError, "E8 row %zd found no codebook point", lost);
    else
        result = Py_NewRef(Py_None);
release_out:
    PyBuffer_Release(&out);
release_roots:
    PyBuffer_Release(&roots);
release_keys:
    PyBuffer_Release(&keys);
release_rows:
    PyBuffer_Release(&rows);
    return result;
}

static PyMethodDef e8core_methods[] = {
    {"nearest_d8", e8core_nearest_d8, METH_VARARGS,
     "nearest_d8(rows, out): the nearest point of D8 to each row of 8 (float64)."},
    {"nearest_e8", e8core_nearest_e8, METH_VARARGS,
     "nearest_e8(rows, out): the nearest point of E8 to each row of 8 (float64)."},
    {"keys", e8core_keys, METH_VARARGS,
     "keys(points, out): the codebook key (int64) of each lattice point."},
    {"encode", e8core_encode, METH_VARARGS,
     "encode(rows, keys, roots, out): the code (uint16) of each row of 8."},
    {NULL}};

static struct PyModuleDef e8core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "backends.engine.kv.codecs._e8core",
    .m_doc = "The E8 codebook search of _e8.py in C (issue 14).",
    .m_size = -1,
    .m_methods = e8core_methods,
};

/* The rule's constants, for _e8.py to export (CODEBOOK_NORM2, SHRINK). */
PyMODINIT_FUNC
PyInit__e8core(void)
{
    PyObject *module = PyModule_Create(&e8core_module);
    if (module == NULL)
        return NULL;
    PyObject *shrink = Py_BuildValue("(dd)", SHRINK_FIRST, 1.0 - 1.0 / sqrt(NORM2));
    if (PyModule_AddIntConstant(module, "CODEBOOK_NORM2", NORM2_INT) < 0
        || PyModule_AddIntConstant(module, "DESCENT_STEPS", DESCENT_STEPS) < 0
        || PyModule_AddObject(module, "SHRINK", shrink) < 0) {
        Py_XDECREF(shrink);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
