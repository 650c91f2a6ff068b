/*
 * onesided: MPI one-sided communication, every byte and every value checked.
 * This file builds two programs: onesided (put/get, accumulate, flush/ordering, window
 * churn) and, with ONESIDED_ATOMICS defined (atomics.c), atomics (get_accumulate,
 * fetch_and_op, compare_and_swap). They are split because Open MPI 4.1.4's osc rdma over
 * vader crashes on int64 MPI_Compare_and_swap on MPI_Win_allocate windows (README.md).
 *
 * Window kinds: MPI_Win_allocate, MPI_Win_create over malloc'd memory, and
 * MPI_Win_create_dynamic + MPI_Win_attach (absolute target displacements).
 * Synchronisation: fence, post/start/complete/wait (PSCW), per-target MPI_Win_lock
 * (exclusive and shared) / MPI_Win_unlock, and MPI_Win_lock_all + MPI_Win_flush.
 * For every (kind, synchronisation):
 *   put/get   MPI_Put to the right neighbour and MPI_Get from the left one at odd byte
 *             displacements, sizes 1, 8, inject+1, 4 KiB+3, 64 KiB, 1 MiB (not --quick);
 *             the bytes around the target area must stay untouched;
 *   acc       MPI_Accumulate SUM on int32 and int64 (1 and 1000 elements) and BXOR on
 *             uint64 from every rank into every other rank;
 *   getacc    MPI_Get_accumulate SUM on int64 (each origin adds its own nibble: every
 *             fetched value must be the initial value plus a subset of the *other*
 *             origins' nibbles) and MPI_NO_OP (atomic read);
 *   fop       MPI_Fetch_and_op SUM +1, K times from every origin, int32 and int64: the
 *             fetched values over all origins must be exactly init .. init+K*(np-1)-1;
 *   cas       MPI_Compare_and_swap int32 and int64: on a private slot (must swap), with a
 *             wrong compare value (must not swap), and all origins racing on one slot
 *             (exactly one wins, the others fetch the winner's value);
 *   flush     (lock modes) MPI_Put, MPI_Win_flush, MPI_Get of the same bytes returns them;
 *             MPI_Rput/MPI_Rget + MPI_Wait; MPI_Accumulate(REPLACE) then
 *             MPI_Get_accumulate(NO_OP) of the same location in the same epoch (ordering).
 * Then --windows N (default 2000, 200 with --quick) windows are created and freed over
 * recycled malloc'd memory (every 5th from MPI_Win_allocate) with a put/get check each.
 *
 * Options: --inject N, --windows N (onesided only), --quick; to run a part only:
 *   --kinds allocate,create,dynamic  --syncs fence,pscw,lock,lockshared,lockall
 *   --ops putget,acc,getacc,fop,cas,flush  (--windows 0 skips the churn)
 * atomics.c adds the part "btl" (--ops btl), run after the others through the hook
 * ONESIDED_EXTRA.
 */
#include "common.h"
#include <stdbool.h>

enum { W_ALLOCATE, W_CREATE, W_DYNAMIC, NKINDS };
static const char *kind_name[NKINDS] = { "Win_allocate", "Win_create", "Win_create_dynamic" };
enum { S_FENCE, S_PSCW, S_LOCK, S_LOCK_SHARED, S_LOCKALL, NSYNC };
static const char *sync_name[NSYNC] = { "fence", "PSCW", "lock exclusive", "lock shared", "lock_all+flush" };
static const char *kind_key[NKINDS] = { "allocate", "create", "dynamic" };
static const char *sync_key[NSYNC] = { "fence", "pscw", "lock", "lockshared", "lockall" };

#ifdef ONESIDED_ATOMICS
#define PROG "atomics"
#define DEFAULT_OPS "getacc,fop,cas,btl"
#else
#define PROG "onesided"
#define DEFAULT_OPS "putget,acc,flush"
#endif

/* --ops/--kinds/--syncs LIST select parts (comma-separated keys); absent = all */
static int selected(const char *opt, const char *key)
{
    const char *l = t_opt_str(opt, strcmp(opt, "ops") == 0 ? DEFAULT_OPS : NULL);
    size_t n = strlen(key);
    if (!l)
        return 1;
    for (const char *p = l; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, key, n) == 0)
            return 1;
        if (!e)
            break;
        p = e + 1;
    }
    return 0;
}

#define N32 1000
#define NGA 100
#define KFOP 10
#define PMAX ((size_t)(1 << 20) + 16)

/* window layout (bytes) */
static size_t OFF_PUT, OFF_GET, OFF_A32, OFF_A64, OFF_X64, OFF_GA, OFF_FOP64, OFF_FOP32, OFF_CAS64, OFF_CAS32,
    OFF_CASS64, OFF_CASS32, WSIZE;

typedef struct {
    MPI_Win win;
    uint8_t *base;   /* local window memory */
    MPI_Aint *tbase; /* per target: displacement of the window start */
    int kind;
    MPI_Group others;
} win_t;

static MPI_Comm xcomm; /* for exchanging fetched values */
static int me, np;
static int targets_all = 1;

static size_t align8(size_t x)
{
    return (x + 7) & ~(size_t)7;
}

static void layout(void)
{
    size_t o = 0;
    OFF_PUT = o; o = align8(o + PMAX + 64);
    OFF_GET = o; o = align8(o + PMAX + 64);
    OFF_A32 = o; o = align8(o + 4 * N32);
    OFF_A64 = o; o = align8(o + 8 * N32);
    OFF_X64 = o; o = align8(o + 8 * N32);
    OFF_GA = o; o = align8(o + 8 * NGA);
    OFF_FOP64 = o; o += 8;
    OFF_FOP32 = o; o += 8;
    OFF_CAS64 = o; o += 8 * 64;
    OFF_CAS32 = o; o += 4 * 64;
    OFF_CASS64 = o; o += 8;
    OFF_CASS32 = o; o += 8;
    WSIZE = align8(o + 64);
}

static int64_t *A64(uint8_t *b) { return (int64_t *)(b + OFF_A64); }
static int32_t *A32(uint8_t *b) { return (int32_t *)(b + OFF_A32); }
static uint64_t *X64(uint8_t *b) { return (uint64_t *)(b + OFF_X64); }
static int64_t *GA(uint8_t *b) { return (int64_t *)(b + OFF_GA); }

static uint64_t getseed(int rank) { return t_seed(200, (uint64_t)rank, 0, 0); }

/* Initial contents of rank r's window. */
static void init_mem(uint8_t *b, int r)
{
    memset(b + OFF_PUT, 0xee, PMAX + 64);
    t_fill(b + OFF_GET, PMAX + 64, getseed(r));
    for (int i = 0; i < N32; i++) {
        A32(b)[i] = i * 3;
        A64(b)[i] = (int64_t)i * 1000000007LL;
        X64(b)[i] = t_word(getseed(r), (size_t)i);
    }
    for (int i = 0; i < NGA; i++)
        GA(b)[i] = 1000 + i;
    *(int64_t *)(b + OFF_FOP64) = 5000;
    *(int32_t *)(b + OFF_FOP32) = 7000;
    for (int k = 0; k < 64; k++) {
        ((int64_t *)(b + OFF_CAS64))[k] = -1 - k;
        ((int32_t *)(b + OFF_CAS32))[k] = -100 - k;
    }
    *(int64_t *)(b + OFF_CASS64) = -7;
    *(int32_t *)(b + OFF_CASS32) = -9;
}

static bool passive(int s)
{
    return s == S_LOCK || s == S_LOCK_SHARED || s == S_LOCKALL;
}

/* local access to our own window memory, consistent in both memory models */
static void local_begin(win_t *w, int s, int excl)
{
    if (passive(s))
        T_CHECK_MPI(MPI_Win_lock(excl ? MPI_LOCK_EXCLUSIVE : MPI_LOCK_SHARED, me, 0, w->win));
}

static void local_end(win_t *w, int s)
{
    if (passive(s))
        T_CHECK_MPI(MPI_Win_unlock(me, w->win));
}

static void reset(win_t *w, int s)
{
    local_begin(w, s, 1);
    init_mem(w->base, me);
    local_end(w, s);
    if (s == S_FENCE)
        return; /* the opening fence orders it */
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

static void epoch_begin(win_t *w, int s)
{
    switch (s) {
    case S_FENCE:
        T_CHECK_MPI(MPI_Win_fence(0, w->win));
        break;
    case S_PSCW:
        T_CHECK_MPI(MPI_Win_post(w->others, 0, w->win));
        T_CHECK_MPI(MPI_Win_start(w->others, 0, w->win));
        break;
    case S_LOCKALL:
        T_CHECK_MPI(MPI_Win_lock_all(0, w->win));
        break;
    default:
        break;
    }
}

static void epoch_end(win_t *w, int s)
{
    switch (s) {
    case S_FENCE:
        T_CHECK_MPI(MPI_Win_fence(0, w->win));
        break;
    case S_PSCW:
        T_CHECK_MPI(MPI_Win_complete(w->win));
        T_CHECK_MPI(MPI_Win_wait(w->win));
        break;
    case S_LOCKALL:
        T_CHECK_MPI(MPI_Win_unlock_all(w->win));
        T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        break;
    default:
        T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        break;
    }
}

static void access_begin(win_t *w, int s, int t)
{
    if (s == S_LOCK)
        T_CHECK_MPI(MPI_Win_lock(MPI_LOCK_EXCLUSIVE, t, 0, w->win));
    else if (s == S_LOCK_SHARED)
        T_CHECK_MPI(MPI_Win_lock(MPI_LOCK_SHARED, t, 0, w->win));
}

static void access_end(win_t *w, int s, int t)
{
    if (s == S_LOCK || s == S_LOCK_SHARED)
        T_CHECK_MPI(MPI_Win_unlock(t, w->win));
    else if (s == S_LOCKALL)
        T_CHECK_MPI(MPI_Win_flush(t, w->win));
}

static MPI_Aint D(win_t *w, int t, size_t off)
{
    return w->tbase[t] + (MPI_Aint)off;
}

/* ---------- tests ---------- */

static void test_putget(win_t *w, int s, const size_t *sizes, int nsizes)
{
    int right = (me + 1) % np, left = (me + np - 1) % np;
    uint8_t *src = t_malloc(PMAX), *dst = t_malloc(PMAX + 64), *exp = t_malloc(PMAX + 8);
    for (int i = 0; i < nsizes; i++) {
        size_t n = sizes[i];
        char what[160];
        snprintf(what, sizeof(what), "%s/%s put/get %zu bytes", kind_name[w->kind], sync_name[s], n);
        t_section("%s", what);
        reset(w, s);
        t_fill(src, n, t_seed(201, (uint64_t)me, n, 0));
        memset(dst, 0xcc, n + 64);
        epoch_begin(w, s);
        access_begin(w, s, right);
        T_CHECK_MPI(MPI_Put(src, (int)n, MPI_BYTE, right, D(w, right, OFF_PUT + 5), (int)n, MPI_BYTE, w->win));
        access_end(w, s, right);
        access_begin(w, s, left);
        T_CHECK_MPI(MPI_Get(dst, (int)n, MPI_BYTE, left, D(w, left, OFF_GET + 3), (int)n, MPI_BYTE, w->win));
        access_end(w, s, left);
        epoch_end(w, s);
        {
            char ww[200];
            t_fill(exp, n + 3, getseed(left));
            snprintf(ww, sizeof(ww), "%s: MPI_Get result from rank %d", what, left);
            t_check_mem(dst, exp + 3, n, ww);
            snprintf(ww, sizeof(ww), "%s: bytes behind the MPI_Get origin buffer", what);
            t_check_const(dst + n, 64, 0xcc, ww);
        }
        local_begin(w, s, 0);
        {
            char ww[200];
            snprintf(ww, sizeof(ww), "%s: data MPI_Put by rank %d", what, left);
            t_check(w->base + OFF_PUT + 5, n, t_seed(201, (uint64_t)left, n, 0), ww);
            snprintf(ww, sizeof(ww), "%s: bytes before the MPI_Put target area", what);
            t_check_const(w->base + OFF_PUT, 5, 0xee, ww);
            snprintf(ww, sizeof(ww), "%s: bytes behind the MPI_Put target area", what);
            t_check_const(w->base + OFF_PUT + 5 + n, 59, 0xee, ww);
        }
        local_end(w, s);
    }
    free(src);
    free(dst);
    free(exp);
}

static void test_acc(win_t *w, int s, int cnt)
{
    int32_t *s32 = t_malloc(4 * N32);
    int64_t *s64 = t_malloc(8 * N32);
    uint64_t *sx = t_malloc(8 * N32);
    char what[160];
    snprintf(what, sizeof(what), "%s/%s accumulate %d elements", kind_name[w->kind], sync_name[s], cnt);
    t_section("%s", what);
    reset(w, s);
    for (int i = 0; i < cnt; i++) {
        s32[i] = (me + 1) * (i + 1);
        s64[i] = (int64_t)(me + 1) * (i + 1) * 4000000000LL;
        sx[i] = 1ull << ((me * 7 + i) % 64);
    }
    epoch_begin(w, s);
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        access_begin(w, s, t);
        T_CHECK_MPI(MPI_Accumulate(s32, cnt, MPI_INT32_T, t, D(w, t, OFF_A32), cnt, MPI_INT32_T, MPI_SUM, w->win));
        T_CHECK_MPI(MPI_Accumulate(s64, cnt, MPI_INT64_T, t, D(w, t, OFF_A64), cnt, MPI_INT64_T, MPI_SUM, w->win));
        T_CHECK_MPI(MPI_Accumulate(sx, cnt, MPI_UINT64_T, t, D(w, t, OFF_X64), cnt, MPI_UINT64_T, MPI_BXOR, w->win));
        access_end(w, s, t);
    }
    epoch_end(w, s);
    local_begin(w, s, 0);
    for (int i = 0; i < N32; i++) {
        int32_t e32 = i * 3;
        int64_t e64 = (int64_t)i * 1000000007LL;
        uint64_t ex = t_word(getseed(me), (size_t)i);
        if (i < cnt)
            for (int r = 0; r < np; r++)
                if (r != me) {
                    e32 += (r + 1) * (i + 1);
                    e64 += (int64_t)(r + 1) * (i + 1) * 4000000000LL;
                    ex ^= 1ull << ((r * 7 + i) % 64);
                }
        if (A32(w->base)[i] != e32)
            t_fail("%s: int32 SUM element %d: expected %d got %d", what, i, e32, A32(w->base)[i]);
        if (A64(w->base)[i] != e64)
            t_fail("%s: int64 SUM element %d: expected %lld got %lld", what, i, (long long)e64,
                   (long long)A64(w->base)[i]);
        if (X64(w->base)[i] != ex)
            t_fail("%s: uint64 BXOR element %d: expected 0x%llx got 0x%llx", what, i, (unsigned long long)ex,
                   (unsigned long long)X64(w->base)[i]);
    }
    local_end(w, s);
    free(s32);
    free(s64);
    free(sx);
}

static void test_getacc(win_t *w, int s)
{
    int64_t src[NGA], *f = t_malloc(sizeof(int64_t) * NGA * (size_t)np), rd[2] = { 0, 0 };
    char what[160];
    int left = (me + np - 1) % np;
    snprintf(what, sizeof(what), "%s/%s get_accumulate", kind_name[w->kind], sync_name[s]);
    t_section("%s", what);
    T_ASSERT(np <= 15, "get_accumulate nibble check supports up to 15 ranks");
    reset(w, s);
    for (int i = 0; i < NGA; i++)
        src[i] = 1LL << (4 * me);
    epoch_begin(w, s);
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        access_begin(w, s, t);
        T_CHECK_MPI(MPI_Get_accumulate(src, NGA, MPI_INT64_T, f + (size_t)t * NGA, NGA, MPI_INT64_T, t,
                                       D(w, t, OFF_GA), NGA, MPI_INT64_T, MPI_SUM, w->win));
        access_end(w, s, t);
    }
    access_begin(w, s, left);
    T_CHECK_MPI(MPI_Get_accumulate(NULL, 0, MPI_INT64_T, rd, 2, MPI_INT64_T, left, D(w, left, OFF_GET + 16), 2,
                                   MPI_INT64_T, MPI_NO_OP, w->win));
    access_end(w, s, left);
    epoch_end(w, s);
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        for (int i = 0; i < NGA; i++) {
            int64_t got = f[(size_t)t * NGA + (size_t)i] - (1000 + i);
            for (int r = 0; r < 16; r++) {
                int64_t nib = (got >> (4 * r)) & 0xf;
                if (nib > 1 || (nib && (r == me || r == t || r >= np)) || got < 0)
                    t_fail("%s: value fetched from rank %d element %d is init+0x%llx: not init plus a subset of "
                           "the other origins' contributions",
                           what, t, i, (unsigned long long)got);
            }
        }
    }
    {
        uint8_t exp[40];
        t_fill(exp, 40, getseed(left));
        if (memcmp(rd, exp + 16, 16) != 0)
            t_fail("%s: MPI_NO_OP get_accumulate did not return the target's bytes", what);
    }
    local_begin(w, s, 0);
    for (int i = 0; i < NGA; i++) {
        int64_t e = 1000 + i;
        for (int r = 0; r < np; r++)
            if (r != me)
                e += 1LL << (4 * r);
        if (GA(w->base)[i] != e)
            t_fail("%s: element %d: expected 0x%llx got 0x%llx", what, i, (long long)e, (long long)GA(w->base)[i]);
    }
    local_end(w, s);
    free(f);
}

static int cmp64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static void test_fop(win_t *w, int s)
{
    int64_t one64 = 1, *f64 = t_malloc(sizeof(int64_t) * KFOP * (size_t)np);
    int32_t one32 = 1, *f32 = t_malloc(sizeof(int32_t) * KFOP * (size_t)np);
    int64_t *all = t_malloc(sizeof(int64_t) * 2 * KFOP * (size_t)np);
    char what[160];
    snprintf(what, sizeof(what), "%s/%s fetch_and_op", kind_name[w->kind], sync_name[s]);
    t_section("%s", what);
    reset(w, s);
    epoch_begin(w, s);
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        access_begin(w, s, t);
        for (int k = 0; k < KFOP; k++) {
            T_CHECK_MPI(MPI_Fetch_and_op(&one64, &f64[t * KFOP + k], MPI_INT64_T, t, D(w, t, OFF_FOP64), MPI_SUM,
                                         w->win));
            T_CHECK_MPI(MPI_Fetch_and_op(&one32, &f32[t * KFOP + k], MPI_INT32_T, t, D(w, t, OFF_FOP32), MPI_SUM,
                                         w->win));
        }
        access_end(w, s, t);
    }
    epoch_end(w, s);
    /* hand the fetched values to their target, which checks they form a permutation */
    {
        MPI_Request *rq = t_malloc(sizeof(MPI_Request) * (size_t)np);
        int64_t *out = t_malloc(sizeof(int64_t) * 2 * KFOP * (size_t)np);
        int nr = 0;
        for (int d = 1; d < np; d++) {
            int o = (me + np - d) % np;
            T_CHECK_MPI(MPI_Irecv(all + (size_t)o * 2 * KFOP, 2 * KFOP, MPI_INT64_T, o, 1, xcomm, &rq[nr++]));
        }
        for (int d = 1; d < np; d++) {
            int t = (me + d) % np;
            for (int k = 0; k < KFOP; k++) {
                out[(size_t)t * 2 * KFOP + (size_t)k] = f64[t * KFOP + k];
                out[(size_t)t * 2 * KFOP + KFOP + (size_t)k] = f32[t * KFOP + k];
            }
            T_CHECK_MPI(MPI_Send(out + (size_t)t * 2 * KFOP, 2 * KFOP, MPI_INT64_T, t, 1, xcomm));
        }
        T_CHECK_MPI(MPI_Waitall(nr, rq, MPI_STATUSES_IGNORE));
        free(rq);
        free(out);
    }
    for (int width = 0; width < 2; width++) {
        int64_t *v = t_malloc(sizeof(int64_t) * KFOP * (size_t)np), base = width ? 7000 : 5000;
        int nv = 0;
        for (int o = 0; o < np; o++)
            if (o != me)
                for (int k = 0; k < KFOP; k++)
                    v[nv++] = all[(size_t)o * 2 * KFOP + (size_t)(width * KFOP + k)];
        qsort(v, (size_t)nv, sizeof(int64_t), cmp64);
        for (int k = 0; k < nv; k++)
            if (v[k] != base + k)
                t_fail("%s: %s values fetched at this target, sorted, position %d: expected %lld got %lld "
                       "(duplicates or gaps: not atomic)",
                       what, width ? "int32" : "int64", k, (long long)(base + k), (long long)v[k]);
        free(v);
    }
    local_begin(w, s, 0);
    if (*(int64_t *)(w->base + OFF_FOP64) != 5000 + KFOP * (np - 1))
        t_fail("%s: int64 counter expected %d got %lld", what, 5000 + KFOP * (np - 1),
               (long long)*(int64_t *)(w->base + OFF_FOP64));
    if (*(int32_t *)(w->base + OFF_FOP32) != 7000 + KFOP * (np - 1))
        t_fail("%s: int32 counter expected %d got %d", what, 7000 + KFOP * (np - 1), *(int32_t *)(w->base + OFF_FOP32));
    local_end(w, s);
    /* values fetched by one origin from one location must increase (accumulate ordering) */
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        for (int k = 1; k < KFOP; k++)
            if (f32[t * KFOP + k] <= f32[t * KFOP + k - 1] || f32[t * KFOP + k] < 7000 ||
                f32[t * KFOP + k] >= 7000 + KFOP * (np - 1))
                t_fail("%s: int32 values fetched from rank %d not increasing within range: #%d=%d #%d=%d", what, t,
                       k - 1, f32[t * KFOP + k - 1], k, f32[t * KFOP + k]);
    }
    free(f64);
    free(f32);
    free(all);
}

static void test_cas(win_t *w, int s)
{
    int64_t *r64 = t_malloc(8 * (size_t)np), *c64 = t_malloc(8 * (size_t)np);
    int32_t *r32 = t_malloc(4 * (size_t)np), *c32 = t_malloc(4 * (size_t)np);
    char what[160];
    snprintf(what, sizeof(what), "%s/%s compare_and_swap", kind_name[w->kind], sync_name[s]);
    t_section("%s", what);
    T_ASSERT(np <= 64, "too many ranks for the CAS slots");
    reset(w, s);
    epoch_begin(w, s);
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        int64_t sw64 = me * 1000 + t, cmp64v = -1 - me;
        int32_t sw32 = me * 1000 + t + 7, cmp32v = -100 - me;
        int64_t cs64 = me + 1, cc64 = -7;
        int32_t cs32 = me + 1, cc32 = -9;
        access_begin(w, s, t);
        T_CHECK_MPI(MPI_Compare_and_swap(&sw64, &cmp64v, &r64[t], MPI_INT64_T, t, D(w, t, OFF_CAS64 + 8 * (size_t)me),
                                         w->win));
        T_CHECK_MPI(MPI_Compare_and_swap(&sw32, &cmp32v, &r32[t], MPI_INT32_T, t, D(w, t, OFF_CAS32 + 4 * (size_t)me),
                                         w->win));
        T_CHECK_MPI(MPI_Compare_and_swap(&cs64, &cc64, &c64[t], MPI_INT64_T, t, D(w, t, OFF_CASS64), w->win));
        T_CHECK_MPI(MPI_Compare_and_swap(&cs32, &cc32, &c32[t], MPI_INT32_T, t, D(w, t, OFF_CASS32), w->win));
        access_end(w, s, t);
    }
    epoch_end(w, s);
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        if (r64[t] != -1 - me)
            t_fail("%s: int64 CAS on own slot at rank %d fetched %lld, expected %d", what, t, (long long)r64[t], -1 - me);
        if (r32[t] != -100 - me)
            t_fail("%s: int32 CAS on own slot at rank %d fetched %d, expected %d", what, t, r32[t], -100 - me);
    }
    /* second epoch: wrong compare value must not swap */
    epoch_begin(w, s);
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        int64_t sw = 12345, cmp = 999999;
        int32_t sw32 = 12345, cmp32 = 999999;
        access_begin(w, s, t);
        T_CHECK_MPI(MPI_Compare_and_swap(&sw, &cmp, &r64[t], MPI_INT64_T, t, D(w, t, OFF_CAS64 + 8 * (size_t)me), w->win));
        T_CHECK_MPI(MPI_Compare_and_swap(&sw32, &cmp32, &r32[t], MPI_INT32_T, t, D(w, t, OFF_CAS32 + 4 * (size_t)me),
                                         w->win));
        access_end(w, s, t);
    }
    epoch_end(w, s);
    for (int d = 1; d < np; d++) {
        int t = (me + d) % np;
        if (r64[t] != me * 1000 + t)
            t_fail("%s: failing int64 CAS at rank %d fetched %lld, expected the current %d", what, t, (long long)r64[t],
                   me * 1000 + t);
        if (r32[t] != me * 1000 + t + 7)
            t_fail("%s: failing int32 CAS at rank %d fetched %d, expected the current %d", what, t, r32[t],
                   me * 1000 + t + 7);
    }
    /* race results go to the target */
    {
        int64_t *got = t_malloc(16 * (size_t)np);
        MPI_Request *rq = t_malloc(sizeof(MPI_Request) * 2 * (size_t)np);
        int nr = 0, wins64 = 0, wins32 = 0;
        for (int d = 1; d < np; d++) {
            int o = (me + np - d) % np;
            T_CHECK_MPI(MPI_Irecv(&got[2 * o], 2, MPI_INT64_T, o, 2, xcomm, &rq[nr++]));
        }
        for (int d = 1; d < np; d++) {
            int t = (me + d) % np;
            int64_t pair[2] = { c64[t], c32[t] };
            T_CHECK_MPI(MPI_Send(pair, 2, MPI_INT64_T, t, 2, xcomm));
        }
        T_CHECK_MPI(MPI_Waitall(nr, rq, MPI_STATUSES_IGNORE));
        local_begin(w, s, 0);
        int64_t v64 = *(int64_t *)(w->base + OFF_CASS64);
        int32_t v32 = *(int32_t *)(w->base + OFF_CASS32);
        for (int o = 0; o < np; o++) {
            if (o == me)
                continue;
            if (got[2 * o] == -7) {
                wins64++;
                if (v64 != o + 1)
                    t_fail("%s: rank %d won the int64 CAS race but the slot holds %lld", what, o, (long long)v64);
            } else if (got[2 * o] != v64)
                t_fail("%s: rank %d lost the int64 CAS race but fetched %lld, not the winner's %lld", what, o,
                       (long long)got[2 * o], (long long)v64);
            if (got[2 * o + 1] == -9) {
                wins32++;
                if (v32 != o + 1)
                    t_fail("%s: rank %d won the int32 CAS race but the slot holds %d", what, o, v32);
            } else if (got[2 * o + 1] != v32)
                t_fail("%s: rank %d lost the int32 CAS race but fetched %lld, not the winner's %d", what, o,
                       (long long)got[2 * o + 1], v32);
        }
        if (np > 1 && (wins64 != 1 || wins32 != 1))
            t_fail("%s: CAS race: %d int64 and %d int32 winners, expected exactly 1 each", what, wins64, wins32);
        for (int o = 0; o < np; o++) {
            int64_t e = o == me ? -1 - o : o * 1000 + me;
            if (((int64_t *)(w->base + OFF_CAS64))[o] != e)
                t_fail("%s: int64 slot of origin %d: expected %lld got %lld", what, o, (long long)e,
                       (long long)((int64_t *)(w->base + OFF_CAS64))[o]);
        }
        local_end(w, s);
        free(got);
        free(rq);
    }
    free(r64); free(c64); free(r32); free(c32);
}

/* passive modes only: completion and ordering guarantees */
static void test_flush(win_t *w, int s)
{
    int right = (me + 1) % np;
    size_t n = 65536 + 3;
    uint8_t *src = t_malloc(n), *back = t_malloc(n);
    int64_t rep = 0x1122334455667788LL + me, fetched = 0;
    MPI_Request rq;
    char what[160];
    snprintf(what, sizeof(what), "%s/%s flush and ordering", kind_name[w->kind], sync_name[s]);
    t_section("%s", what);
    reset(w, s);
    t_fill(src, n, t_seed(203, (uint64_t)me, 0, 0));
    memset(back, 0, n);
    if (s == S_LOCKALL)
        T_CHECK_MPI(MPI_Win_lock_all(0, w->win));
    else
        T_CHECK_MPI(MPI_Win_lock(MPI_LOCK_EXCLUSIVE, right, 0, w->win));
    T_CHECK_MPI(MPI_Put(src, (int)n, MPI_BYTE, right, D(w, right, OFF_PUT + 1), (int)n, MPI_BYTE, w->win));
    T_CHECK_MPI(MPI_Win_flush(right, w->win));
    T_CHECK_MPI(MPI_Get(back, (int)n, MPI_BYTE, right, D(w, right, OFF_PUT + 1), (int)n, MPI_BYTE, w->win));
    T_CHECK_MPI(MPI_Win_flush(right, w->win));
    t_check_mem(back, src, n, "MPI_Get after MPI_Put + MPI_Win_flush of the same bytes");
    /* request-based */
    t_fill(src, n, t_seed(204, (uint64_t)me, 0, 0));
    T_CHECK_MPI(MPI_Rput(src, (int)n, MPI_BYTE, right, D(w, right, OFF_PUT + 1), (int)n, MPI_BYTE, w->win, &rq));
    T_CHECK_MPI(MPI_Wait(&rq, MPI_STATUS_IGNORE));
    memset(src, 0, n); /* local completion: the origin buffer may be reused */
    T_CHECK_MPI(MPI_Win_flush(right, w->win));
    T_CHECK_MPI(MPI_Rget(back, (int)n, MPI_BYTE, right, D(w, right, OFF_PUT + 1), (int)n, MPI_BYTE, w->win, &rq));
    T_CHECK_MPI(MPI_Wait(&rq, MPI_STATUS_IGNORE));
    t_check(back, n, t_seed(204, (uint64_t)me, 0, 0), "MPI_Rget after MPI_Rput + MPI_Wait + MPI_Win_flush");
    /* accumulate ordering (default: rar, raw, war, waw) without a flush in between */
    T_CHECK_MPI(MPI_Accumulate(&rep, 1, MPI_INT64_T, right, D(w, right, OFF_GA), 1, MPI_INT64_T, MPI_REPLACE, w->win));
    T_CHECK_MPI(MPI_Get_accumulate(NULL, 0, MPI_INT64_T, &fetched, 1, MPI_INT64_T, right, D(w, right, OFF_GA), 1,
                                   MPI_INT64_T, MPI_NO_OP, w->win));
    T_CHECK_MPI(MPI_Win_flush_local(right, w->win));
    if (s == S_LOCKALL) {
        T_CHECK_MPI(MPI_Win_flush_all(w->win));
        T_CHECK_MPI(MPI_Win_unlock_all(w->win));
    } else {
        T_CHECK_MPI(MPI_Win_unlock(right, w->win));
    }
    if (fetched != rep)
        t_fail("%s: MPI_Get_accumulate(NO_OP) after MPI_Accumulate(REPLACE) of the same location returned 0x%llx, "
               "expected 0x%llx (accumulate ordering)",
               what, (unsigned long long)fetched, (unsigned long long)rep);
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    free(src);
    free(back);
}

static void make_win(win_t *w, int kind)
{
    MPI_Group world;
    w->kind = kind;
    w->tbase = t_malloc(sizeof(MPI_Aint) * (size_t)np);
    t_section("create %s window of %zu bytes", kind_name[kind], WSIZE);
    if (kind == W_ALLOCATE) {
        T_CHECK_MPI(MPI_Win_allocate((MPI_Aint)WSIZE, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &w->base, &w->win));
        memset(w->tbase, 0, sizeof(MPI_Aint) * (size_t)np);
    } else if (kind == W_CREATE) {
        w->base = t_malloc(WSIZE);
        T_CHECK_MPI(MPI_Win_create(w->base, (MPI_Aint)WSIZE, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &w->win));
        memset(w->tbase, 0, sizeof(MPI_Aint) * (size_t)np);
    } else {
        MPI_Aint mine;
        w->base = t_malloc(WSIZE);
        T_CHECK_MPI(MPI_Win_create_dynamic(MPI_INFO_NULL, MPI_COMM_WORLD, &w->win));
        T_CHECK_MPI(MPI_Win_attach(w->win, w->base, (MPI_Aint)WSIZE));
        T_CHECK_MPI(MPI_Get_address(w->base, &mine));
        T_CHECK_MPI(MPI_Allgather(&mine, 1, MPI_AINT, w->tbase, 1, MPI_AINT, MPI_COMM_WORLD));
    }
    MPI_Win_set_errhandler(w->win, MPI_ERRORS_RETURN);
    {
        int *model = NULL, flag = 0;
        MPI_Win_get_attr(w->win, MPI_WIN_MODEL, &model, &flag);
        if (t_verbose)
            t_info("%s window memory model: %s", kind_name[kind],
                   !flag ? "?" : *model == MPI_WIN_UNIFIED ? "unified" : "separate");
    }
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_excl(world, 1, &me, &w->others);
    MPI_Group_free(&world);
    /* initial contents for modes that start with a fence */
    T_CHECK_MPI(MPI_Win_lock(MPI_LOCK_EXCLUSIVE, me, 0, w->win));
    init_mem(w->base, me);
    T_CHECK_MPI(MPI_Win_unlock(me, w->win));
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

static void free_win(win_t *w)
{
    t_section("free %s window", kind_name[w->kind]);
    if (w->kind == W_DYNAMIC)
        T_CHECK_MPI(MPI_Win_detach(w->win, w->base));
    T_CHECK_MPI(MPI_Win_free(&w->win));
    if (w->kind != W_ALLOCATE)
        free(w->base);
    MPI_Group_free(&w->others);
    free(w->tbase);
}

/* thousands of windows over recycled memory */
static void churn(int nwin)
{
    int right = (me + 1) % np, left = (me + np - 1) % np;
    double t0 = t_now();
    for (int i = 0; i < nwin; i++) {
        size_t size = 4096 * (size_t)(1 + i % 7) + (size_t)(i % 3) * 8;
        size_t half = size / 2, n = 256 + (size_t)(i % 5) * 100;
        uint8_t *buf = NULL, get[800], src[800];
        MPI_Win win;
        int alloc = i % 5 == 4;
        t_section("window churn %d of %d (%zu bytes, %s)", i, nwin, size, alloc ? "Win_allocate" : "Win_create on malloc");
        if (alloc) {
            T_CHECK_MPI(MPI_Win_allocate((MPI_Aint)size, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &buf, &win));
        } else {
            buf = t_malloc(size);
            T_CHECK_MPI(MPI_Win_create(buf, (MPI_Aint)size, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win));
        }
        MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
        t_fill(buf, size, t_seed(210, (uint64_t)me, (uint64_t)i, 0));
        t_fill(src, n, t_seed(211, (uint64_t)me, (uint64_t)i, 0));
        T_CHECK_MPI(MPI_Win_fence(MPI_MODE_NOPRECEDE, win));
        T_CHECK_MPI(MPI_Put(src, (int)n, MPI_BYTE, right, (MPI_Aint)half, (int)n, MPI_BYTE, win));
        T_CHECK_MPI(MPI_Get(get, (int)n, MPI_BYTE, left, 0, (int)n, MPI_BYTE, win));
        T_CHECK_MPI(MPI_Win_fence(MPI_MODE_NOSUCCEED, win));
        t_check(get, n, t_seed(210, (uint64_t)left, (uint64_t)i, 0), "MPI_Get from a fresh window");
        t_check(buf + half, n, t_seed(211, (uint64_t)left, (uint64_t)i, 0), "MPI_Put into a fresh window");
        T_CHECK_MPI(MPI_Win_free(&win));
        if (!alloc)
            free(buf);
    }
    t_info("%d windows created, used and freed over recycled memory in %.2f s", nwin, t_now() - t0);
}

int main(int argc, char **argv)
{
    size_t sizes[8];
    int nsizes, nwin;
    t_init(&argc, &argv, PROG);
    me = t_rank;
    np = t_size;
    layout();
    nsizes = t_sizes_def(sizes, 8, t_quick ? "1,8,inject+1,4099,64K" : "1,8,inject+1,4099,64K,1M");
#ifdef ONESIDED_ATOMICS
    nwin = (int)t_opt_long("windows", NULL, 0);
#else
    nwin = (int)t_opt_long("windows", NULL, t_quick ? 200 : 2000);
#endif
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &xcomm));
    (void)targets_all;
    for (int kind = 0; kind < NKINDS; kind++) {
        win_t w;
        if (!selected("kinds", kind_key[kind]))
            continue;
        make_win(&w, kind);
        for (int s = 0; s < NSYNC; s++) {
            if (!selected("syncs", sync_key[s]))
                continue;
            if (selected("ops", "putget"))
                test_putget(&w, s, sizes, nsizes);
            if (selected("ops", "acc")) {
                test_acc(&w, s, 1);
                test_acc(&w, s, N32);
            }
            if (selected("ops", "getacc"))
                test_getacc(&w, s);
            if (selected("ops", "fop"))
                test_fop(&w, s);
            if (selected("ops", "cas"))
                test_cas(&w, s);
            if (passive(s) && selected("ops", "flush"))
                test_flush(&w, s);
        }
        free_win(&w);
    }
    if (nwin > 0)
        churn(nwin);
#ifdef ONESIDED_EXTRA
    ONESIDED_EXTRA();
#endif
    T_CHECK_MPI(MPI_Comm_free(&xcomm));
    return t_pass();
}
