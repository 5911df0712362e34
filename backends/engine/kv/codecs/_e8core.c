/* backends.engine.kv.codecs._e8core: the E8 codec's per-row arithmetic in C (issue 14).
 *
 * The rules are _e8.py's (its module comment, rules 1-4: the codebook search) and _e8_codec.py's
 * rule 3 (the fast Walsh-Hadamard transform); this file is their arithmetic, one row at a time,
 * so that a 16-token block (384 rows of 8) costs microseconds, not the milliseconds of numpy's
 * per-call overhead on arrays of that size.
 *
 * Rules of the arithmetic:
 * 1. Every value is float64 and every operation is IEEE: no BLAS, no fused multiply-add
 *    (setup.py builds with -ffp-contract=off), no reassociation; the codes are the same on
 *    every machine and every call.  (-fno-trapping-math lets the compiler vectorize a
 *    select; it changes no value.)
 * 2. A squared norm is summed as numpy sums 8 values, pairwise:
 *    ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)); a dot product with a root of the
 *    descent is summed in coordinate order, a half root's as its first four products plus its
 *    last four.  On lattice points (multiples of 1/2) every sum is exact; the order matters
 *    only where two candidates are within rounding of each other.
 * 3. Ties go to the first candidate in _e8.py's order: the worst coordinate is the first of
 *    the largest rounding errors, D8 wins over D8 + 1/2 when equally close, the first shrink
 *    fraction and the first root (in the codebook's order) win.
 * 4. A row must be finite with a finite squared norm (any float32 data is): anything else is
 *    a ValueError, not a code.
 * 5. The Hadamard transform is float32, each butterfly stage a + b and a - b in the order
 *    numpy's stages computed them, then one multiplication by float32(1 / sqrt(dim)): the same
 *    bits as _e8_codec.py's numpy form had.
 * 6. The codebook is handed in by the caller (its sorted keys and its 240 roots, _e8.py rule
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
    double rounded = copysign((a + 4503599627370496.0) - 4503599627370496.0, v);
    return a < 4503599627370496.0 ? rounded : v;
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
    double signs[2][4][8]; /* of EVEN4 and ODD4, for quarter_sums */
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

/* The 4-bit minus masks with an even and with an odd count of minuses. */
static const int EVEN4[8] = {0, 3, 5, 6, 9, 10, 12, 15};
static const int ODD4[8] = {1, 2, 4, 7, 8, 11, 13, 14};

/* The sums of 4 halves h[0..3] under each of 8 masks, in coordinate order (rule 2); signs[k][b]
 * is -1 where mask b has bit k. */
static void
quarter_sums(const double h[4], const double signs[4][8], double out[8])
{
    for (int b = 0; b < 8; b++)
        out[b] = h[0] * signs[0][b];
    for (int k = 1; k < 4; k++)
        for (int b = 0; b < 8; b++)
            out[b] += h[k] * signs[k][b];
}

/* r.v for all 240 roots r at once, into the slots of Codebook.slot (rule 2): a whole root's is
 * +-v_i +-v_j (laid out by the distance j - i); a half root's is the sum of its first four
 * products plus the sum of its last four, an even count of minuses being two even or two odd
 * halves. */
static void
root_sums(const Codebook *book, const double v[DIM], double sums[SUMS])
{
    double *out = sums;
    for (int t = 1; t < DIM; t++) {
        int n = DIM - t;
        for (int i = 0; i < n; i++) {
            double plus = v[i] + v[i + t], minus = v[i] - v[i + t];
            out[i] = plus;
            out[n + i] = minus;
            out[2 * n + i] = -minus;
            out[3 * n + i] = -plus;
        }
        out += 4 * n;
    }
    double half[DIM], low_even[8], low_odd[8], high_even[8], high_odd[8];
    for (int k = 0; k < DIM; k++)
        half[k] = 0.5 * v[k];
    quarter_sums(half, book->signs[0], low_even);
    quarter_sums(half, book->signs[1], low_odd);
    quarter_sums(half + 4, book->signs[0], high_even);
    quarter_sums(half + 4, book->signs[1], high_odd);
    for (int a = 0; a < 8; a++)
        for (int b = 0; b < 8; b++) {
            out[8 * a + b] = low_even[b] + high_even[a];
            out[64 + 8 * a + b] = low_odd[b] + high_odd[a];
        }
}

static int
place_of(const int masks[8], int mask)
{
    for (int b = 0; b < 8; b++)
        if (masks[b] == mask)
            return b;
    return -1;
}

/* Each root's slot in root_sums and quarter_sums' signs, or -1 if `roots` are not E8's 240
 * roots. */
static int
slot_roots(const double *roots, int16_t slot[ROOTS], double signs[2][4][8])
{
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 8; b++) {
            signs[0][k][b] = EVEN4[b] >> k & 1 ? -1.0 : 1.0;
            signs[1][k][b] = ODD4[b] >> k & 1 ? -1.0 : 1.0;
        }
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
            int i = whole[0], t = whole[1] - i, n = DIM - t, base = 0;
            for (int u = 1; u < t; u++)
                base += 4 * (DIM - u);
            int sign = 2 * (root[i] < 0.0) + (root[i + t] < 0.0);
            slot[r] = (int16_t)(base + sign * n + i);
        } else if (count == 0 && halves == DIM && !__builtin_parity((unsigned)mask)) {
            int low = mask & 15, high = mask >> 4;
            int odd = __builtin_parity((unsigned)low);
            const int *masks = odd ? ODD4 : EVEN4;
            slot[r] = (int16_t)(WHOLE_SUMS + 64 * odd + 8 * place_of(masks, high)
                                + place_of(masks, low));
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
        root_sums(book, d, toward);
        root_sums(book, point, along);
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
    Codebook book = {keys.buf, keys.len / keys.itemsize, roots.buf, {0}, {{{0.0}}}};
    if (slot_roots(book.roots, book.slot, book.signs) < 0) {
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

/* Rule 5: x @ H / sqrt(dim) along rows of `dim` float32 (dim a power of two). */
static void
hadamard_rows(const float *x, float *out, Py_ssize_t n, Py_ssize_t dim)
{
    float scale = (float)(1.0 / sqrt((double)dim));
    for (Py_ssize_t row = 0; row < n; row++) {
        float *v = out + row * dim;
        memcpy(v, x + row * dim, dim * sizeof(float));
        for (Py_ssize_t half = 1; half < dim; half *= 2)
            for (Py_ssize_t start = 0; start < dim; start += 2 * half)
                for (Py_ssize_t i = start; i < start + half; i++) {
                    float low = v[i], high = v[i + half];
                    v[i] = low + high;
                    v[i + half] = low - high;
                }
        for (Py_ssize_t i = 0; i < dim; i++)
            v[i] *= scale;
    }
}

static PyObject *
e8core_hadamard(PyObject *module, PyObject *args)
{
    PyObject *rows_obj, *out_obj;
    Py_ssize_t dim;
    if (!PyArg_ParseTuple(args, "OnO", &rows_obj, &dim, &out_obj))
        return NULL;
    if (dim < 1 || (dim & (dim - 1))) {
        PyErr_Format(PyExc_ValueError, "dim must be a power of two, got %zd", dim);
        return NULL;
    }
    Py_buffer rows, out;
    if (get_buffer(rows_obj, &rows, "rows", "f", 4, 0) < 0)
        return NULL;
    if (get_buffer(out_obj, &out, "out", "f", 4, 1) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t values = rows.len / rows.itemsize;
    if (values % dim || out.len != rows.len) {
        PyErr_Format(PyExc_ValueError, "rows of %zd and out of the same size, got %zd and %zd",
                     dim, values, out.len / out.itemsize);
    } else {
        Py_BEGIN_ALLOW_THREADS
        hadamard_rows(rows.buf, out.buf, values / dim, dim);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef e8core_methods[] = {
    {"hadamard", e8core_hadamard, METH_VARARGS,
     "hadamard(rows, dim, out): x @ H / sqrt(dim) along rows of dim float32."},
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
    .m_doc = "The E8 codec's per-row arithmetic in C (issue 14).",
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
