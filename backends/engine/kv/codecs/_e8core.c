/* backends.engine.kv.codecs._e8core: the E8 codec's per-row arithmetic in C (issue 14).
 *
 * The rules are _e8.py's (its module comment, rules 1-4: the codebook search) and _e8_codec.py's
 * rules 3 (the fast Walsh-Hadamard transform), 4 (a token-head's scale index), 4b (the block
 * scales' choice) and 8's first half (codebook rows times their levels); this file is their
 * arithmetic, row by row (two rows at once where it rounds to the lattice, "the lattice, in
 * lanes"), so that a 16-token block (384 rows of 8) costs microseconds,
 * not the milliseconds of numpy's per-call overhead on arrays of that size (and a block sealed
 * between two layers' attention finds numpy's code and data out of the caches: each call it
 * saves is worth more there than on a warm loop).
 *
 * Two builds (setup.py): _e8core for x86-64-v2 (SSE4.2, numpy's own baseline: every machine),
 * the lattice in 2 lanes of 128-bit registers; and, defined E8CORE_AVX2, _e8core_avx2 for
 * x86-64-v3 (AVX2), in 4 lanes of 256-bit registers, ~15-25 % less time a block.  _e8builds.py
 * runs the second where the CPU can (RUNS_AVX2, asked of the CPU here).  Rule 1 makes their
 * codes the same bits; the tests hold them to it.
 *
 * Rules of the arithmetic:
 * 1. Every value is float64 and every operation is IEEE: no BLAS, no fused multiply-add
 *    (setup.py builds with -ffp-contract=off), no reassociation; the codes are the same on
 *    every machine, every call and in both builds (a lane, a vector width, changes no
 *    element's operations).  (-fno-trapping-math lets the compiler vectorize a select; it
 *    changes no value.)
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
 * 4b. The key transform (_e8_codec rule 2) is float32, each output summed in the order of its
 *    inputs from 0 (transform_rows): not numpy's einsum order, but one fixed order.
 * 5. The Hadamard transform is float32, each butterfly stage a + b and a - b in the order
 *    numpy's stages computed them, then one multiplication by float32(1 / sqrt(dim)): the same
 *    bits as _e8_codec.py's numpy form had.
 * 6. The codebook is rule 3's ball, ordered by rule 3's key: a point's doubled coordinates offset
 *    by KEY_OFFSET, read as the digits of a base-KEY_BASE number, coordinate 0 the least
 *    significant (keys() gives it; _e8.py sorts the points by it).  A point's code is its rank
 *    in that order, counted from tables built when the module loads (index_of), so the C
 *    needs no codebook handed in; the tests hold it equal to _e8.py's sorted keys.  The way
 *    back, a code's point, is a table (POINT) built from the same counts when the module loads.
 * 7. Where the C stands in for numpy (a scale index, a decoded row) it does numpy's float32
 *    operations in numpy's order -- a squared row summed as numpy's pairwise sum, sqrt and
 *    division correctly rounded, a product per element -- so the bits are numpy's: the codes
 *    and the decoded rows are what _e8_codec's numpy form gave (the tests compare them).
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
#define PRUNE_MARGIN 1e-6
#define LATTICE_SLACK 1e-12
#define ONTO_SLACK 1e-8

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

/* ------------------------------------------------------------------ the lattice, in lanes */

/* The lattice's rounding runs over LANES rows at once, each coordinate a vector of LANES (GCC's
 * vector extension: one row a lane, a register's worth of lanes -- 2 in SSE2's, 4 in AVX2's;
 * wider vectors than the build's registers run slower): the operations of _e8.py rules 1-2 per lane, in the same order (rule
 * 1: no operation mixes lanes, none is fused or reassociated), so a lane's point does not
 * depend on the other lanes.  encode_scaled's fast path takes LANES rows a call and the shrink
 * its 2 fractions (repeated over the lanes); a single row (nearest_d8, nearest_e8) fills every
 * lane.  What branches on a row
 * (the choice of level, the descent) stays one row at a time. */
#ifdef E8CORE_AVX2
#define LANES 4
#else
#define LANES 2
#endif
_Static_assert(LANES >= 2, "the shrink takes its two fractions in two lanes");

typedef double Vec __attribute__((vector_size(8 * LANES)));
typedef int64_t Mask __attribute__((vector_size(8 * LANES))); /* a comparison: -1 or 0 a lane */

static inline Vec
splat(double v)
{
    Vec out;
    for (int r = 0; r < LANES; r++)
        out[r] = v;
    return out;
}

/* Per lane, `a` where `mask` holds, else `b`. */
static inline Vec
pick(Mask mask, Vec a, Vec b)
{
    return (Vec)((mask & (Mask)a) | (~mask & (Mask)b));
}

static inline Vec
magnitude_of(Vec v)
{
    return (Vec)((Mask)v & INT64_MAX);
}

/* round_even per lane: copysign is the rounded magnitude (never negative) with v's sign bit. */
static inline Vec
round_even_lanes(Vec v)
{
    Vec a = magnitude_of(v), big = splat(4503599627370496.0);
    Vec rounded = (Vec)((Mask)((a + big) - big) | ((Mask)v & INT64_MIN));
    return pick(a < big, rounded, v);
}

/* pairwise_sum of each lane's squares. */
static inline Vec
norm2_lanes(const Vec v[DIM])
{
    Vec t[DIM];
    for (int k = 0; k < DIM; k++)
        t[k] = v[k] * v[k];
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

/* distance2 per lane: the squares of p - x. */
static inline Vec
distance2_lanes(const Vec x[DIM], const Vec p[DIM])
{
    Vec d[DIM];
    for (int k = 0; k < DIM; k++)
        d[k] = p[k] - x[k];
    return norm2_lanes(d);
}

/* _e8.py rule 1 per lane: round; on an odd sum, round the worst coordinate (the first of the
 * largest misses) the other way.  The parity is sum / 2 against its rounding (exact: the
 * rounded coordinates and their sum are whole numbers), the worst coordinate and the flip are
 * selects, so the parity, a coin toss, costs no mispredicted branch. */
static void
nearest_d8_lanes(const Vec x[DIM], Vec out[DIM])
{
    Vec sum = splat(0.0), most = splat(0.0), miss[DIM], worst = splat(DIM);
    for (int k = 0; k < DIM; k++) {
        out[k] = round_even_lanes(x[k]);
        sum += out[k];
    }
    for (int k = 0; k < DIM; k++) {
        miss[k] = magnitude_of(x[k] - out[k]);
        most = pick(miss[k] > most, miss[k], most);
    }
    for (int k = DIM - 1; k >= 0; k--)
        worst = pick(miss[k] == most, splat(k), worst);
    Vec half = sum * 0.5;
    worst = pick(half != round_even_lanes(half), worst, splat(DIM));
    for (int k = 0; k < DIM; k++) {
        Vec flipped = out[k] + pick(x[k] - out[k] >= 0.0, splat(1.0), splat(-1.0));
        out[k] = pick(worst == k, flipped, out[k]);
    }
}

/* _e8.py rule 2 per lane: the closer of the nearest points of D8 and of D8 + 1/2. */
static void
nearest_e8_lanes(const Vec x[DIM], Vec out[DIM])
{
    Vec shifted[DIM], half[DIM];
    for (int k = 0; k < DIM; k++)
        shifted[k] = x[k] - 0.5;
    nearest_d8_lanes(x, out);
    nearest_d8_lanes(shifted, half);
    for (int k = 0; k < DIM; k++)
        half[k] += 0.5;
    Mask closer = distance2_lanes(x, half) < distance2_lanes(x, out);
    for (int k = 0; k < DIM; k++)
        out[k] = pick(closer, half[k], out[k]);
}

/* One row through both lanes (nearest_d8_lanes or nearest_e8_lanes) into out. */
static void
nearest_row(const double x[DIM], double out[DIM],
            void (*nearest)(const Vec[DIM], Vec[DIM]))
{
    Vec row[DIM], point[DIM];
    for (int k = 0; k < DIM; k++)
        row[k] = splat(x[k]);
    nearest(row, point);
    for (int k = 0; k < DIM; k++)
        out[k] = point[k][0];
}

static void
nearest_d8(const double x[DIM], double out[DIM])
{
    nearest_row(x, out, nearest_d8_lanes);
}

static void
nearest_e8(const double x[DIM], double out[DIM])
{
    nearest_row(x, out, nearest_e8_lanes);
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

/* Rule 6: a point's code is its rank in the order of its key, counted, not searched.  In
 * doubled coordinates q = 2p (all even: D8; all odd: D8 + 1/2) a codebook point has
 * sum(q^2) <= 4 * NORM2 and sum(q) = 0 mod 4, and the key orders points by q[7], then q[6],
 * ..., then q[0].  So the points before q are, for each coordinate k from 7 down, those that
 * agree with q above k and are smaller at k: for each smaller value v there, the completions
 * of coordinates 0..k-1 of the same kind (all even or all odd, fixed by coordinate 7) within
 * what is left of the budget and with the sum mod 4 still owed.  BELOW holds those counts
 * summed over v, built once when the module loads; a code is then 8 table reads. */
#define QMAX (2 * 3)                 /* the largest |q| in the ball: p = 3, since 3.5^2 > 10 */
#define BUDGET (4 * NORM2_INT)       /* sum(q^2) of the ball */
#define VALUES (2 * QMAX + 1)        /* q + QMAX, a key digit (KEY_BASE) */
#define CODEBOOK_SIZE 56881          /* _e8.py rule 3; checked when BELOW is built */

/* BELOW[kind][m][owed][budget][v + QMAX]: points of m free coordinates after one set to a
 * value below v, of the kind, summed over those values. */
static uint32_t BELOW[2][DIM][4][BUDGET + 1][VALUES + 1];

static int
mod4(int v)
{
    return ((v % 4) + 4) % 4;
}

/* Builds BELOW; the count of codebook points, which must be CODEBOOK_SIZE. */
static long
build_below(void)
{
    /* count[kind][m][owed][budget]: completions of m coordinates of the kind. */
    static uint32_t count[2][DIM][4][BUDGET + 1];
    for (int kind = 0; kind < 2; kind++) {
        for (int budget = 0; budget <= BUDGET; budget++)
            count[kind][0][0][budget] = 1;
        for (int m = 1; m < DIM; m++)
            for (int owed = 0; owed < 4; owed++)
                for (int budget = 0; budget <= BUDGET; budget++) {
                    uint32_t total = 0;
                    for (int v = -QMAX; v <= QMAX; v++)
                        if ((v & 1) == kind && v * v <= budget)
                            total += count[kind][m - 1][mod4(owed - v)][budget - v * v];
                    count[kind][m][owed][budget] = total;
                }
        for (int m = 0; m < DIM; m++)
            for (int owed = 0; owed < 4; owed++)
                for (int budget = 0; budget <= BUDGET; budget++) {
                    uint32_t total = 0;
                    for (int v = -QMAX; v <= QMAX; v++) {
                        BELOW[kind][m][owed][budget][v + QMAX] = total;
                        if ((v & 1) == kind && v * v <= budget)
                            total += count[kind][m][mod4(owed - v)][budget - v * v];
                    }
                    BELOW[kind][m][owed][budget][VALUES] = total;
                }
    }
    return (long)BELOW[0][DIM - 1][0][BUDGET][VALUES] + BELOW[1][DIM - 1][0][BUDGET][VALUES];
}

/* Whether lattice point p lies in the ball (the codebook's points). */
static inline int
in_ball(const double p[DIM])
{
    return norm2(p) <= NORM2 + NORM_SLACK;
}

/* The code of lattice point p in the ball. */
static Py_ssize_t
rank_of(const double p[DIM])
{
    int q[DIM];
    for (int k = 0; k < DIM; k++)
        q[k] = (int)round_even(p[k] * 2.0);
    int kind = q[DIM - 1] & 1, owed = 0, budget = BUDGET;
    Py_ssize_t rank = BELOW[0][DIM - 1][0][BUDGET][q[DIM - 1] + QMAX]
                      + BELOW[1][DIM - 1][0][BUDGET][q[DIM - 1] + QMAX];
    for (int k = DIM - 1; k > 0; k--) {
        owed = mod4(owed - q[k]);
        budget -= q[k] * q[k];
        rank += BELOW[kind][k - 1][owed][budget][q[k - 1] + QMAX];
    }
    return rank;
}

/* The code of lattice point p, or -1 outside the ball. */
static Py_ssize_t
index_of(const double p[DIM])
{
    return in_ball(p) ? rank_of(p) : -1;
}

/* POINT[code]: the doubled coordinates of the codebook's point of that code (index_of's
 * inverse, one digit at a time from coordinate 7 down: the value whose count of points below
 * it is the most not above what is left of the code), built once at load and checked against
 * index_of; 8 bytes a point, so decoding reads 455 KB, not the 1.8 MB of float32 points. */
static int8_t POINT[CODEBOOK_SIZE][DIM];

/* Builds POINT: 0, or -1 where a code does not come back to itself. */
static int
build_points(void)
{
    for (Py_ssize_t code = 0; code < CODEBOOK_SIZE; code++) {
        Py_ssize_t left = code;
        int q[DIM], kind = 0, owed = 0, budget = BUDGET;
        for (int k = DIM - 1; k >= 0; k--) {
            int v = -QMAX;
            for (int next = -QMAX + 1; next <= QMAX; next++) {
                Py_ssize_t below = k == DIM - 1 ? (Py_ssize_t)BELOW[0][k][0][BUDGET][next + QMAX]
                                                      + BELOW[1][k][0][BUDGET][next + QMAX]
                                                : BELOW[kind][k][owed][budget][next + QMAX];
                if (below > left)
                    break;
                v = next;
            }
            left -= k == DIM - 1 ? (Py_ssize_t)BELOW[0][k][0][BUDGET][v + QMAX]
                                       + BELOW[1][k][0][BUDGET][v + QMAX]
                                 : BELOW[kind][k][owed][budget][v + QMAX];
            if (k == DIM - 1)
                kind = v & 1;
            q[k] = v;
            owed = mod4(owed - v);
            budget -= v * v;
            if (budget < 0)
                return -1;
        }
        double p[DIM];
        for (int k = 0; k < DIM; k++) {
            POINT[code][k] = (int8_t)q[k];
            p[k] = 0.5 * q[k];
        }
        if (left != 0 || index_of(p) != code)
            return -1;
    }
    return 0;
}

/* _e8.py rule 4, first half: the closest inside the ball of the rows shrunk to each fraction
 * (the fractions in lanes). */
static double
shrunk(const double x[DIM], double best[DIM])
{
    double radius = sqrt(NORM2);
    double fractions[] = {SHRINK_FIRST, 1.0 - 1.0 / radius};
    double norm = sqrt(norm2(x));
    Vec factor, row[DIM], y[DIM], candidate[DIM];
    for (int f = 0; f < LANES; f++) {
        double scaled = fractions[f % 2] * radius / (norm > 1e-30 ? norm : 1e-30);
        factor[f] = scaled < 1.0 ? scaled : 1.0;
    }
    for (int k = 0; k < DIM; k++) {
        row[k] = splat(x[k]);
        y[k] = row[k] * factor;
    }
    nearest_e8_lanes(y, candidate);
    Vec err = distance2_lanes(row, candidate);
    Mask inside = norm2_lanes(candidate) <= NORM2 + NORM_SLACK;
    double best_err = INFINITY;
    for (int f = 0; f < 2; f++)
        if (inside[f] && err[f] < best_err) {
            for (int k = 0; k < DIM; k++)
                best[k] = candidate[k][f];
            best_err = err[f];
        }
    return best_err;
}

/* The roots in the order root_sums gives their products: the roots +-e_i +-e_j (4 per pair
 * i < j, laid out by the distance j - i), then the 128 roots (+-1/2)^8 with an even count of
 * minuses. */
#define PAIRS 28
#define WHOLE_SUMS (4 * PAIRS)
#define HALF_SUMS 128
#define SUMS (WHOLE_SUMS + HALF_SUMS)

/* The 4-bit minus masks with an even and with an odd count of minuses. */
static const int EVEN4[8] = {0, 3, 5, 6, 9, 10, 12, 15};
static const int ODD4[8] = {1, 2, 4, 7, 8, 11, 13, 14};

/* ROOT[s]: the root whose product root_sums puts in slot s; ROOT_CODE[s] its code (the
 * codebook's order, rule 3's tie-break).  Built once at load. */
static double ROOT[SUMS][DIM];
static Py_ssize_t ROOT_CODE[SUMS];
static int PAIR_BASE[DIM]; /* the slot of the first root +-e_i +-e_(i+t), by t */

static void
build_roots(void)
{
    int slot = 0;
    for (int t = 1; t < DIM; t++) {
        int n = DIM - t;
        PAIR_BASE[t] = slot;
        for (int sign = 0; sign < 4; sign++)
            for (int i = 0; i < n; i++, slot++) {
                memset(ROOT[slot], 0, sizeof(ROOT[slot]));
                ROOT[slot][i] = sign & 2 ? -1.0 : 1.0;
                ROOT[slot][i + t] = sign & 1 ? -1.0 : 1.0;
            }
    }
    for (int odd = 0; odd < 2; odd++) {
        const int *masks = odd ? ODD4 : EVEN4;
        for (int a = 0; a < 8; a++)
            for (int b = 0; b < 8; b++, slot++) {
                int mask = masks[b] | masks[a] << 4;
                for (int k = 0; k < DIM; k++)
                    ROOT[slot][k] = mask >> k & 1 ? -0.5 : 0.5;
            }
    }
    for (int s = 0; s < SUMS; s++)
        ROOT_CODE[s] = index_of(ROOT[s]);
}

/* out[mask] = ((a0 + a1) + a2) + a3 with a_k = -h_k where mask has bit k, else h_k: the sum of
 * 4 products with halves in coordinate order (rule 2; a product with +-1/2 is exact). */
static void
signed_sums(const double h[4], double out[16])
{
    double two[4], three[8];
    for (int m = 0; m < 4; m++)
        two[m] = (m & 1 ? -h[0] : h[0]) + (m & 2 ? -h[1] : h[1]);
    for (int m = 0; m < 8; m++)
        three[m] = two[m & 3] + (m & 4 ? -h[2] : h[2]);
    for (int m = 0; m < 16; m++)
        out[m] = three[m & 7] + (m & 8 ? -h[3] : h[3]);
}

/* One look of the descent: the roots whose step would end closer than `limit` (their slots
 * and distances after the step), gathered without a branch per root. */
typedef struct {
    double start, limit;
    int count;
    int slot[SUMS];
    double after[SUMS];
} Look;

/* Keeps the root in slot s, whose product with x - point is `toward`, if it is a step. */
static inline void
consider(Look *look, int s, double toward)
{
    double after = look->start - 2.0 * toward;
    look->slot[look->count] = s;
    look->after[look->count] = after;
    look->count += after < look->limit;
}

/* Whether no root whose product is at most `most` can be a step. */
static inline int
beyond(const Look *look, double most)
{
    return !(look->start - 2.0 * most < look->limit);
}

/* The products r.d of the descent are the rule's (rule 2): a whole root's +-d_i +-d_j, a half
 * root's the sum of its first four products plus the sum of its last four (an even count of
 * minuses is two even or two odd quarters).  Rounding is monotonic, so a bound on a group's
 * products rules the whole group out (beyond): the four roots of a pair i < j have at most
 * |d_i| + |d_j|, a coordinate pairs with no other above |d_i| + max |d|, and half roots at most
 * their low quarter plus the largest high quarter of the same parity.  What is left -- about
 * 45 roots on the model's rows, 10 of them steps -- is considered one by one, with exactly
 * the products the rule computes, in any order (the tie-break is by code, not by when a root
 * is seen). */
static void
look_around(const double d[DIM], Look *look)
{
    double magnitude[DIM], most = 0.0;
    for (int k = 0; k < DIM; k++) {
        magnitude[k] = fabs(d[k]);
        most = magnitude[k] > most ? magnitude[k] : most;
    }
    int live[DIM], count = 0;
    for (int k = 0; k < DIM; k++) {
        live[count] = k;
        count += !beyond(look, magnitude[k] + most);
    }
    for (int a = 0; a < count; a++)
        for (int b = a + 1; b < count; b++) {
            int i = live[a], j = live[b];
            if (beyond(look, magnitude[i] + magnitude[j]))
                continue;
            int n = DIM - (j - i), slot = PAIR_BASE[j - i] + i;
            double plus = d[i] + d[j], minus = d[i] - d[j];
            consider(look, slot, plus);
            consider(look, slot + n, minus);
            consider(look, slot + 2 * n, -minus);
            consider(look, slot + 3 * n, -plus);
        }
    double half[DIM], low[16], high[16];
    for (int k = 0; k < DIM; k++)
        half[k] = 0.5 * d[k];
    signed_sums(half, low);
    signed_sums(half + 4, high);
    for (int odd = 0; odd < 2; odd++) {
        const int *masks = odd ? ODD4 : EVEN4;
        double top = high[masks[0]];
        for (int a = 1; a < 8; a++)
            top = high[masks[a]] > top ? high[masks[a]] : top;
        for (int b = 0; b < 8; b++) {
            double quarter = low[masks[b]];
            if (beyond(look, quarter + top))
                continue;
            for (int a = 0; a < 8; a++)
                consider(look, WHOLE_SUMS + 64 * odd + 8 * a + b, quarter + high[masks[a]]);
        }
    }
}

/* _e8.py rule 4, second half: step to the nearest root neighbour inside the ball while it is
 * closer.  |x - p - r|^2 = err + 2 - 2 r.(x - p) and |p + r|^2 = |p|^2 + 2 r.p + 2.  The step
 * taken is the least distance over the roots inside the ball if that is below err - gain, so
 * only the roots below err - gain need the ball checked, and the least of those, first in the
 * codebook's order on a tie, is the step: the same as the least over every root inside the
 * ball.  r.p is exact (p and r are multiples of 1/2 in the ball), so its order of summation
 * does not matter. */
static void
descend(const double x[DIM], double point[DIM], double err)
{
    for (int step = 0; step < DESCENT_STEPS; step++) {
        double d[DIM];
        for (int k = 0; k < DIM; k++)
            d[k] = x[k] - point[k];
        Look look;
        look.start = err + 2.0;
        look.limit = err - DESCENT_GAIN;
        look.count = 0;
        look_around(d, &look);
        double base = norm2(point) + 2.0, picked = INFINITY;
        int pick = -1;
        for (int c = 0; c < look.count; c++) {
            int s = look.slot[c];
            double after = look.after[c];
            if (after > picked || (after == picked && ROOT_CODE[s] > ROOT_CODE[pick]))
                continue;
            double along = 0.0;
            for (int k = 0; k < DIM; k++)
                along += ROOT[s][k] * point[k];
            if (base + 2.0 * along > NORM2 + NORM_SLACK)
                continue;
            picked = after;
            pick = s;
        }
        if (pick < 0)
            return;
        for (int k = 0; k < DIM; k++)
            point[k] += ROOT[pick][k];
        err = picked;
    }
}

/* Rules 3-4 for one row whose nearest lattice point (rule 2) is `point`: its code, with `point`
 * moved into the ball where it lay outside, or -1 (the descent left the book: a bug). */
static Py_ssize_t
encode_row(const double x[DIM], double point[DIM])
{
    Py_ssize_t index = index_of(point);
    if (index >= 0)
        return index;
    double err = shrunk(x, point);
    if (!isfinite(err))
        return -1;
    descend(x, point, err);
    return index_of(point);
}

/* One level's search of one row for encode_scaled_row: the row over the level (a level of 0
 * codes the origin) and its point; `found` once the point lies in the ball, then `err`, the
 * squared distance from the point times the level to x (rule 2's sum); until then (the slow
 * path owed) `bound`, a lower bound of that error (encode_scaled_row's rules a and b).  The
 * point's code is counted only for the level that wins. */
typedef struct {
    double level, scaled[DIM], point[DIM], err, bound;
    int found;
} LevelSearch;

static double
level_err(const double x[DIM], const double point[DIM], double level)
{
    double miss[DIM];
    for (int k = 0; k < DIM; k++)
        miss[k] = point[k] * level - x[k];
    return norm2(miss);
}

/* The fast path at each lane's level (rule 2: the nearest lattice point) into each lane's
 * search: the scaled row, its point, `found` and, where found, `err`; the bound is owed
 * (fast_bound). */
static void
search_fast_lanes(const Vec x[DIM], Vec level, LevelSearch s[LANES])
{
    Vec scaled[DIM], point[DIM], miss[DIM];
    Mask positive = level > 0.0;
    Vec divisor = pick(positive, level, splat(1.0));
    for (int k = 0; k < DIM; k++)
        scaled[k] = pick(positive, x[k] / divisor, splat(0.0));
    nearest_e8_lanes(scaled, point);
    for (int k = 0; k < DIM; k++)
        miss[k] = point[k] * level - x[k];
    Mask found = norm2_lanes(point) <= NORM2 + NORM_SLACK;
    Vec err = norm2_lanes(miss);
    for (int r = 0; r < LANES; r++) {
        s[r].level = level[r];
        for (int k = 0; k < DIM; k++) {
            s[r].scaled[k] = scaled[k][r];
            s[r].point[k] = point[k][r];
        }
        s[r].found = found[r] != 0;
        s[r].err = err[r];
    }
}

/* Where the fast path left the ball: the bound of encode_scaled_row's rules a and b (`gap`:
 * x's norm less the level's radius). */
static void
fast_bound(double gap, LevelSearch *s)
{
    double level = s->level;
    double far = distance2(s->scaled, s->point), scaled2 = norm2(s->scaled);
    double lattice = far > LATTICE_SLACK * (scaled2 + 1.0) ? level * level * far : 0.0;
    double ball = 0.0;
    if (gap > 0.0) {
        double onto[DIM], nearest[DIM], factor = sqrt(NORM2 + NORM_SLACK) / sqrt(scaled2);
        for (int k = 0; k < DIM; k++)
            onto[k] = s->scaled[k] * factor;
        nearest_e8(onto, nearest);
        double apart = distance2(onto, nearest);
        ball = gap * gap + (apart > ONTO_SLACK ? level * level * apart * (1.0 - ONTO_SLACK) : 0.0);
    }
    s->bound = lattice > ball ? lattice : ball;
}

/* The slow path owed by the fast one (rule 4: the shrink and the descent): 0, or -1 where it
 * finds no point in the ball (a bug). */
static int
search_slow(const double x[DIM], LevelSearch *s)
{
    double err = shrunk(s->scaled, s->point);
    if (!isfinite(err))
        return -1;
    descend(s->scaled, s->point, err);
    if (!in_ball(s->point))
        return -1;
    s->found = 1;
    s->err = level_err(x, s->point, s->level);
    return 0;
}

/* Whether an error of at least `bound` surely exceeds `err` (PRUNE_MARGIN for rounding). */
static inline int
surely_above(double bound, double err)
{
    return bound > err * (1.0 + PRUNE_MARGIN);
}

/* _e8_codec rule 4b for one row of the rotated vector, given both levels' fast paths (`s`: the
 * low level, the high level; search_fast_lanes): the code of the nearer of its two levels'
 * points (times the level) to x, the low level on a tie, or -1; `high` says which.
 * A level whose fast path leaves the ball owes the costly slow path (the shrink and the
 * descent); it is skipped where it cannot win, which changes no code or flag.  In the row over
 * the level, s = x / level, every point the level can take is a lattice point in the ball of
 * radius R = sqrt(NORM2 + NORM_SLACK), so its error over level^2 is at least:
 * a. where s lies outside that ball, (|s| - R)^2 plus the squared distance from s's projection
 *    onto the sphere, s R / |s|, to its nearest lattice point (the ball is convex: for any p in
 *    it, |s - p|^2 >= |s - proj|^2 + |proj - p|^2).  The first term is taken in x's units as
 *    the gap |x| - R level; the second, whose rounding (~1e-15) is absolute, only above
 *    ONTO_SLACK and shrunk by that fraction.
 * b. the squared distance from s to its nearest lattice point, the fast path's (rounding moves
 *    it by ~1e-16 of |s|: used only where it is above LATTICE_SLACK of |s|^2 + 1).
 *    A level's bound is the larger of a and b.
 * c. A skipped level must lose: the low one only where its bound is above the high one's error
 *    (a tie is the low level's), the high one where its bound is above the low one's, both
 *    with PRUNE_MARGIN for the rounding of the errors; so where both owe the slow path, the
 *    one of the smaller bound is searched first.  Where the high level's fast path lands in
 *    the ball, the low level's gap alone may skip the rest of its search.
 * d. Rows are float32 and levels float32 (encode_scaled), so s and its squared norm are
 *    finite: the slow path always finds a point (-1 stays a bug's), and skipping a search
 *    cannot hide one.
 * The code is counted (rank_of) only for the level that wins. */
static Py_ssize_t
encode_scaled_row(const double x[DIM], LevelSearch *s[2], uint8_t *high)
{
    double norm = sqrt(norm2(x)), radius = sqrt(NORM2 + NORM_SLACK);
    if (!s[1]->found)
        fast_bound(norm - radius * s[1]->level, s[1]);
    double low_gap = norm - radius * s[0]->level;
    if (s[1]->found && low_gap > 0.0 && surely_above(low_gap * low_gap, s[1]->err)) {
        *high = 1;
        return rank_of(s[1]->point);
    }
    if (!s[0]->found)
        fast_bound(low_gap, s[0]);
    if (!s[0]->found && !s[1]->found && search_slow(x, s[s[1]->bound < s[0]->bound]) < 0)
        return -1;
    for (int j = 0; j < 2; j++) {
        if (s[j]->found)
            continue;
        if (surely_above(s[j]->bound, s[1 - j]->err)) {
            *high = (uint8_t)(1 - j);
            return rank_of(s[1 - j]->point);
        }
        if (search_slow(x, s[j]) < 0)
            return -1;
    }
    *high = s[1]->err < s[0]->err;
    return rank_of(s[*high]->point);
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

/* What one call does over its checked rows (n rows of 8 float64 at x, the out buffer): 0, or
 * -1 with an exception set. */
typedef int (*RowsJob)(const double *x, Py_ssize_t n, void *out);

/* The boundary of a call taking (rows, out): rows of 8 finite float64, `out_per_row` items of
 * one of `out_formats` per row in a writable out; `job` runs over them. */
static PyObject *
run_on_rows(PyObject *args, const char *rows_name, const char *out_formats,
            Py_ssize_t out_itemsize, Py_ssize_t out_per_row, RowsJob job)
{
    PyObject *rows_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OO", &rows_obj, &out_obj))
        return NULL;
    Py_buffer rows, out;
    if (get_buffer(rows_obj, &rows, rows_name, "d", 8, 0) < 0)
        return NULL;
    if (get_buffer(out_obj, &out, "out", out_formats, out_itemsize, 1) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = row_count(&rows, &out, out_per_row);
    if (n >= 0) {
        Py_ssize_t bad = first_bad_row(rows.buf, n);
        if (bad >= 0)
            bad_row(bad);
        else if (job(rows.buf, n, out.buf) == 0)
            result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

/* `nearest` over n rows into rows of out, the GIL released. */
static int
nearest_rows(const double *x, Py_ssize_t n, double *out,
             void (*nearest)(const double[DIM], double[DIM]))
{
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        nearest(x + i * DIM, out + i * DIM);
    Py_END_ALLOW_THREADS
    return 0;
}

static int
nearest_d8_job(const double *x, Py_ssize_t n, void *out)
{
    return nearest_rows(x, n, out, nearest_d8);
}

static int
nearest_e8_job(const double *x, Py_ssize_t n, void *out)
{
    return nearest_rows(x, n, out, nearest_e8);
}

static int
keys_job(const double *p, Py_ssize_t n, void *out)
{
    for (Py_ssize_t i = 0; i < n; i++)
        ((int64_t *)out)[i] = key_of(p + i * DIM);
    return 0;
}

/* Rules 2-4 over n rows, the GIL released: 0, or -1 with an exception set (a row that found
 * no codebook point: a bug). */
static int
encode_rows(const double *x, Py_ssize_t n, uint16_t *codes)
{
    Py_ssize_t lost = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t first = 0; first < n && lost < 0; first += LANES) {
        Vec rows[DIM], points[DIM]; /* past the last row, lanes of zeros, never read back */
        for (int r = 0; r < LANES; r++)
            for (int k = 0; k < DIM; k++)
                rows[k][r] = first + r < n ? x[(first + r) * DIM + k] : 0.0;
        nearest_e8_lanes(rows, points);
        for (Py_ssize_t i = first; i < first + LANES && i < n; i++) {
            double point[DIM];
            for (int k = 0; k < DIM; k++)
                point[k] = points[k][i - first];
            Py_ssize_t index = encode_row(x + i * DIM, point);
            if (index < 0) {
                lost = i;
                break;
            }
            codes[i] = (uint16_t)index;
        }
    }
    Py_END_ALLOW_THREADS
    if (lost < 0)
        return 0;
    PyErr_Format(PyExc_AssertionError, "E8 row %zd found no codebook point", lost);
    return -1;
}

static int
encode_job(const double *x, Py_ssize_t n, void *out)
{
    return encode_rows(x, n, out);
}

static PyObject *
e8core_nearest_d8(PyObject *module, PyObject *args)
{
    return run_on_rows(args, "rows", "d", 8, DIM, nearest_d8_job);
}

static PyObject *
e8core_nearest_e8(PyObject *module, PyObject *args)
{
    return run_on_rows(args, "rows", "d", 8, DIM, nearest_e8_job);
}

static PyObject *
e8core_keys(PyObject *module, PyObject *args)
{
    return run_on_rows(args, "points", "lq", 8, 1, keys_job);
}

static PyObject *
e8core_encode(PyObject *module, PyObject *args)
{
    return run_on_rows(args, "rows", "H", 2, 1, encode_job);
}

/* Releases the buffers of a call, in any number (NULL-terminated). */
static void
release_all(Py_buffer **views)
{
    for (; *views != NULL; views++)
        PyBuffer_Release(*views);
}

/* Gets the buffers of a call, each a C-contiguous run of items of its format, writable where
 * asked; on a failure the ones already got are released: 0, or -1 with an exception set. */
static int
get_buffers(PyObject **objs, Py_buffer **views, const char **names, const char **formats,
            const Py_ssize_t *itemsizes, const int *writable, int count)
{
    for (int i = 0; i < count; i++) {
        if (get_buffer(objs[i], views[i], names[i], formats[i], itemsizes[i], writable[i]) < 0) {
            views[i] = NULL;
            release_all(views);
            return -1;
        }
    }
    return 0;
}

/* _e8_codec rule 4b over the rotated vectors of a block: rows of `dim` float32 (token-heads,
 * dim a multiple of 8), each token-head's uint8 scale index and the two levels of every index
 * (float32 [256, 2]: _e8_codec's SCALE_LEVELS at its two block steps).  Each 8-block's row and
 * levels are taken to float64 (exact) and coded as encode_scaled_row codes them: its code and
 * which level, the GIL released. */
static PyObject *
e8core_encode_scaled(PyObject *module, PyObject *args)
{
    PyObject *objs[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4]))
        return NULL;
    Py_buffer rotated, scales, table, codes, high;
    Py_buffer *views[] = {&rotated, &scales, &table, &codes, &high, NULL};
    const char *names[] = {"rotated", "scales", "table", "codes", "high"};
    const char *formats[] = {"f", "B", "f", "H", "B"};
    const Py_ssize_t sizes[] = {4, 1, 4, 2, 1};
    const int writable[] = {0, 0, 0, 1, 1};
    if (get_buffers(objs, views, names, formats, sizes, writable, 5) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t values = rotated.len / 4, heads = scales.len, n = values / DIM;
    if (table.len / 4 != 2 * 256 || heads == 0 || values % heads || (values / heads) % DIM
        || codes.len / 2 != n || high.len != n) {
        PyErr_Format(PyExc_ValueError,
                     "rows of a multiple of 8 per scale, a table of 512 levels and a code and a "
                     "flag per 8-block, got %zd values, %zd scales, %zd levels, %zd codes and "
                     "%zd flags", values, heads, table.len / 4, codes.len / 2, high.len);
        goto done;
    }
    const float *x = rotated.buf, *level = table.buf;
    const uint8_t *scale = scales.buf;
    Py_ssize_t blocks = n / heads;
    for (Py_ssize_t i = 0; i < 2 * 256; i++)
        if (!(isfinite(level[i]) && level[i] >= 0.0f)) {
            PyErr_SetString(PyExc_ValueError, "levels must be finite and >= 0");
            goto done;
        }
    Py_ssize_t bad = -1, lost = -1;
    Py_BEGIN_ALLOW_THREADS
    uint16_t *code = codes.buf;
    uint8_t *flag = high.buf;
    for (Py_ssize_t first = 0; first < n && bad < 0 && lost < 0; first += LANES) {
        /* LANES rows (past the last row, lanes of zeros at level 0, never read back) */
        Vec rows[DIM], levels[2];
        for (int r = 0; r < LANES; r++) {
            Py_ssize_t i = first + r, h = i / blocks;
            for (int k = 0; k < DIM; k++)
                rows[k][r] = i < n ? x[i * DIM + k] : 0.0;
            for (int j = 0; j < 2; j++)
                levels[j][r] = i < n ? level[2 * scale[h] + j] : 0.0;
        }
        LevelSearch searches[2][LANES];
        for (int j = 0; j < 2; j++)
            search_fast_lanes(rows, levels[j], searches[j]);
        for (int r = 0; r < LANES && first + r < n; r++) {
            Py_ssize_t i = first + r;
            double row[DIM];
            for (int k = 0; k < DIM; k++)
                row[k] = rows[k][r];
            if (!isfinite(norm2(row))) {
                bad = i;
                break;
            }
            LevelSearch *s[2] = {&searches[0][r], &searches[1][r]};
            Py_ssize_t index = encode_scaled_row(row, s, flag + i);
            if (index < 0) {
                lost = i;
                break;
            }
            code[i] = (uint16_t)index;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0)
        bad_row(bad);
    else if (lost >= 0)
        PyErr_Format(PyExc_AssertionError, "E8 row %zd found no codebook point", lost);
    else
        result = Py_NewRef(Py_None);
done:
    release_all(views);
    return result;
}

/* _e8_codec rule 8's first half: each code's codebook point (POINT, halved: exact in float32)
 * times its level, a float32 product, into rows of 8 float32.  A token-head has `width` bytes
 * of scales: its index, then (width > 1) a flag per 8-block, packed little bit first; its
 * blocks' level is table[index] (width 1, table [256]) or table[2 * index + flag] (table [256,
 * 2]).  A code beyond the codebook is a ValueError. */
static PyObject *
e8core_decode_scaled(PyObject *module, PyObject *args)
{
    PyObject *objs[4];
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOnOO", &objs[0], &objs[1], &width, &objs[2], &objs[3]))
        return NULL;
    Py_buffer codes, scales, table, out;
    Py_buffer *views[] = {&codes, &scales, &table, &out, NULL};
    const char *names[] = {"codes", "scales", "table", "out"};
    const char *formats[] = {"H", "B", "f", "f"};
    const Py_ssize_t sizes[] = {2, 1, 4, 4};
    const int writable[] = {0, 0, 0, 1};
    if (get_buffers(objs, views, names, formats, sizes, writable, 4) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = codes.len / 2;
    Py_ssize_t heads = width > 0 ? scales.len / width : 0;
    Py_ssize_t blocks = heads > 0 ? n / heads : 0;
    if (width < 1 || heads == 0 || scales.len % width || n % heads
        || (width > 1 && width != 1 + (blocks + 7) / 8) || table.len / 4 != (width > 1 ? 512 : 256)
        || out.len / 4 != n * DIM) {
        PyErr_Format(PyExc_ValueError,
                     "%zd codes with %zd scale bytes of width %zd, a table of %zd levels and %zd "
                     "out do not fit", n, scales.len, width, table.len / 4, out.len / 4);
        goto done;
    }
    const uint16_t *code = codes.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (code[i] >= CODEBOOK_SIZE) {
            PyErr_Format(PyExc_ValueError, "E8 code %d is beyond the %d-point codebook",
                         (int)code[i], CODEBOOK_SIZE);
            goto done;
        }
    const uint8_t *scale = scales.buf;
    const float *level = table.buf;
    float *row = out.buf;
    for (Py_ssize_t th = 0; th < heads; th++) {
        const uint8_t *meta = scale + th * width;
        for (Py_ssize_t b = 0; b < blocks; b++, row += DIM) {
            float at = width > 1 ? level[2 * meta[0] + (meta[1 + b / 8] >> (b % 8) & 1)]
                                 : level[meta[0]];
            const int8_t *q = POINT[code[th * blocks + b]];
            for (int k = 0; k < DIM; k++)
                row[k] = ((float)q[k] * 0.5f) * at;
        }
    }
    result = Py_NewRef(Py_None);
done:
    release_all(views);
    return result;
}

/* numpy's float32 sum of n values (its pairwise_sum, as add.reduce runs it over a contiguous
 * axis): under 8 in order; up to 128 in 8 running sums, combined pairwise, then the rest in
 * order; beyond, the two halves (the first a multiple of 8) summed so and added. */
static float
numpy_sum(const float *a, Py_ssize_t n)
{
    if (n < 8) {
        float res = 0.0f;
        for (Py_ssize_t i = 0; i < n; i++)
            res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        Py_ssize_t i;
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    }
    Py_ssize_t half = n / 2;
    half -= half % 8;
    return numpy_sum(a, half) + numpy_sum(a + half, n - half);
}

/* _e8_codec rule 4 over rows of `dim` float32: each row's uint8 scale index, from the float32
 * RMS / tau as numpy computed it (np.square, then mean: 0 + the pairwise sum, divided by dim;
 * np.sqrt; divided by tau), then the count of the 254 cuts (float64) below it, plus 1; 0 where
 * the RMS is not above 0. */
static PyObject *
e8core_token_scales(PyObject *module, PyObject *args)
{
    PyObject *objs[3];
    float tau;
    if (!PyArg_ParseTuple(args, "OfOO", &objs[0], &tau, &objs[1], &objs[2]))
        return NULL;
    Py_buffer rotated, cuts, out;
    Py_buffer *views[] = {&rotated, &cuts, &out, NULL};
    const char *names[] = {"rotated", "cuts", "out"};
    const char *formats[] = {"f", "d", "B"};
    const Py_ssize_t sizes[] = {4, 8, 1};
    const int writable[] = {0, 0, 1};
    if (get_buffers(objs, views, names, formats, sizes, writable, 3) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t values = rotated.len / 4, rows = out.len, count = cuts.len / 8;
    if (rows == 0 || values % rows || values / rows > 4096 || count != 254) {
        PyErr_Format(PyExc_ValueError,
                     "%zd values in %zd rows (at most 4096 a row) and %zd cuts (254) do not fit",
                     values, rows, count);
        goto done;
    }
    Py_ssize_t dim = values / rows;
    const float *x = rotated.buf;
    const double *cut = cuts.buf;
    uint8_t *index = out.buf;
    float square[4096];
    for (Py_ssize_t row = 0; row < rows; row++) {
        const float *v = x + row * dim;
        for (Py_ssize_t i = 0; i < dim; i++)
            square[i] = v[i] * v[i];
        float mean = (0.0f + numpy_sum(square, dim)) / (float)dim;
        float rms = sqrtf(mean) / tau;
        double wide = rms;
        Py_ssize_t low = 0, high = count; /* the first cut >= wide: numpy's searchsorted */
        while (low < high) {
            Py_ssize_t mid = low + (high - low) / 2;
            if (cut[mid] < wide)
                low = mid + 1;
            else
                high = mid;
        }
        index[row] = rms > 0.0f ? (uint8_t)(1 + low) : 0;
    }
    result = Py_NewRef(Py_None);
done:
    release_all(views);
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

/* _e8_codec rule 2: each token-head's row times its head's matrix, out[i] = sum over j of
 * x[j] * m[i][j], summed in float32 in the order of j from 0 (rule 1: a fixed order, so the
 * same bits on every machine; the loop runs over i innermost, reading the matrix transposed,
 * `columns`[h][j][i] = m[h][i][j], which a compiler may spread over SIMD lanes without changing
 * any element's order of addition). */
static void
transform_rows(const float *x, const float *columns, float *out, Py_ssize_t rows,
               Py_ssize_t heads, Py_ssize_t dim)
{
    /* CHUNK outputs summed at once, in registers: PARTS vectors of the build's width, stored
     * part by part (one copy of the whole array kept it in memory: 3x the time). */
#ifdef __AVX__
    enum { FLOATS = 8 };
#else
    enum { FLOATS = 4 };
#endif
    enum { CHUNK = 16, PARTS = CHUNK / FLOATS };
    typedef float Floats __attribute__((vector_size(4 * FLOATS)));
    for (Py_ssize_t row = 0; row < rows; row++) {
        const float *v = x + row * dim;
        const float *m = columns + (row % heads) * dim * dim;
        float *o = out + row * dim;
        Py_ssize_t first = 0;
        for (; first + CHUNK <= dim; first += CHUNK) {
            Floats sum[PARTS] = {{0.0f}};
            for (Py_ssize_t j = 0; j < dim; j++) {
                Floats vj = {0.0f};
                vj += v[j];
                for (int p = 0; p < PARTS; p++) {
                    Floats column;
                    memcpy(&column, m + j * dim + first + p * FLOATS, sizeof(column));
                    sum[p] += vj * column;
                }
            }
            for (int p = 0; p < PARTS; p++)
                memcpy(o + first + p * FLOATS, &sum[p], sizeof(sum[p]));
        }
        for (Py_ssize_t i = first; i < dim; i++) {
            float sum = 0.0f;
            for (Py_ssize_t j = 0; j < dim; j++)
                sum += v[j] * m[j * dim + i];
            o[i] = sum;
        }
    }
}

static PyObject *
e8core_transform(PyObject *module, PyObject *args)
{
    PyObject *objs[3];
    Py_ssize_t heads, dim;
    if (!PyArg_ParseTuple(args, "OOnnO", &objs[0], &objs[1], &heads, &dim, &objs[2]))
        return NULL;
    if (heads < 1 || dim < 1) {
        PyErr_Format(PyExc_ValueError, "heads and dim must be positive, got %zd and %zd", heads,
                     dim);
        return NULL;
    }
    Py_buffer rows, columns, out;
    Py_buffer *views[] = {&rows, &columns, &out, NULL};
    const char *names[] = {"rows", "columns", "out"};
    const char *formats[] = {"f", "f", "f"};
    const Py_ssize_t sizes[] = {4, 4, 4};
    const int writable[] = {0, 0, 1};
    if (get_buffers(objs, views, names, formats, sizes, writable, 3) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t values = rows.len / 4;
    if (values % (heads * dim) || out.len != rows.len || columns.len / 4 != heads * dim * dim) {
        PyErr_Format(PyExc_ValueError,
                     "rows of %zd heads x %zd, columns [%zd, %zd, %zd] and out of the rows' "
                     "size, got %zd, %zd and %zd values", heads, dim, heads, dim, dim, values,
                     columns.len / 4, out.len / 4);
    } else {
        Py_BEGIN_ALLOW_THREADS
        transform_rows(rows.buf, columns.buf, out.buf, values / dim, heads, dim);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    release_all(views);
    return result;
}

static PyMethodDef e8core_methods[] = {
    {"hadamard", e8core_hadamard, METH_VARARGS,
     "hadamard(rows, dim, out): x @ H / sqrt(dim) along rows of dim float32."},
    {"transform", e8core_transform, METH_VARARGS,
     "transform(rows, columns, heads, dim, out): each row of dim float32 times its head's "
     "matrix (columns: the matrices transposed, float32 [heads, dim, dim]), in a fixed order."},
    {"nearest_d8", e8core_nearest_d8, METH_VARARGS,
     "nearest_d8(rows, out): the nearest point of D8 to each row of 8 (float64)."},
    {"nearest_e8", e8core_nearest_e8, METH_VARARGS,
     "nearest_e8(rows, out): the nearest point of E8 to each row of 8 (float64)."},
    {"keys", e8core_keys, METH_VARARGS,
     "keys(points, out): the codebook key (int64) of each lattice point."},
    {"encode", e8core_encode, METH_VARARGS,
     "encode(rows, out): the code (uint16) of each row of 8."},
    {"encode_scaled", e8core_encode_scaled, METH_VARARGS,
     "encode_scaled(rotated, scales, table, codes, high): each 8-block of rows of float32 coded "
     "at the nearer of its token-head's two levels (table float32 [256, 2] by the uint8 scale "
     "index); its code (uint16) and which level (uint8, 1: the second)."},
    {"token_scales", e8core_token_scales, METH_VARARGS,
     "token_scales(rotated, tau, cuts, out): each row's uint8 scale index (rows of float32, "
     "254 float64 cuts)."},
    {"decode_scaled", e8core_decode_scaled, METH_VARARGS,
     "decode_scaled(codes, scales, width, table, out): each code's codebook point times its "
     "level (table by scale index, and flag where width > 1) into rows of 8 float32."},
    {NULL}};

#ifdef E8CORE_AVX2
#define MODULE_NAME "_e8core_avx2"
#define MODULE_INIT PyInit__e8core_avx2
#else
#define MODULE_NAME "_e8core"
#define MODULE_INIT PyInit__e8core
#endif

static struct PyModuleDef e8core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "backends.engine.kv.codecs." MODULE_NAME,
    .m_doc = "The E8 codec's per-row arithmetic in C (issue 14).",
    .m_size = -1,
    .m_methods = e8core_methods,
};

/* Whether this CPU runs the x86-64-v3 build (AVX2 and the rest of that level). */
static int
runs_avx2(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v3") != 0;
#else
    return 0;
#endif
}

/* The rule's constants, for _e8.py to export (CODEBOOK_NORM2, SHRINK); the build's LANES and
 * whether the CPU runs the AVX2 build (RUNS_AVX2), for _e8builds.py. */
PyMODINIT_FUNC
MODULE_INIT(void)
{
    if (build_below() != CODEBOOK_SIZE) {
        PyErr_SetString(PyExc_AssertionError, "E8 codebook counted wrong");
        return NULL;
    }
    build_roots();
    if (build_points() < 0) {
        PyErr_SetString(PyExc_AssertionError, "E8 codebook points counted wrong");
        return NULL;
    }
    PyObject *module = PyModule_Create(&e8core_module);
    if (module == NULL)
        return NULL;
    PyObject *shrink = Py_BuildValue("(dd)", SHRINK_FIRST, 1.0 - 1.0 / sqrt(NORM2));
    if (PyModule_AddIntConstant(module, "CODEBOOK_NORM2", NORM2_INT) < 0
        || PyModule_AddIntConstant(module, "DESCENT_STEPS", DESCENT_STEPS) < 0
        || PyModule_AddIntConstant(module, "CODEBOOK_SIZE", CODEBOOK_SIZE) < 0
        || PyModule_AddIntConstant(module, "LANES", LANES) < 0
        || PyModule_AddObjectRef(module, "RUNS_AVX2", runs_avx2() ? Py_True : Py_False) < 0
        || PyModule_AddObject(module, "SHRINK", shrink) < 0) {
        Py_XDECREF(shrink);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
