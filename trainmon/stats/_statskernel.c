/*
 * trainmon.stats._statskernel: the native CPU backend of the stats kernel (trainmon/stats/native.py).
 *
 * One fused pass over a tensor's memory computes the 8 partial statistics
 *     numel, nans, infs, zeros(|x| <= eps), min, max, sum, sumsq   (min..sumsq over finite elements)
 * and writes them as 8 float64 values to a caller-provided address (a row of a float64 torch tensor).
 *
 * Plain C + CPython API only (no torch headers): the Python layer passes raw integers
 * (tensor.data_ptr(), numel, a dtype code, eps, out.data_ptr() + row * 64).
 *
 * Vectorisation: the float kernels are written once with GCC/Clang vector extensions and instantiated per
 * instruction set at native width (SSE2: 4 lanes, AVX2+FMA+F16C: 8, AVX-512: 16; hand-tuned lane steps for
 * AVX2 and AVX-512), picked at import time from the CPU (__builtin_cpu_supports), so the build needs no
 * -march flag. Other GNU targets (aarch64, ...) get the portable vector code, other compilers a scalar loop.
 * No -ffast-math: NaN/Inf handling relies on IEEE comparisons.
 * fp32/fp16/bf16 accumulate in fp32 within blocks of BLOCK elements (16..64 additions per lane); block sums
 * are folded into per-lane doubles, so sums are close to float64 accuracy without any fp64 copy of the data.
 * Integers: exact int64 counts and sums (sumsq in double for int32/int64).
 *
 * Threads: work above a size threshold is split across `nthreads` threads of torch's OpenMP pool (see
 * "threads" below); the GIL is released around the computation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* dtype codes, mirrored in trainmon/stats/native.py (CODES) */
enum {
    DT_F32 = 0,
    DT_F64 = 1,
    DT_F16 = 2,
    DT_BF16 = 3,
    DT_I64 = 4,
    DT_I32 = 5,
    DT_I16 = 6,
    DT_I8 = 7,
    DT_U8 = 8,
    DT_BOOL = 9,
    DT_COUNT = 10
};

static const int ELSIZE[DT_COUNT] = {4, 8, 2, 2, 8, 4, 2, 1, 1, 1};

/* A call is split across at most (elements / g_thread_min) threads: each thread gets >= 32K elements
 * (measured on 2 cores: with torch's pool warm, 2 threads win from ~32K elements per thread). */
static int64_t g_thread_min = 1 << 15;
/* Above this many elements the GIL is released. */
#define GIL_RELEASE_MIN 16384
/* Elements per fp32 accumulation block (per lane: BLOCK / (2 * lanes) fp32 additions). */
#define BLOCK 512
/* Max elements per call of a float kernel (keeps int32 lane counters far from overflow). */
#define CHUNK ((int64_t)1 << 30)

#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

typedef struct {
    int64_t nans, infs, zeros;
    double mn, mx, sum, sumsq;
} acc_t;

/* fused Adam: update = (m * ic1) / (sqrt(v * ic2) + eps), ratio = (m * ic1) / sqrt(v * ic2)
 * A parameter whose gradient has always been exactly zero (an attention key bias, say) has m = v = 0; its ratio
 * is taken as 0 (Adam's update there is 0), not 0/0 = NaN: where m == 0 the root gets 1 added. m != 0 with v == 0
 * still gives inf, and NaN stays NaN. */
#define RATIO_DEN(SFX, M, Q) ((Q) + as_f_##SFX(((vu_##SFX)((M) == 0)) & ((vu_##SFX){0} + 0x3f800000u)))
#define RATIO_DEN1(M, Q) ((Q) + ((M) == 0.0f ? 1.0f : 0.0f))
typedef struct {
    float ic1, ic2, eps, zeps;
} adam_par_t;

static void acc_init(acc_t *a) {
    a->nans = a->infs = a->zeros = 0;
    a->mn = INFINITY;
    a->mx = -INFINITY;
    a->sum = a->sumsq = 0.0;
}

static void acc_merge(acc_t *a, const acc_t *b) {
    a->nans += b->nans;
    a->infs += b->infs;
    a->zeros += b->zeros;
    if (b->mn < a->mn) a->mn = b->mn;
    if (b->mx > a->mx) a->mx = b->mx;
    a->sum += b->sum;
    a->sumsq += b->sumsq;
}

static void acc_store(const acc_t *a, int64_t numel, double *out) {
    out[0] = (double)numel;
    out[1] = (double)a->nans;
    out[2] = (double)a->infs;
    out[3] = (double)a->zeros;
    out[4] = a->mn;
    out[5] = a->mx;
    out[6] = a->sum;
    out[7] = a->sumsq;
}

/* Largest float f with (double)f <= eps: then for any float x, |x| <= f  <=>  (double)|x| <= eps. */
static float eps_to_float(double eps) {
    if (!(eps == eps)) return NAN;
    float f = (float)eps;
    if ((double)f > eps) f = nextafterf(f, -INFINITY);
    return f;
}

/* ------------------------------------------------------------------------------------------------ */
/* scalar element conversions (tails)                                                                */

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t bits;
    float f;
    if (em >= 0x7c00u) {
        bits = (em << 13) | 0x7f800000u;
    } else if (em < 0x0400u) {
        f = (float)em * 0x1p-24f;
        memcpy(&bits, &f, 4);
    } else {
        bits = (em << 13) + (112u << 23);
    }
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if defined(__GNUC__) && !defined(TRAINMON_SCALAR_ONLY)
/* ================================================================================================ */
/* vector kernels (GCC / Clang vector extensions), instantiated once per instruction set            */
/*                                                                                                  */
/* Each set has native-width vectors of W float lanes (SSE2: 4, AVX2: 8, AVX-512: 16) and runs two  */
/* independent lane states per step (2 * W elements) to hide latencies. Comparisons give -1/0 lane  */
/* masks: counters subtract them. Non-finite values are replaced by 0 (sums) and +-inf (min/max),   */
/* so MINPS/MAXPS never see a NaN.                                                                  */

/* Per-ISA helpers: V_TYPES(SFX, W) declares the vector types; each set defines ld_f32_SFX, ld_bf16_SFX,
 * ld_f16_SFX, vmin/vmax_SFX (floats), vmind/vmaxd_SFX (doubles), vsqrt_SFX and widen_lo/hi_SFX. */
#define V_TYPES(SFX, W)                                                                                 \
    typedef float vf_##SFX __attribute__((vector_size(4 * (W))));                                     \
    typedef int32_t vi_##SFX __attribute__((vector_size(4 * (W))));                                   \
    typedef uint32_t vu_##SFX __attribute__((vector_size(4 * (W))));                                  \
    typedef uint16_t vh_##SFX __attribute__((vector_size(2 * (W))));                                  \
    typedef double vd_##SFX __attribute__((vector_size(4 * (W))));                                    \
    typedef int64_t vl_##SFX __attribute__((vector_size(4 * (W))));

/* Generic helpers that only depend on the vector types (bit casts, selects, bf16 and soft f16 loads). */
#define V_COMMON(SFX, TGT, W)                                                                           \
    TGT INLINE vf_##SFX as_f_##SFX(vu_##SFX u) {                                                        \
        vf_##SFX f;                                                                                     \
        memcpy(&f, &u, sizeof f);                                                                       \
        return f;                                                                                       \
    }                                                                                                   \
    TGT INLINE vu_##SFX as_u_##SFX(vf_##SFX f) {                                                        \
        vu_##SFX u;                                                                                     \
        memcpy(&u, &f, sizeof u);                                                                       \
        return u;                                                                                       \
    }                                                                                                   \
    TGT INLINE vd_##SFX as_d_##SFX(vl_##SFX u) {                                                        \
        vd_##SFX f;                                                                                     \
        memcpy(&f, &u, sizeof f);                                                                       \
        return f;                                                                                       \
    }                                                                                                   \
    TGT INLINE vl_##SFX as_l_##SFX(vd_##SFX f) {                                                        \
        vl_##SFX u;                                                                                     \
        memcpy(&u, &f, sizeof u);                                                                       \
        return u;                                                                                       \
    }                                                                                                   \
    TGT INLINE vf_##SFX self_##SFX(vi_##SFX m, vf_##SFX a, vf_##SFX b) {                                \
        return as_f_##SFX(((vu_##SFX)m & as_u_##SFX(a)) | (~(vu_##SFX)m & as_u_##SFX(b)));             \
    }                                                                                                   \
    TGT INLINE vd_##SFX seld_##SFX(vl_##SFX m, vd_##SFX a, vd_##SFX b) {                                \
        return as_d_##SFX((m & as_l_##SFX(a)) | (~m & as_l_##SFX(b)));                                  \
    }                                                                                                   \
    TGT INLINE vf_##SFX ld_f32_##SFX(const void *p, int64_t i) {                                        \
        vf_##SFX v;                                                                                     \
        memcpy(&v, (const float *)p + i, sizeof v);                                                     \
        return v;                                                                                       \
    }                                                                                                   \
    TGT INLINE vf_##SFX ld_bf16_##SFX(const void *p, int64_t i) {                                       \
        vh_##SFX h;                                                                                     \
        memcpy(&h, (const uint16_t *)p + i, sizeof h);                                                  \
        return as_f_##SFX(__builtin_convertvector(h, vu_##SFX) << 16);                                  \
    }                                                                                                   \
    /* IEEE half -> float by bit manipulation (exact, branch free) */                                   \
    TGT INLINE vf_##SFX ld_f16soft_##SFX(const void *p, int64_t i) {                                    \
        vh_##SFX h;                                                                                     \
        memcpy(&h, (const uint16_t *)p + i, sizeof h);                                                  \
        vu_##SFX u = __builtin_convertvector(h, vu_##SFX);                                              \
        vu_##SFX sign = (u & 0x8000u) << 16, em = u & 0x7fffu;                                          \
        vu_##SFX normal = (em << 13) + (112u << 23), special = (em << 13) | 0x7f800000u;                \
        vf_##SFX sub = __builtin_convertvector((vi_##SFX)em, vf_##SFX) * 0x1p-24f;                      \
        vi_##SFX isspecial = em >= 0x7c00u, issub = em < 0x0400u;                                       \
        vu_##SFX r = ((vu_##SFX)isspecial & special) | (~(vu_##SFX)isspecial & normal);                 \
        r = ((vu_##SFX)issub & as_u_##SFX(sub)) | (~(vu_##SFX)issub & r);                               \
        return as_f_##SFX(r | sign);                                                                    \
    }

/* Lane state: min/max over finite values, negated counters (shared by the two vectors of a step) and
 * fp32 block sums (one pair per vector of a step, to keep the add/FMA latency chains independent). */
#define V_STATE(SFX, TGT, W)                                                                            \
    typedef struct {                                                                                    \
        vf_##SFX mn, mx, bs0, bs1, bq0, bq1;                                                            \
        vi_##SFX cnan, cfin, czero;                                                                     \
    } ls_##SFX;                                                                                         \
    TGT INLINE void ls_init_##SFX(ls_##SFX *s) {                                                        \
        s->mn = (vf_##SFX){0} + INFINITY;                                                               \
        s->mx = (vf_##SFX){0} - INFINITY;                                                               \
        s->bs0 = s->bs1 = s->bq0 = s->bq1 = (vf_##SFX){0};                                              \
        s->cnan = s->cfin = s->czero = (vi_##SFX){0};                                                   \
    }                                                                                                   \
    /* fold the block sums into double accumulators d[0..3] = sum lo, sum hi, sq lo, sq hi */           \
    TGT INLINE void ls_flush_##SFX(ls_##SFX *s, vd_##SFX *d) {                                          \
        d[0] += widen_lo_##SFX(s->bs0) + widen_lo_##SFX(s->bs1);                                        \
        d[1] += widen_hi_##SFX(s->bs0) + widen_hi_##SFX(s->bs1);                                        \
        d[2] += widen_lo_##SFX(s->bq0) + widen_lo_##SFX(s->bq1);                                        \
        d[3] += widen_hi_##SFX(s->bq0) + widen_hi_##SFX(s->bq1);                                        \
        s->bs0 = s->bs1 = s->bq0 = s->bq1 = (vf_##SFX){0};                                              \
    }                                                                                                   \
    /* tail: partials of the scalar tail, whose infs field holds its count of finite values */          \
    TGT INLINE void ls_finish_##SFX(const ls_##SFX *s, const vd_##SFX *d, int64_t n, const acc_t *tail,  \
                                    acc_t *acc) {                                                       \
        *acc = *tail;                                                                                   \
        int64_t fin = acc->infs;                                                                        \
        for (int l = 0; l < (W); l++) {                                                                 \
            fin -= s->cfin[l];                                                                          \
            acc->nans -= s->cnan[l];                                                                    \
            acc->zeros -= s->czero[l];                                                                  \
            if (s->mn[l] < acc->mn) acc->mn = s->mn[l];                                                 \
            if (s->mx[l] > acc->mx) acc->mx = s->mx[l];                                                 \
        }                                                                                               \
        for (int l = 0; l < (W) / 2; l++) {                                                             \
            acc->sum += d[0][l] + d[1][l];                                                              \
            acc->sumsq += d[2][l] + d[3][l];                                                            \
        }                                                                                               \
        acc->infs = n - fin - acc->nans;                                                                \
    }

/* Generic step over two vectors (bit-select form), used where no hand-tuned step exists. */
#define V_STEP_GENERIC(SFX, TGT)                                                                        \
    TGT INLINE void ls_step2_##SFX(ls_##SFX *s, vf_##SFX v0, vf_##SFX v1, vf_##SFX veps) {              \
        const vf_##SFX vinf = (vf_##SFX){0} + INFINITY;                                                 \
        vu_##SFX b0 = as_u_##SFX(v0), b1 = as_u_##SFX(v1);                                              \
        vf_##SFX a0 = as_f_##SFX(b0 & 0x7fffffffu), a1 = as_f_##SFX(b1 & 0x7fffffffu);                  \
        vi_##SFX f0 = a0 < vinf, f1 = a1 < vinf; /* false for NaN and +-Inf */                          \
        s->cfin += f0 + f1;                                                                             \
        s->cnan += (v0 != v0) + (v1 != v1);                                                             \
        s->czero += (a0 <= veps) + (a1 <= veps);                                                        \
        vf_##SFX z0 = as_f_##SFX(b0 & (vu_##SFX)f0), z1 = as_f_##SFX(b1 & (vu_##SFX)f1);                \
        s->bs0 += z0;                                                                                   \
        s->bs1 += z1;                                                                                   \
        s->bq0 += z0 * z0;                                                                              \
        s->bq1 += z1 * z1;                                                                              \
        s->mn = vmin_##SFX(vmin_##SFX(self_##SFX(f0, v0, vinf), self_##SFX(f1, v1, vinf)), s->mn);      \
        s->mx = vmax_##SFX(vmax_##SFX(self_##SFX(f0, v0, -vinf), self_##SFX(f1, v1, -vinf)), s->mx);    \
    }

/* Scalar tail: partials of elements [i, n) in double; acc->infs receives the count of finite values. */
#define SCALAR_TAIL(acc, LD1, p, i, n, epsf)                                                            \
    do {                                                                                                \
        acc_init(acc);                                                                                  \
        for (; (i) < (n); (i)++) {                                                                      \
            float v_ = LD1(p, i), a_ = fabsf(v_);                                                       \
            (acc)->nans += (v_ != v_);                                                                  \
            (acc)->zeros += (a_ <= (epsf));                                                             \
            if (a_ < INFINITY) {                                                                        \
                (acc)->infs++;                                                                          \
                (acc)->sum += (double)v_;                                                               \
                (acc)->sumsq += (double)v_ * (double)v_;                                                \
                if (v_ < (acc)->mn) (acc)->mn = v_;                                                     \
                if (v_ > (acc)->mx) (acc)->mx = v_;                                                     \
            }                                                                                           \
        }                                                                                               \
    } while (0)

#define KERNEL_FLOAT(SFX, TGT, W, NAME, LDV, LD1)                                                       \
    TGT static void kern_##NAME##_##SFX(const void *p, int64_t n, float epsf, acc_t *acc) {             \
        ls_##SFX s;                                                                                     \
        ls_init_##SFX(&s);                                                                              \
        vd_##SFX d[4] = {{0}, {0}, {0}, {0}};                                                           \
        const vf_##SFX veps = (vf_##SFX){0} + epsf;                                                     \
        int64_t nv = n - n % (2 * (W)), i = 0;                                                          \
        while (i < nv) {                                                                                \
            int64_t end = i + BLOCK < nv ? i + BLOCK : nv;                                              \
            for (; i < end; i += 2 * (W)) ls_step2_##SFX(&s, LDV(p, i), LDV(p, i + (W)), veps);         \
            ls_flush_##SFX(&s, d);                                                                      \
        }                                                                                               \
        acc_t tail;                                                                                     \
        SCALAR_TAIL(&tail, LD1, p, i, n, epsf);                                                         \
        ls_finish_##SFX(&s, d, n, &tail, acc);                                                          \
    }

#define KERNEL_ADAM(SFX, TGT, W, NAME, LDV, LD1)                                                        \
    TGT static void adam_##NAME##_##SFX(const void *pm, const void *pv, int64_t n, adam_par_t par,      \
                                        acc_t *acc_u, acc_t *acc_r) {                                   \
        ls_##SFX su, sr;                                                                                \
        ls_init_##SFX(&su);                                                                             \
        ls_init_##SFX(&sr);                                                                             \
        vd_##SFX du[4] = {{0}, {0}, {0}, {0}}, dr[4] = {{0}, {0}, {0}, {0}};                            \
        const vf_##SFX veps = (vf_##SFX){0} + par.zeps;                                                 \
        int64_t nv = n - n % (2 * (W)), i = 0;                                                          \
        while (i < nv) {                                                                                \
            int64_t end = i + BLOCK < nv ? i + BLOCK : nv;                                              \
            for (; i < end; i += 2 * (W)) {                                                             \
                vf_##SFX m0 = LDV(pm, i) * par.ic1, m1 = LDV(pm, i + (W)) * par.ic1;                    \
                vf_##SFX q0 = vsqrt_##SFX(LDV(pv, i) * par.ic2);                                        \
                vf_##SFX q1 = vsqrt_##SFX(LDV(pv, i + (W)) * par.ic2);                                  \
                ls_step2_##SFX(&su, m0 / (q0 + par.eps), m1 / (q1 + par.eps), veps);                    \
                ls_step2_##SFX(&sr, m0 / RATIO_DEN(SFX, m0, q0), m1 / RATIO_DEN(SFX, m1, q1), veps);                                            \
            }                                                                                           \
            ls_flush_##SFX(&su, du);                                                                    \
            ls_flush_##SFX(&sr, dr);                                                                    \
        }                                                                                               \
        acc_t tu, tr;                                                                                   \
        acc_init(&tu);                                                                                  \
        acc_init(&tr);                                                                                  \
        for (; i < n; i++) {                                                                            \
            float mh = LD1(pm, i) * par.ic1, den = sqrtf(LD1(pv, i) * par.ic2);                         \
            float x[2] = {mh / (den + par.eps), mh / RATIO_DEN1(mh, den)};                                              \
            acc_t *t[2] = {&tu, &tr};                                                                   \
            for (int k = 0; k < 2; k++) {                                                               \
                float a = fabsf(x[k]);                                                                  \
                t[k]->nans += (x[k] != x[k]);                                                           \
                t[k]->zeros += (a <= par.zeps);                                                         \
                if (a < INFINITY) {                                                                     \
                    t[k]->infs++;                                                                       \
                    t[k]->sum += (double)x[k];                                                          \
                    t[k]->sumsq += (double)x[k] * (double)x[k];                                         \
                    if (x[k] < t[k]->mn) t[k]->mn = x[k];                                               \
                    if (x[k] > t[k]->mx) t[k]->mx = x[k];                                               \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        ls_finish_##SFX(&su, du, n, &tu, acc_u);                                                        \
        ls_finish_##SFX(&sr, dr, n, &tr, acc_r);                                                        \
    }

/* float64: W/2 double lanes x 2 states, accumulated in double, int64 counters. */
#define KERNEL_F64(SFX, TGT, W)                                                                         \
    typedef struct {                                                                                    \
        vd_##SFX mn, mx, sum, sq;                                                                       \
        vl_##SFX cfin, cnan, czero;                                                                     \
    } ds_##SFX;                                                                                         \
    TGT INLINE void ds_step_##SFX(ds_##SFX *s, vd_##SFX v, vd_##SFX veps) {                             \
        const vd_##SFX vinf = (vd_##SFX){0} + INFINITY;                                                 \
        vd_##SFX a = as_d_##SFX(as_l_##SFX(v) & 0x7fffffffffffffffLL);                                  \
        vl_##SFX fin = (vl_##SFX)(a < vinf);                                                            \
        s->cfin += fin;                                                                                 \
        s->cnan += (vl_##SFX)(v != v);                                                                  \
        s->czero += (vl_##SFX)(a <= veps);                                                              \
        vd_##SFX z = as_d_##SFX(as_l_##SFX(v) & fin);                                                   \
        s->sum += z;                                                                                    \
        s->sq += z * z;                                                                                 \
        s->mn = vmind_##SFX(seld_##SFX(fin, v, vinf), s->mn);                                           \
        s->mx = vmaxd_##SFX(seld_##SFX(fin, v, -vinf), s->mx);                                          \
    }                                                                                                   \
    TGT static void kern_f64_##SFX(const void *p, int64_t n, double eps, acc_t *acc) {                  \
        enum { H = (W) / 2 };                                                                           \
        const vd_##SFX veps = (vd_##SFX){0} + eps;                                                      \
        ds_##SFX s[2];                                                                                  \
        for (int k = 0; k < 2; k++) {                                                                   \
            s[k].mn = (vd_##SFX){0} + INFINITY;                                                         \
            s[k].mx = (vd_##SFX){0} - INFINITY;                                                         \
            s[k].sum = s[k].sq = (vd_##SFX){0};                                                         \
            s[k].cfin = s[k].cnan = s[k].czero = (vl_##SFX){0};                                         \
        }                                                                                               \
        int64_t nv = n - n % (2 * H), i = 0;                                                            \
        for (; i < nv; i += 2 * H) {                                                                    \
            vd_##SFX v0, v1;                                                                            \
            memcpy(&v0, (const double *)p + i, sizeof v0);                                              \
            memcpy(&v1, (const double *)p + i + H, sizeof v1);                                          \
            ds_step_##SFX(&s[0], v0, veps);                                                             \
            ds_step_##SFX(&s[1], v1, veps);                                                             \
        }                                                                                               \
        int64_t nfin = 0;                                                                               \
        acc_init(acc);                                                                                  \
        for (int k = 0; k < 2; k++)                                                                     \
            for (int l = 0; l < H; l++) {                                                               \
                nfin -= s[k].cfin[l];                                                                   \
                acc->nans -= s[k].cnan[l];                                                              \
                acc->zeros -= s[k].czero[l];                                                            \
                if (s[k].mn[l] < acc->mn) acc->mn = s[k].mn[l];                                         \
                if (s[k].mx[l] > acc->mx) acc->mx = s[k].mx[l];                                         \
                acc->sum += s[k].sum[l];                                                                \
                acc->sumsq += s[k].sq[l];                                                               \
            }                                                                                           \
        for (; i < n; i++) {                                                                            \
            double v = ((const double *)p)[i], a = fabs(v);                                             \
            acc->nans += (v != v);                                                                      \
            acc->zeros += (a <= eps);                                                                   \
            if (a < INFINITY) {                                                                         \
                nfin++;                                                                                 \
                acc->sum += v;                                                                          \
                acc->sumsq += v * v;                                                                    \
                if (v < acc->mn) acc->mn = v;                                                           \
                if (v > acc->mx) acc->mx = v;                                                           \
            }                                                                                           \
        }                                                                                               \
        acc->infs = n - nfin - acc->nans;                                                               \
    }

INLINE float ld1_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
INLINE float ld1_bf16(const void *p, int64_t i) { return bf16_to_f32(((const uint16_t *)p)[i]); }
INLINE float ld1_f16(const void *p, int64_t i) { return f16_to_f32(((const uint16_t *)p)[i]); }

/* The float kernels of one instruction set; needs V_TYPES, V_COMMON, V_STATE, ls_step_SFX and helpers. */
#define KERNEL_SET(SFX, TGT, W)                                                                         \
    KERNEL_FLOAT(SFX, TGT, W, f32, ld_f32_##SFX, ld1_f32)                                               \
    KERNEL_FLOAT(SFX, TGT, W, bf16, ld_bf16_##SFX, ld1_bf16)                                            \
    KERNEL_FLOAT(SFX, TGT, W, f16, ld_f16_##SFX, ld1_f16)                                               \
    KERNEL_ADAM(SFX, TGT, W, f32, ld_f32_##SFX, ld1_f32)                                                \
    KERNEL_ADAM(SFX, TGT, W, bf16, ld_bf16_##SFX, ld1_bf16)                                             \
    KERNEL_ADAM(SFX, TGT, W, f16, ld_f16_##SFX, ld1_f16)                                                \
    KERNEL_F64(SFX, TGT, W)

#if defined(__x86_64__) && !defined(TRAINMON_NO_DISPATCH)
#include <immintrin.h>
#define HAVE_DISPATCH 1

/* ---- x86-64 baseline: SSE2, 4 lanes ---- */
#define TGT_BASE
V_TYPES(base, 4)
V_COMMON(base, TGT_BASE, 4)
INLINE vf_base vmin_base(vf_base a, vf_base b) { return (vf_base)_mm_min_ps((__m128)a, (__m128)b); }
INLINE vf_base vmax_base(vf_base a, vf_base b) { return (vf_base)_mm_max_ps((__m128)a, (__m128)b); }
INLINE vd_base vmind_base(vd_base a, vd_base b) { return (vd_base)_mm_min_pd((__m128d)a, (__m128d)b); }
INLINE vd_base vmaxd_base(vd_base a, vd_base b) { return (vd_base)_mm_max_pd((__m128d)a, (__m128d)b); }
INLINE vf_base vsqrt_base(vf_base a) { return (vf_base)_mm_sqrt_ps((__m128)a); }
INLINE vd_base widen_lo_base(vf_base a) { return (vd_base)_mm_cvtps_pd((__m128)a); }
INLINE vd_base widen_hi_base(vf_base a) { return (vd_base)_mm_cvtps_pd(_mm_movehl_ps((__m128)a, (__m128)a)); }
/* bf16 -> f32: interleave zero low halves (SSE2 has no PMOVZXWD) */
INLINE vf_base ld_bf16sse_base(const void *p, int64_t i) {
    __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)p + i));
    return (vf_base)_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
}
#define ld_f16_base ld_f16soft_base
#define ld_bf16_base ld_bf16sse_base
V_STATE(base, TGT_BASE, 4)
V_STEP_GENERIC(base, TGT_BASE)
KERNEL_SET(base, TGT_BASE, 4)

/* ---- x86-64-v3: AVX2 + FMA + F16C, 8 lanes ---- */
#define TGT_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
V_TYPES(avx2, 8)
V_COMMON(avx2, TGT_AVX2, 8)
TGT_AVX2 INLINE vf_avx2 vmin_avx2(vf_avx2 a, vf_avx2 b) { return (vf_avx2)_mm256_min_ps((__m256)a, (__m256)b); }
TGT_AVX2 INLINE vf_avx2 vmax_avx2(vf_avx2 a, vf_avx2 b) { return (vf_avx2)_mm256_max_ps((__m256)a, (__m256)b); }
TGT_AVX2 INLINE vd_avx2 vmind_avx2(vd_avx2 a, vd_avx2 b) {
    return (vd_avx2)_mm256_min_pd((__m256d)a, (__m256d)b);
}
TGT_AVX2 INLINE vd_avx2 vmaxd_avx2(vd_avx2 a, vd_avx2 b) {
    return (vd_avx2)_mm256_max_pd((__m256d)a, (__m256d)b);
}
TGT_AVX2 INLINE vf_avx2 vsqrt_avx2(vf_avx2 a) { return (vf_avx2)_mm256_sqrt_ps((__m256)a); }
TGT_AVX2 INLINE vd_avx2 widen_lo_avx2(vf_avx2 a) {
    return (vd_avx2)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)a));
}
TGT_AVX2 INLINE vd_avx2 widen_hi_avx2(vf_avx2 a) {
    return (vd_avx2)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)a, 1));
}
TGT_AVX2 INLINE vf_avx2 ld_f16_avx2(const void *p, int64_t i) {
    return (vf_avx2)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
TGT_AVX2 INLINE vf_avx2 ld_bf16x_avx2(const void *p, int64_t i) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return (vf_avx2)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#define ld_bf16_avx2 ld_bf16x_avx2
V_STATE(avx2, TGT_AVX2, 8)
TGT_AVX2 INLINE void ls_step2_avx2(ls_avx2 *s, vf_avx2 vv0, vf_avx2 vv1, vf_avx2 veps) {
    const __m256 vinf = _mm256_set1_ps(INFINITY), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v0 = (__m256)vv0, v1 = (__m256)vv1;
    __m256 a0 = _mm256_and_ps(v0, absmask), a1 = _mm256_and_ps(v1, absmask);
    __m256 f0 = _mm256_cmp_ps(a0, vinf, _CMP_LT_OQ), f1 = _mm256_cmp_ps(a1, vinf, _CMP_LT_OQ);
    s->cfin += (vi_avx2)_mm256_castps_si256(f0) + (vi_avx2)_mm256_castps_si256(f1);
    s->cnan += (vi_avx2)_mm256_castps_si256(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q)) +
               (vi_avx2)_mm256_castps_si256(_mm256_cmp_ps(v1, v1, _CMP_UNORD_Q));
    s->czero += (vi_avx2)_mm256_castps_si256(_mm256_cmp_ps(a0, (__m256)veps, _CMP_LE_OQ)) +
                (vi_avx2)_mm256_castps_si256(_mm256_cmp_ps(a1, (__m256)veps, _CMP_LE_OQ));
    __m256 z0 = _mm256_and_ps(v0, f0), z1 = _mm256_and_ps(v1, f1);
    s->bs0 = (vf_avx2)_mm256_add_ps((__m256)s->bs0, z0);
    s->bs1 = (vf_avx2)_mm256_add_ps((__m256)s->bs1, z1);
    s->bq0 = (vf_avx2)_mm256_fmadd_ps(z0, z0, (__m256)s->bq0);
    s->bq1 = (vf_avx2)_mm256_fmadd_ps(z1, z1, (__m256)s->bq1);
    /* MINPS/MAXPS return the second operand when the first is NaN: then the blend keeps the state */
    __m256 mn = (__m256)s->mn, mx = (__m256)s->mx;
    mn = _mm256_blendv_ps(mn, _mm256_min_ps(v0, mn), f0);
    mn = _mm256_blendv_ps(mn, _mm256_min_ps(v1, mn), f1);
    mx = _mm256_blendv_ps(mx, _mm256_max_ps(v0, mx), f0);
    mx = _mm256_blendv_ps(mx, _mm256_max_ps(v1, mx), f1);
    s->mn = (vf_avx2)mn;
    s->mx = (vf_avx2)mx;
}
KERNEL_SET(avx2, TGT_AVX2, 8)

/* ---- x86-64-v4: AVX-512 (F, BW, DQ, VL), 16 lanes ---- */
#define TGT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,popcnt")))
V_TYPES(avx512, 16)
V_COMMON(avx512, TGT_AVX512, 16)
TGT_AVX512 INLINE vf_avx512 vmin_avx512(vf_avx512 a, vf_avx512 b) {
    return (vf_avx512)_mm512_min_ps((__m512)a, (__m512)b);
}
TGT_AVX512 INLINE vf_avx512 vmax_avx512(vf_avx512 a, vf_avx512 b) {
    return (vf_avx512)_mm512_max_ps((__m512)a, (__m512)b);
}
TGT_AVX512 INLINE vd_avx512 vmind_avx512(vd_avx512 a, vd_avx512 b) {
    return (vd_avx512)_mm512_min_pd((__m512d)a, (__m512d)b);
}
TGT_AVX512 INLINE vd_avx512 vmaxd_avx512(vd_avx512 a, vd_avx512 b) {
    return (vd_avx512)_mm512_max_pd((__m512d)a, (__m512d)b);
}
TGT_AVX512 INLINE vf_avx512 vsqrt_avx512(vf_avx512 a) { return (vf_avx512)_mm512_sqrt_ps((__m512)a); }
TGT_AVX512 INLINE vd_avx512 widen_lo_avx512(vf_avx512 a) {
    return (vd_avx512)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)a));
}
TGT_AVX512 INLINE vd_avx512 widen_hi_avx512(vf_avx512 a) {
    return (vd_avx512)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)a), 1)));
}
TGT_AVX512 INLINE vf_avx512 ld_f16_avx512(const void *p, int64_t i) {
    return (vf_avx512)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
}
TGT_AVX512 INLINE vf_avx512 ld_bf16x_avx512(const void *p, int64_t i) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return (vf_avx512)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#define ld_bf16_avx512 ld_bf16x_avx512
V_STATE(avx512, TGT_AVX512, 16)
/* AVX-512: comparisons give k-masks; counters, min and max use masked operations (12 ops / 16 lanes). */
TGT_AVX512 INLINE void ls_step2_avx512(ls_avx512 *s, vf_avx512 vv0, vf_avx512 vv1, vf_avx512 veps) {
    const __m512i one = _mm512_set1_epi32(1), absmask = _mm512_set1_epi32(0x7fffffff);
    const __m512 vinf = _mm512_set1_ps(INFINITY);
    __m512 v0 = (__m512)vv0, v1 = (__m512)vv1;
    __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), absmask));
    __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), absmask));
    __mmask16 f0 = _mm512_cmp_ps_mask(a0, vinf, _CMP_LT_OQ), f1 = _mm512_cmp_ps_mask(a1, vinf, _CMP_LT_OQ);
    __mmask16 n0 = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q), n1 = _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
    __mmask16 e0 = _mm512_cmp_ps_mask(a0, (__m512)veps, _CMP_LE_OQ);
    __mmask16 e1 = _mm512_cmp_ps_mask(a1, (__m512)veps, _CMP_LE_OQ);
    /* counters hold negated counts, as in the generic step */
    __m512i cfin = (__m512i)s->cfin, cnan = (__m512i)s->cnan, czero = (__m512i)s->czero;
    cfin = _mm512_mask_sub_epi32(cfin, f0, cfin, one);
    cfin = _mm512_mask_sub_epi32(cfin, f1, cfin, one);
    cnan = _mm512_mask_sub_epi32(cnan, n0, cnan, one);
    cnan = _mm512_mask_sub_epi32(cnan, n1, cnan, one);
    czero = _mm512_mask_sub_epi32(czero, e0, czero, one);
    czero = _mm512_mask_sub_epi32(czero, e1, czero, one);
    s->cfin = (vi_avx512)cfin;
    s->cnan = (vi_avx512)cnan;
    s->czero = (vi_avx512)czero;
    __m512 z0 = _mm512_maskz_mov_ps(f0, v0), z1 = _mm512_maskz_mov_ps(f1, v1);
    s->bs0 = (vf_avx512)_mm512_add_ps((__m512)s->bs0, z0);
    s->bs1 = (vf_avx512)_mm512_add_ps((__m512)s->bs1, z1);
    s->bq0 = (vf_avx512)_mm512_fmadd_ps(z0, z0, (__m512)s->bq0);
    s->bq1 = (vf_avx512)_mm512_fmadd_ps(z1, z1, (__m512)s->bq1);
    __m512 mn = (__m512)s->mn, mx = (__m512)s->mx;
    mn = _mm512_mask_min_ps(mn, f0, v0, mn);
    mn = _mm512_mask_min_ps(mn, f1, v1, mn);
    mx = _mm512_mask_max_ps(mx, f0, v0, mx);
    mx = _mm512_mask_max_ps(mx, f1, v1, mx);
    s->mn = (vf_avx512)mn;
    s->mx = (vf_avx512)mx;
}
KERNEL_SET(avx512, TGT_AVX512, 16)

#else /* other GNU targets (aarch64, ...): portable 4-lane vector code (NEON-sized) */
#define TGT_BASE
V_TYPES(base, 4)
V_COMMON(base, TGT_BASE, 4)
INLINE vf_base vmin_base(vf_base a, vf_base b) { return self_base(a < b, a, b); }
INLINE vf_base vmax_base(vf_base a, vf_base b) { return self_base(a > b, a, b); }
INLINE vd_base vmind_base(vd_base a, vd_base b) { return seld_base((vl_base)(a < b), a, b); }
INLINE vd_base vmaxd_base(vd_base a, vd_base b) { return seld_base((vl_base)(a > b), a, b); }
INLINE vf_base vsqrt_base(vf_base a) {
    for (int l = 0; l < 4; l++) a[l] = sqrtf(a[l]);
    return a;
}
INLINE vd_base widen_lo_base(vf_base a) { return (vd_base){a[0], a[1]}; }
INLINE vd_base widen_hi_base(vf_base a) { return (vd_base){a[2], a[3]}; }
#define ld_f16_base ld_f16soft_base
V_STATE(base, TGT_BASE, 4)
V_STEP_GENERIC(base, TGT_BASE)
KERNEL_SET(base, TGT_BASE, 4)
#endif

#else /* !__GNUC__: portable scalar fallbacks */

#define DEFINE_FLOAT_KERNEL(NAME, LD1)                                                 \
    static void NAME(const void *p, int64_t n, float epsf, acc_t *acc) {               \
        acc_t a;                                                                       \
        acc_init(&a);                                                                  \
        int64_t fin = 0;                                                               \
        for (int64_t i = 0; i < n; i++) {                                              \
            float v = LD1(p, i), m = fabsf(v);                                         \
            a.nans += (v != v);                                                        \
            a.zeros += (m <= epsf);                                                    \
            if (m < INFINITY) {                                                        \
                fin++;                                                                 \
                a.sum += v;                                                            \
                a.sumsq += (double)v * v;                                              \
                if (v < a.mn) a.mn = v;                                                \
                if (v > a.mx) a.mx = v;                                                \
            }                                                                          \
        }                                                                              \
        a.infs = n - fin - a.nans;                                                     \
        *acc = a;                                                                      \
    }
static float ld1_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static float ld1_bf16(const void *p, int64_t i) { return bf16_to_f32(((const uint16_t *)p)[i]); }
static float ld1_f16(const void *p, int64_t i) { return f16_to_f32(((const uint16_t *)p)[i]); }
DEFINE_FLOAT_KERNEL(kern_f32_base, ld1_f32)
DEFINE_FLOAT_KERNEL(kern_bf16_base, ld1_bf16)
DEFINE_FLOAT_KERNEL(kern_f16_base, ld1_f16)

static void kern_f64_base(const void *p, int64_t n, double eps, acc_t *acc) {
    acc_t a;
    acc_init(&a);
    int64_t fin = 0;
    for (int64_t i = 0; i < n; i++) {
        double v = ((const double *)p)[i], m = fabs(v);
        a.nans += (v != v);
        a.zeros += (m <= eps);
        if (m < INFINITY) {
            fin++;
            a.sum += v;
            a.sumsq += v * v;
            if (v < a.mn) a.mn = v;
            if (v > a.mx) a.mx = v;
        }
    }
    a.infs = n - fin - a.nans;
    *acc = a;
}


static void adam_one(acc_t *a, int64_t *fin, float x, float zeps) {
    float m = fabsf(x);
    a->nans += (x != x);
    a->zeros += (m <= zeps);
    if (m < INFINITY) {
        (*fin)++;
        a->sum += x;
        a->sumsq += (double)x * x;
        if (x < a->mn) a->mn = x;
        if (x > a->mx) a->mx = x;
    }
}
#define DEFINE_ADAM_KERNEL(NAME, LD1)                                                         \
    static void NAME(const void *pm, const void *pv, int64_t n, adam_par_t par, acc_t *acc_u, \
                     acc_t *acc_r) {                                                          \
        acc_t u, r;                                                                           \
        int64_t fu = 0, fr = 0;                                                               \
        acc_init(&u);                                                                         \
        acc_init(&r);                                                                         \
        for (int64_t i = 0; i < n; i++) {                                                     \
            float mh = LD1(pm, i) * par.ic1, den = sqrtf(LD1(pv, i) * par.ic2);               \
            adam_one(&u, &fu, mh / (den + par.eps), par.zeps);                                \
            adam_one(&r, &fr, mh / RATIO_DEN1(mh, den), par.zeps);                                            \
        }                                                                                     \
        u.infs = n - fu - u.nans;                                                             \
        r.infs = n - fr - r.nans;                                                             \
        *acc_u = u;                                                                           \
        *acc_r = r;                                                                           \
    }
DEFINE_ADAM_KERNEL(adam_f32_base, ld1_f32)
DEFINE_ADAM_KERNEL(adam_bf16_base, ld1_bf16)
DEFINE_ADAM_KERNEL(adam_f16_base, ld1_f16)
#endif

/* ---- integer kernels: exact counts, int64 min/max; sums in int64 (or __int128 / double) ---------- */

/* zero test for integers: |v| <= eps  <=>  -k <= v <= k with k = floor(eps) */
static int64_t int_zero_bound(double eps) {
    if (!(eps >= 0.0)) return -1; /* negative or NaN: nothing is a zero */
    if (eps >= 9.2e18) return INT64_MAX;
    return (int64_t)floor(eps);
}

/* small integers (8/16 bit): squares fit int32, sums of squares fit int64 */
#define DEFINE_SMALL_INT_KERNEL(NAME, T)                                                   \
    static void NAME(const void *p, int64_t n, double eps, acc_t *acc) {                   \
        const T *x = (const T *)p;                                                         \
        int64_t k = int_zero_bound(eps);                                                   \
        int64_t sum = 0, sq = 0, zeros = 0, mn = INT64_MAX, mx = INT64_MIN;                \
        for (int64_t i = 0; i < n; i++) {                                                  \
            int64_t v = x[i];                                                              \
            sum += v;                                                                      \
            sq += v * v;                                                                   \
            zeros += (v >= -k) & (v <= k);                                                 \
            mn = v < mn ? v : mn;                                                          \
            mx = v > mx ? v : mx;                                                          \
        }                                                                                  \
        acc->nans = acc->infs = 0;                                                         \
        acc->zeros = zeros;                                                                \
        acc->mn = n ? (double)mn : INFINITY;                                               \
        acc->mx = n ? (double)mx : -INFINITY;                                              \
        acc->sum = (double)sum;                                                            \
        acc->sumsq = (double)sq;                                                           \
    }

DEFINE_SMALL_INT_KERNEL(kern_i16, int16_t)
DEFINE_SMALL_INT_KERNEL(kern_i8, int8_t)
DEFINE_SMALL_INT_KERNEL(kern_u8, uint8_t)

static void kern_i32(const void *p, int64_t n, double eps, acc_t *acc) {
    const int32_t *x = (const int32_t *)p;
    int64_t k = int_zero_bound(eps);
    int64_t sum = 0, zeros = 0, mn = INT64_MAX, mx = INT64_MIN;
    double sq = 0.0;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = x[i];
        sum += v;
        sq += (double)(v * v);
        zeros += (v >= -k) & (v <= k);
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    acc->nans = acc->infs = 0;
    acc->zeros = zeros;
    acc->mn = n ? (double)mn : INFINITY;
    acc->mx = n ? (double)mx : -INFINITY;
    acc->sum = (double)sum;
    acc->sumsq = sq;
}

static void kern_i64(const void *p, int64_t n, double eps, acc_t *acc) {
    const int64_t *x = (const int64_t *)p;
    int64_t k = int_zero_bound(eps);
    int64_t zeros = 0, mn = INT64_MAX, mx = INT64_MIN;
#if defined(__SIZEOF_INT128__)
    __int128 sum = 0;
#else
    double sum = 0.0;
#endif
    double sq = 0.0;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = x[i];
        sum += v;
        sq += (double)v * (double)v;
        zeros += (v >= -k) & (v <= k);
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    acc->nans = acc->infs = 0;
    acc->zeros = zeros;
    acc->mn = n ? (double)mn : INFINITY;
    acc->mx = n ? (double)mx : -INFINITY;
    acc->sum = (double)sum;
    acc->sumsq = sq;
}

/* ---- dispatch ------------------------------------------------------------------------------------ */

typedef void (*fkern_t)(const void *, int64_t, float, acc_t *);
typedef void (*dkern_t)(const void *, int64_t, double, acc_t *);
typedef void (*akern_t)(const void *, const void *, int64_t, adam_par_t, acc_t *, acc_t *);
static struct {
    fkern_t f32, bf16, f16;
    dkern_t f64;
    akern_t a_f32, a_bf16, a_f16;
    const char *isa;
} K;

#define SET_KERNELS(SFX, NAME)                                                                          \
    do {                                                                                                \
        K.f32 = kern_f32_##SFX;                                                                         \
        K.bf16 = kern_bf16_##SFX;                                                                       \
        K.f16 = kern_f16_##SFX;                                                                         \
        K.f64 = kern_f64_##SFX;                                                                         \
        K.a_f32 = adam_f32_##SFX;                                                                       \
        K.a_bf16 = adam_bf16_##SFX;                                                                     \
        K.a_f16 = adam_f16_##SFX;                                                                       \
        K.isa = NAME;                                                                                   \
    } while (0)

/* Pick the best kernels this CPU runs, capped by `cap` ("avx512", "avx2", "baseline" or NULL). */
static void select_kernels(const char *cap) {
    SET_KERNELS(base, "baseline");
#if defined(HAVE_DISPATCH)
    int level = 2;
    if (cap && strcmp(cap, "avx2") == 0) level = 1;
    if (cap && strcmp(cap, "baseline") == 0) level = 0;
    __builtin_cpu_init();
    if (level >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        SET_KERNELS(avx512, "avx512");
    else if (level >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
        SET_KERNELS(avx2, "avx2");
#else
    (void)cap;
#endif
}

/* Partials of elements [0, n) of one tensor piece starting at p (n may be any size). */
static void compute_piece(const char *p, int64_t n, int code, double eps, float epsf, acc_t *acc) {
    acc_init(acc);
    int64_t es = ELSIZE[code];
    while (n > 0) {
        int64_t m = n < CHUNK ? n : CHUNK;
        acc_t a;
        switch (code) {
        case DT_F32: K.f32(p, m, epsf, &a); break;
        case DT_F64: K.f64(p, m, eps, &a); break;
        case DT_F16: K.f16(p, m, epsf, &a); break;
        case DT_BF16: K.bf16(p, m, epsf, &a); break;
        case DT_I64: kern_i64(p, m, eps, &a); break;
        case DT_I32: kern_i32(p, m, eps, &a); break;
        case DT_I16: kern_i16(p, m, eps, &a); break;
        case DT_I8: kern_i8(p, m, eps, &a); break;
        case DT_U8:
        case DT_BOOL: kern_u8(p, m, eps, &a); break;
        default: return;
        }
        acc_merge(acc, &a);
        p += m * es;
        n -= m;
    }
}

/* A call works on a list of tensors; threads take contiguous ranges of the concatenated elements. */
typedef struct {
    const char *ptr;
    int64_t numel;
    int code;
} item_t;

typedef struct {
    const item_t *items;
    int nitems;
    double eps;
    float epsf;
    int64_t begin, end; /* range in the concatenated element space */
    acc_t *accs;        /* indexed by item; valid for items first..last */
    int first, last;
} work_t;

static void *run_work(void *arg) {
    work_t *w = (work_t *)arg;
    int64_t base = 0;
    int first = -1, last = -2;
    for (int j = 0; j < w->nitems && base < w->end; j++) {
        int64_t n = w->items[j].numel;
        int64_t lo = base > w->begin ? base : w->begin;
        int64_t hi = base + n < w->end ? base + n : w->end;
        if (hi > lo) {
            if (first < 0) first = last = j;
            while (last < j - 1) acc_init(&w->accs[++last]); /* empty items inside the range */
            compute_piece(w->items[j].ptr + (lo - base) * ELSIZE[w->items[j].code], hi - lo,
                          w->items[j].code, w->eps, w->epsf, &w->accs[j]);
            last = j;
        }
        base += n;
    }
    w->first = first;
    w->last = last;
    return NULL;
}

/* ---- threads ------------------------------------------------------------------------------------- */
/*
 * Large calls are split across threads of the OpenMP runtime that torch has already loaded (libgomp for
 * the pip wheels; libiomp5/libomp implement the same GOMP_parallel entry point). The runtime is looked up
 * at run time with dlopen(RTLD_NOLOAD), so the extension neither links nor loads an OpenMP library of its
 * own: its work runs on torch's intra-op pool, whose workers are usually still spinning after the last
 * torch op, instead of on extra threads that would compete with that pool for the cores (measured: fresh
 * pthreads were slower than one thread right after a torch op on 2 cores). No runtime found: one thread.
 */
#if !defined(_WIN32)
#include <dlfcn.h>
#include <stdio.h>
#define HAVE_OMP_LOOKUP 1
#endif

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);
static struct {
    int state; /* 0: not looked up yet, 1: found, -1: none */
    gomp_parallel_fn parallel;
    omp_int_fn thread_num, num_threads;
    char path[1024];
} OMP;

#if defined(HAVE_OMP_LOOKUP)
static void *omp_open_loaded(void) {
    static const char *names[] = {"libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.so.5",
                                  "libomp.dylib", "libiomp5.dylib", NULL};
    for (int i = 0; names[i]; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD);
        if (h) return h;
    }
    /* renamed copies (auditwheel: libgomp-<hash>.so.1): find them among the mapped files */
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return NULL;
    char line[1400];
    void *h = NULL;
    while (!h && fgets(line, sizeof line, f)) {
        char *path = strchr(line, '/');
        if (!path || !(strstr(path, "/libgomp") || strstr(path, "/libiomp5") || strstr(path, "/libomp"))) continue;
        path[strcspn(path, "\n")] = 0;
        h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    }
    fclose(f);
    return h;
}
#endif

/* Called with the GIL held. */
static int omp_available(void) {
    if (OMP.state) return OMP.state > 0;
    OMP.state = -1;
#if defined(HAVE_OMP_LOOKUP)
    void *h = omp_open_loaded();
    if (!h) return 0;
    OMP.parallel = (gomp_parallel_fn)dlsym(h, "GOMP_parallel");
    OMP.thread_num = (omp_int_fn)dlsym(h, "omp_get_thread_num");
    OMP.num_threads = (omp_int_fn)dlsym(h, "omp_get_num_threads");
    if (!OMP.parallel || !OMP.thread_num || !OMP.num_threads) return 0;
    Dl_info info;
    if (dladdr((void *)OMP.parallel, &info) && info.dli_fname)
        snprintf(OMP.path, sizeof OMP.path, "%s", info.dli_fname);
    OMP.state = 1;
#endif
    return OMP.state > 0;
}

typedef struct {
    void *(*fn)(void *);
    char *arg;
    size_t size;
    int n;
} par_t;

static void par_body(void *p) {
    par_t *q = (par_t *)p;
    int nth = OMP.num_threads();
    for (int t = OMP.thread_num(); t < q->n; t += nth) q->fn(q->arg + (size_t)t * q->size);
}

/* Run fn(arg + t * size) for t in [0, n), on the calling thread and n - 1 workers of the OpenMP pool. */
static void run_parallel(void *(*fn)(void *), char *arg, size_t size, int n) {
    if (n > 1 && OMP.state > 0) {
        par_t q = {fn, arg, size, n};
        OMP.parallel(par_body, &q, (unsigned)n, 0);
        return;
    }
    for (int t = 0; t < n; t++) fn(arg + (size_t)t * size);
}

/* Compute the partials of all items into out (nitems rows of 8 doubles). Returns 0 or -1 (no memory). */
static int compute_items(const item_t *items, int nitems, double eps, double *out, int nthreads) {
    float epsf = eps_to_float(eps);
    int64_t total = 0;
    for (int j = 0; j < nitems; j++) total += items[j].numel;
    if (nthreads > total / g_thread_min) nthreads = (int)(total / g_thread_min);
    if (nthreads > 64) nthreads = 64;
    if (nthreads < 2 || OMP.state <= 0) {
        for (int j = 0; j < nitems; j++) {
            acc_t a;
            compute_piece(items[j].ptr, items[j].numel, items[j].code, eps, epsf, &a);
            acc_store(&a, items[j].numel, out + 8 * (int64_t)j);
        }
        return 0;
    }
    work_t works[64];
    acc_t *pool = (acc_t *)malloc(sizeof(acc_t) * (size_t)nitems * (size_t)nthreads);
    if (!pool) return -1;
    for (int t = 0; t < nthreads; t++) {
        work_t *w = &works[t];
        w->items = items;
        w->nitems = nitems;
        w->eps = eps;
        w->epsf = epsf;
        /* split at multiples of 64 elements so that pieces start at cache-line boundaries */
        int64_t b = (total * t / nthreads) & ~(int64_t)63, e = (total * (t + 1) / nthreads) & ~(int64_t)63;
        w->begin = t == 0 ? 0 : b;
        w->end = t == nthreads - 1 ? total : e;
        w->first = -1;
        w->last = -2;
        w->accs = pool + (size_t)nitems * (size_t)t;
    }
    run_parallel(run_work, (char *)works, sizeof(work_t), nthreads);
    /* merge, item by item, in thread order (deterministic for a given nthreads) */
    for (int j = 0; j < nitems; j++) {
        acc_t a;
        acc_init(&a);
        for (int t = 0; t < nthreads; t++) {
            work_t *w = &works[t];
            if (j >= w->first && j <= w->last) acc_merge(&a, &w->accs[j]);
        }
        acc_store(&a, items[j].numel, out + 8 * (int64_t)j);
    }
    free(pool);
    return 0;
}

/* ---- Adam ------------------------------------------------------------------------------------------ */

typedef struct {
    const char *pm, *pv;
    int64_t n;
    int code;
    adam_par_t par;
    acc_t u, r;
} adam_work_t;

static void *run_adam(void *arg) {
    adam_work_t *w = (adam_work_t *)arg;
    acc_init(&w->u);
    acc_init(&w->r);
    int64_t es = ELSIZE[w->code];
    const char *pm = w->pm, *pv = w->pv;
    int64_t n = w->n;
    while (n > 0) {
        int64_t m = n < CHUNK ? n : CHUNK;
        acc_t u, r;
        switch (w->code) {
        case DT_F32: K.a_f32(pm, pv, m, w->par, &u, &r); break;
        case DT_BF16: K.a_bf16(pm, pv, m, w->par, &u, &r); break;
        case DT_F16: K.a_f16(pm, pv, m, w->par, &u, &r); break;
        default: return NULL;
        }
        acc_merge(&w->u, &u);
        acc_merge(&w->r, &r);
        pm += m * es;
        pv += m * es;
        n -= m;
    }
    return NULL;
}

/* ---- Python bindings ------------------------------------------------------------------------------- */

static int as_ptr(PyObject *o, const char **p) {
    void *v = PyLong_AsVoidPtr(o);
    if (v == NULL && PyErr_Occurred()) return -1;
    *p = (const char *)v;
    return 0;
}

static int as_i64(PyObject *o, int64_t *v) {
    long long x = PyLong_AsLongLong(o);
    if (x == -1 && PyErr_Occurred()) return -1;
    *v = (int64_t)x;
    return 0;
}

static int check_code(int64_t code) {
    if (code < 0 || code >= DT_COUNT) {
        PyErr_Format(PyExc_ValueError, "unsupported dtype code %lld", (long long)code);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(partials_doc,
             "partials(ptr, numel, code, eps, out_ptr, nthreads) -> None\n\n"
             "Write the 8 partials of numel elements of dtype `code` at address ptr to 8 float64 at out_ptr.");

static PyObject *py_partials(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "partials(ptr, numel, code, eps, out_ptr, nthreads)");
        return NULL;
    }
    item_t it;
    const char *outp;
    int64_t code, nthreads;
    double eps;
    if (as_ptr(args[0], &it.ptr) || as_i64(args[1], &it.numel) || as_i64(args[2], &code) || check_code(code))
        return NULL;
    eps = PyFloat_AsDouble(args[3]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    if (as_ptr(args[4], &outp) || as_i64(args[5], &nthreads)) return NULL;
    if (it.numel < 0 || outp == NULL || (it.ptr == NULL && it.numel > 0)) {
        PyErr_SetString(PyExc_ValueError, "bad pointer or numel");
        return NULL;
    }
    it.code = (int)code;
    if (nthreads > 1 && it.numel >= 2 * g_thread_min) omp_available(); /* lookup once, GIL held */
    int rc;
    if (it.numel >= GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS;
        rc = compute_items(&it, 1, eps, (double *)outp, (int)nthreads);
        Py_END_ALLOW_THREADS;
    } else {
        rc = compute_items(&it, 1, eps, (double *)outp, 1);
    }
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(partials_many_doc,
             "partials_many(items, eps, out_ptr, nthreads) -> None\n\n"
             "items: sequence of (ptr, numel, code); row i of the output (8 float64 at out_ptr + 64 * i)\n"
             "receives the partials of items[i].");

static PyObject *py_partials_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "partials_many(items, eps, out_ptr, nthreads)");
        return NULL;
    }
    const char *outp;
    int64_t nthreads;
    double eps = PyFloat_AsDouble(args[1]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    if (as_ptr(args[2], &outp) || as_i64(args[3], &nthreads)) return NULL;
    if (outp == NULL) {
        PyErr_SetString(PyExc_ValueError, "null output pointer");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "items must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > INT32_MAX / 2) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many items");
        return NULL;
    }
    item_t stack_items[64];
    item_t *items = n <= 64 ? stack_items : (item_t *)PyMem_Malloc(sizeof(item_t) * (size_t)n);
    if (!items) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    int64_t total = 0;
    PyObject **objs = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *t = objs[j];
        int64_t code;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
            PyErr_SetString(PyExc_TypeError, "each item must be a tuple (ptr, numel, code)");
            goto fail;
        }
        if (as_ptr(PyTuple_GET_ITEM(t, 0), &items[j].ptr) || as_i64(PyTuple_GET_ITEM(t, 1), &items[j].numel) ||
            as_i64(PyTuple_GET_ITEM(t, 2), &code) || check_code(code))
            goto fail;
        if (items[j].numel < 0 || (items[j].ptr == NULL && items[j].numel > 0)) {
            PyErr_SetString(PyExc_ValueError, "bad pointer or numel");
            goto fail;
        }
        items[j].code = (int)code;
        total += items[j].numel;
    }
    if (nthreads > 1 && total >= 2 * g_thread_min) omp_available(); /* lookup once, GIL held */
    int rc;
    if (total >= GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS;
        rc = compute_items(items, (int)n, eps, (double *)outp, (int)nthreads);
        Py_END_ALLOW_THREADS;
    } else {
        rc = compute_items(items, (int)n, eps, (double *)outp, 1);
    }
    if (items != stack_items) PyMem_Free(items);
    Py_DECREF(seq);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    if (items != stack_items) PyMem_Free(items);
    Py_DECREF(seq);
    return NULL;
}

PyDoc_STRVAR(adam_doc,
             "adam_update_ratio(m_ptr, v_ptr, numel, code, bias_correction1, bias_correction2, eps,\n"
             "                  stats_eps, out_update_ptr, out_ratio_ptr, nthreads) -> None\n\n"
             "Partials of update = (m/c1) / (sqrt(v/c2) + eps) and ratio = (m/c1) / sqrt(v/c2), computed in fp32\n"
             "in one pass without materialising either. code: 0 (float32), 2 (float16) or 3 (bfloat16).");

static PyObject *py_adam(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "adam_update_ratio(m_ptr, v_ptr, numel, code, c1, c2, eps, stats_eps, out_u, out_r, "
                        "nthreads)");
        return NULL;
    }
    const char *pm, *pv, *ou, *orr;
    int64_t n, code, nthreads;
    double d[4];
    if (as_ptr(args[0], &pm) || as_ptr(args[1], &pv) || as_i64(args[2], &n) || as_i64(args[3], &code))
        return NULL;
    for (int k = 0; k < 4; k++) {
        d[k] = PyFloat_AsDouble(args[4 + k]);
        if (d[k] == -1.0 && PyErr_Occurred()) return NULL;
    }
    if (as_ptr(args[8], &ou) || as_ptr(args[9], &orr) || as_i64(args[10], &nthreads)) return NULL;
    if (code != DT_F32 && code != DT_F16 && code != DT_BF16) {
        PyErr_SetString(PyExc_ValueError, "adam_update_ratio supports float32, float16 and bfloat16");
        return NULL;
    }
    if (n < 0 || ou == NULL || orr == NULL || ((pm == NULL || pv == NULL) && n > 0)) {
        PyErr_SetString(PyExc_ValueError, "bad pointer or numel");
        return NULL;
    }
    adam_par_t par = {(float)(1.0 / d[0]), (float)(1.0 / d[1]), (float)d[2], eps_to_float(d[3])};
    if (nthreads > 64) nthreads = 64;
    if (nthreads > 2 * n / g_thread_min) nthreads = 2 * n / g_thread_min; /* reads two tensors */
    if (nthreads > 1 && !omp_available()) nthreads = 1;
    if (nthreads < 1) nthreads = 1;
    adam_work_t works[64];
    int64_t es = ELSIZE[code];
    for (int t = 0; t < nthreads; t++) {
        int64_t b = t == 0 ? 0 : (n * t / nthreads) & ~(int64_t)63;
        int64_t e = t == nthreads - 1 ? n : (n * (t + 1) / nthreads) & ~(int64_t)63;
        works[t].pm = pm + b * es;
        works[t].pv = pv + b * es;
        works[t].n = e - b;
        works[t].code = (int)code;
        works[t].par = par;
    }
    Py_BEGIN_ALLOW_THREADS;
    run_parallel(run_adam, (char *)works, sizeof(adam_work_t), (int)nthreads);
    Py_END_ALLOW_THREADS;
    for (int t = 1; t < nthreads; t++) {
        acc_merge(&works[0].u, &works[t].u);
        acc_merge(&works[0].r, &works[t].r);
    }
    acc_store(&works[0].u, n, (double *)ou);
    acc_store(&works[0].r, n, (double *)orr);
    Py_RETURN_NONE;
}

static PyObject *py_threading_runtime(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (!omp_available()) Py_RETURN_NONE;
    return PyUnicode_FromString(OMP.path[0] ? OMP.path : "?");
}

static PyObject *self_module; /* borrowed: the module object, to update ISA */

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *cap = PyUnicode_AsUTF8(arg);
    if (!cap) return NULL;
    select_kernels(cap);
    if (PyModule_AddStringConstant(self_module, "ISA", K.isa) < 0) return NULL;
    return PyUnicode_FromString(K.isa);
}

static PyObject *py_set_thread_min(PyObject *self, PyObject *arg) {
    (void)self;
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    long long old = g_thread_min;
    if (v > 0) g_thread_min = v;
    return PyLong_FromLongLong(old);
}

static PyMethodDef methods[] = {
    {"partials", (PyCFunction)(void (*)(void))py_partials, METH_FASTCALL, partials_doc},
    {"partials_many", (PyCFunction)(void (*)(void))py_partials_many, METH_FASTCALL, partials_many_doc},
    {"adam_update_ratio", (PyCFunction)(void (*)(void))py_adam, METH_FASTCALL, adam_doc},
    {"set_isa", py_set_isa, METH_O,
     "set_isa(cap) -> chosen: re-select the kernels, capped at cap ('avx512', 'avx2', 'baseline'); for tests,\n"
     "not thread safe"},
    {"threading_runtime", py_threading_runtime, METH_NOARGS,
     "threading_runtime() -> path of the OpenMP runtime (torch's) used for multi-threaded calls, or None"},
    {"set_thread_min", py_set_thread_min, METH_O,
     "set_thread_min(n) -> previous: minimum elements per thread when a call is split (default 32768)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "trainmon.stats._statskernel",
                                       "Native CPU stats kernel of trainmon (see trainmon/stats/native.py).", -1,
                                       methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__statskernel(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    self_module = m;
    /* TRAINMON_STATS_ISA=avx2|baseline caps the instruction set (debugging, tests) */
    select_kernels(getenv("TRAINMON_STATS_ISA"));
    if (PyModule_AddIntConstant(m, "ABI", 1) < 0 || PyModule_AddStringConstant(m, "ISA", K.isa) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
