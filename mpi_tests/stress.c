/*
 * stress: MPI traffic while other threads release memory in every way the memory hooks
 * must see, for a bounded time. Every transferred byte is checked.
 *
 * MPI_Init_thread(MPI_THREAD_MULTIPLE) (FAIL if the library provides less). On every rank:
 *   - --mem-threads M (default 2) churn threads, until the traffic ends:
 *       malloc/free and realloc of sizes from 512 B to 8 MiB (across glibc's mmap
 *       threshold), with a pool of live blocks freed in random order;
 *       mmap/munmap, including partial munmap of the middle of a mapping;
 *       mremap grow (may move) and shrink;
 *       madvise(MADV_DONTNEED) on part of a mapping, then writes to it;
 *       brk shrink: malloc_trim(0), counted when sbrk(0) went down.
 *   - --threads T (default 2) traffic threads, each on its own duplicate of
 *     MPI_COMM_WORLD: ring exchange (Irecv from the left, Isend or Issend to the right)
 *     of sizes 1 B .. 1 MiB (4 MiB with --big), send and receive buffers freshly
 *     allocated each iteration by malloc, by mmap, or by mmap at the address just
 *     unmapped (recycled), and released right after the check.
 *   - with --rma, the main thread also runs one-sided rounds on its own communicator:
 *     MPI_Win_create over a recycled mapping (munmap + mmap at the same address each
 *     round), MPI_Get of the right neighbour's whole window into a recycled local
 *     mapping, four one-page MPI_Gets into separate fresh mappings (the small-get
 *     path), MPI_Put of a half window into it, fences; all of it is checked.
 *     This is RDMA from and into recycled buffers through the BTL's registration cache.
 * Each loop decides to stop with an MPI_Allreduce of "--seconds elapsed" on its own
 * communicator, so all ranks stop at the same iteration and the job ends by itself.
 *
 * At the end rank 0 prints the operation counts (summed over ranks) and, when the
 * BTL's MPI_T variables btl_ofi_rcache_* exist, its counters over the run.
 * Options: --seconds S (default 20, 6 with --quick), --threads T, --mem-threads M,
 * --rma, --big, --expect-evictions (FAIL unless the registration cache evicted at least
 * once on some rank), --expect-uncached (FAIL unless some registration bypassed the
 * cache because it did not fit its bounds), --require-brk-shrink (FAIL unless brk went down at least once).
 */
#include "common.h"
#include <malloc.h>
#include <sys/mman.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

enum { C_MALLOC, C_REALLOC, C_MMAP, C_PARTIAL_MUNMAP, C_MREMAP, C_MADVISE, C_BRK_SHRINK, C_TRIM,
       C_MSGS, C_BYTES, C_RECYCLED, C_RMA_ROUNDS, C_RMA_REUSED, NCOUNT };
static const char *cname[NCOUNT] = { "malloc/free", "realloc", "mmap/munmap", "partial munmap", "mremap",
                                     "madvise(DONTNEED)", "brk shrinks", "malloc_trim", "messages",
                                     "message bytes", "recycled-address buffers", "rma rounds",
                                     "rma reused addresses" };
static long counts[NCOUNT];
static volatile int stop_mem;
static double seconds;
static int big;
static size_t pagesz;

static void count(int k, long n) { __atomic_add_fetch(&counts[k], n, __ATOMIC_RELAXED); }

static uint64_t rng_next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    return t_mix(*s);
}

/* ---------- memory churn ---------- */

static void touch(void *p, size_t n, uint8_t v)
{
    uint8_t *b = p;
    for (size_t i = 0; i < n; i += pagesz)
        b[i] = v;
    if (n)
        b[n - 1] = v;
}

static void *xmap(void *hint, size_t n)
{
    void *p = mmap(hint, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (hint ? MAP_FIXED_NOREPLACE : 0),
                   -1, 0);
    if (p == MAP_FAILED && hint)
        p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        t_fail("mmap(%zu): %s", n, strerror(errno));
    return p;
}

static size_t rand_size(uint64_t *s, size_t lo, size_t hi)
{
    /* log-uniform between lo and hi */
    int lg_lo = 63 - __builtin_clzll(lo), lg_hi = 63 - __builtin_clzll(hi);
    int lg = lg_lo + (int)(rng_next(s) % (uint64_t)(lg_hi - lg_lo + 1));
    size_t base = (size_t)1 << lg;
    return base + (size_t)(rng_next(s) % base);
}

static void *churn(void *arg)
{
    uint64_t s = t_seed(t_rank, (uint64_t)(intptr_t)arg, 77, 0);
    enum { POOL = 16 };
    void *pool[POOL] = { 0 };
    size_t poolsz[POOL] = { 0 };
    while (!__atomic_load_n(&stop_mem, __ATOMIC_ACQUIRE)) {
        int op = (int)(rng_next(&s) % 8);
        switch (op) {
        case 0:
        case 1: { /* malloc/free with a pool: frees happen in random order */
            int k = (int)(rng_next(&s) % POOL);
            free(pool[k]);
            poolsz[k] = rand_size(&s, 512, 8u << 20);
            pool[k] = t_malloc(poolsz[k]);
            touch(pool[k], poolsz[k], (uint8_t)k);
            count(C_MALLOC, 1);
            break;
        }
        case 2: { /* realloc across the threshold, both ways */
            int k = (int)(rng_next(&s) % POOL);
            size_t n = rand_size(&s, 512, 4u << 20);
            void *p = realloc(pool[k], n);
            if (!p)
                t_fail("realloc(%zu) failed", n);
            pool[k] = p;
            poolsz[k] = n;
            touch(p, n, 3);
            count(C_REALLOC, 1);
            break;
        }
        case 3: { /* mmap/munmap, sometimes a hole in the middle first */
            size_t n = (rand_size(&s, 16 * 1024, 4u << 20) + pagesz - 1) & ~(pagesz - 1);
            uint8_t *p = xmap(NULL, n);
            touch(p, n, 1);
            if (n >= 4 * pagesz && (rng_next(&s) & 1)) {
                if (munmap(p + pagesz, 2 * pagesz))
                    t_fail("partial munmap: %s", strerror(errno));
                munmap(p, pagesz);
                munmap(p + 3 * pagesz, n - 3 * pagesz);
                count(C_PARTIAL_MUNMAP, 1);
            } else {
                munmap(p, n);
            }
            count(C_MMAP, 1);
            break;
        }
        case 4: { /* mremap grow (may move), shrink */
            size_t n = 64 * 1024;
            void *p = xmap(NULL, n);
            touch(p, n, 2);
            void *q = mremap(p, n, 8 * n, MREMAP_MAYMOVE);
            if (q == MAP_FAILED)
                t_fail("mremap grow: %s", strerror(errno));
            touch(q, 8 * n, 4);
            void *r = mremap(q, 8 * n, 2 * n, 0);
            if (r == MAP_FAILED)
                t_fail("mremap shrink: %s", strerror(errno));
            munmap(r, 2 * n);
            count(C_MREMAP, 1);
            break;
        }
        case 5: { /* madvise(DONTNEED): the pages go away and come back as zeros */
            size_t n = 256 * 1024;
            uint8_t *p = xmap(NULL, n);
            touch(p, n, 5);
            if (madvise(p + pagesz, n / 2, MADV_DONTNEED))
                t_fail("madvise: %s", strerror(errno));
            if (p[pagesz] != 0)
                t_fail("madvise(DONTNEED) left 0x%02x in a private anonymous page", p[pagesz]);
            touch(p, n, 6);
            munmap(p, n);
            count(C_MADVISE, 1);
            break;
        }
        case 6: { /* brk shrink through glibc (the only safe way with other threads in malloc) */
            void *before = sbrk(0);
            malloc_trim(0);
            if ((uintptr_t)sbrk(0) < (uintptr_t)before)
                count(C_BRK_SHRINK, 1);
            count(C_TRIM, 1);
            break;
        }
        default: { /* a burst of small blocks in the main arena's size classes */
            void *v[64];
            for (int i = 0; i < 64; i++)
                v[i] = t_malloc(1024 + (size_t)i * 512);
            for (int i = 63; i >= 0; i--)
                free(v[i]);
            count(C_MALLOC, 64);
            break;
        }
        }
    }
    for (int k = 0; k < POOL; k++)
        free(pool[k]);
    return NULL;
}

/* ---------- buffers for traffic ---------- */

struct buf {
    uint8_t *p;
    size_t n, maplen;
    int kind; /* 0 malloc, 1 mmap */
};

static void buf_get(struct buf *b, size_t n, int how, void *recycle_at)
{
    b->n = n;
    if (how == 0) {
        b->kind = 0;
        b->p = t_malloc(n);
        return;
    }
    b->kind = 1;
    b->maplen = (n + pagesz - 1) & ~(pagesz - 1);
    if (!b->maplen)
        b->maplen = pagesz;
    b->p = xmap(how == 2 ? recycle_at : NULL, b->maplen);
    if (how == 2 && (void *)b->p == recycle_at)
        count(C_RECYCLED, 1);
}

static void buf_put(struct buf *b)
{
    if (b->kind == 0)
        free(b->p);
    else
        munmap(b->p, b->maplen);
    b->p = NULL;
}

static int stop_now(MPI_Comm c, double t0)
{
    int done = t_now() - t0 > seconds;
    T_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &done, 1, MPI_INT, MPI_MAX, c));
    return done;
}

struct traffic_arg {
    int t;
    MPI_Comm comm;
    double t0;
    int iters;
};

static void *traffic(void *arg)
{
    struct traffic_arg *a = arg;
    static const size_t sizes[] = { 1, 100, 4096, 65536 + 3, 200 * 1024, 1 << 20, 4 << 20 };
    int nsizes = big ? 7 : 6;
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    void *last_s = NULL, *last_r = NULL;
    char what[256];
    for (int it = 0;; it++) {
        if (stop_now(a->comm, a->t0)) {
            a->iters = it;
            break;
        }
        size_t n = sizes[(it + a->t) % nsizes];
        int how = (it / nsizes + a->t) % 3; /* same on every rank */
        struct buf sb, rb;
        MPI_Request rq[2];
        MPI_Status st[2];
        snprintf(what, sizeof(what), "traffic thread %d iteration %d size %zu buffers %s", a->t, it, n,
                 how == 0 ? "malloc" : how == 1 ? "mmap" : "recycled mmap");
        t_touch();
        buf_get(&sb, n, how, last_s);
        buf_get(&rb, n, how, last_r);
        t_fill(sb.p, n, t_seed(t_rank, (uint64_t)it, (uint64_t)a->t, 1));
        memset(rb.p, 0xee, n);
        T_CHECK_MPI(MPI_Irecv(rb.p, (int)n, MPI_BYTE, left, it, a->comm, &rq[0]));
        if (it % 5 == 4)
            T_CHECK_MPI(MPI_Issend(sb.p, (int)n, MPI_BYTE, right, it, a->comm, &rq[1]));
        else
            T_CHECK_MPI(MPI_Isend(sb.p, (int)n, MPI_BYTE, right, it, a->comm, &rq[1]));
        T_CHECK_MPI(MPI_Waitall(2, rq, st));
        int got = -1;
        T_CHECK_MPI(MPI_Get_count(&st[0], MPI_BYTE, &got));
        if (st[0].MPI_SOURCE != left || st[0].MPI_TAG != it || got != (int)n)
            t_fail("%s: status source %d tag %d count %d, expected %d %d %zu", what, st[0].MPI_SOURCE,
                   st[0].MPI_TAG, got, left, it, n);
        t_check(rb.p, n, t_seed((uint64_t)left, (uint64_t)it, (uint64_t)a->t, 1), what);
        last_s = sb.p;
        last_r = rb.p;
        buf_put(&sb);
        buf_put(&rb);
        count(C_MSGS, 1);
        count(C_BYTES, (long)n);
    }
    return NULL;
}

/* ---------- one-sided over recycled mappings ---------- */

static void rma_rounds(MPI_Comm c, double t0, int *rounds)
{
    static const size_t sizes[] = { 4096, 64 * 1024, 1 << 20 };
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    void *win_at = NULL, *dst_at = NULL;
    char what[256];
    for (int r = 0;; r++) {
        if (stop_now(c, t0)) {
            *rounds = r;
            break;
        }
        size_t n = sizes[r % 3];
        struct buf wb, db;
        int how = r % 4 == 3 ? 0 : 2; /* mostly recycled mappings, sometimes malloc */
        snprintf(what, sizeof(what), "rma round %d size %zu %s", r, n, how ? "recycled mmap" : "malloc");
        t_touch();
        buf_get(&wb, n, how, win_at);
        buf_get(&db, n, how, dst_at);
        if (how == 2 && (void *)wb.p == win_at)
            count(C_RMA_REUSED, 1);
        t_fill(wb.p, n, t_seed(t_rank, (uint64_t)r, 2, 9));
        memset(db.p, 0xee, n);
        MPI_Win win;
        T_CHECK_MPI(MPI_Win_create(wb.p, (MPI_Aint)n, 1, MPI_INFO_NULL, c, &win));
        T_CHECK_MPI(MPI_Win_fence(0, win));
        T_CHECK_MPI(MPI_Get(db.p, (int)n, MPI_BYTE, right, 0, (int)n, MPI_BYTE, win));
        T_CHECK_MPI(MPI_Win_fence(0, win));
        t_check(db.p, n, t_seed((uint64_t)right, (uint64_t)r, 2, 9), what);
        /* small gets into separate fresh one-page mappings */
        {
            enum { NSMALL = 4 };
            uint8_t *sm[NSMALL];
            size_t m = n < pagesz ? n : pagesz;
            for (int k = 0; k < NSMALL; k++) {
                sm[k] = xmap(NULL, pagesz);
                memset(sm[k], 0xee, m);
                T_CHECK_MPI(MPI_Get(sm[k], (int)m, MPI_BYTE, right, (MPI_Aint)(n - m), (int)m, MPI_BYTE, win));
            }
            T_CHECK_MPI(MPI_Win_fence(0, win));
            for (int k = 0; k < NSMALL; k++) {
                uint8_t *exp = t_malloc(n);
                t_fill(exp, n, t_seed((uint64_t)right, (uint64_t)r, 2, 9));
                t_check_mem(sm[k], exp + (n - m), m, what);
                free(exp);
                munmap(sm[k], pagesz);
            }
        }
        /* now put our own half window into the right neighbour's first half */
        t_fill(db.p, n / 2, t_seed(t_rank, (uint64_t)r, 3, 9));
        T_CHECK_MPI(MPI_Put(db.p, (int)(n / 2), MPI_BYTE, right, 0, (int)(n / 2), MPI_BYTE, win));
        T_CHECK_MPI(MPI_Win_fence(0, win));
        t_check(wb.p, n / 2, t_seed((uint64_t)left, (uint64_t)r, 3, 9), what);
        T_CHECK_MPI(MPI_Win_free(&win));
        if (how == 2) {
            win_at = wb.p;
            dst_at = db.p;
        }
        buf_put(&wb);
        buf_put(&db);
        count(C_RMA_ROUNDS, 1);
    }
}

/* our BTL's registration-cache counters (MPI_T performance variables), bound in main */
static const char *const rc_names[7] = { "btl_ofi_rcache_hits",     "btl_ofi_rcache_misses",
                                         "btl_ofi_rcache_invalidations", "btl_ofi_rcache_evictions",
                                         "btl_ofi_rcache_uncached", "btl_ofi_rcache_live_entries",
                                         "btl_ofi_rcache_live_bytes" };
static t_pvars_t rc_vars;
static int have_rc;

static int read_rcache(long *evictions, long *uncached, char *buf, size_t len)
{
    unsigned long long v[7] = { 0 };
    buf[0] = 0;
    if (!have_rc)
        return -1;
    t_pvars_read(&rc_vars, v);
    snprintf(buf, len, "hits %llu misses %llu invalidations %llu evictions %llu uncached %llu live entries %llu live "
             "bytes %llu", v[0], v[1], v[2], v[3], v[4], v[5], v[6]);
    *evictions = (long)v[3];
    *uncached = (long)v[4];
    return 0;
}

int main(int argc, char **argv)
{
    int provided = t_init_thread(&argc, &argv, "stress", MPI_THREAD_MULTIPLE);
    if (provided != MPI_THREAD_MULTIPLE)
        t_fail("MPI_THREAD_MULTIPLE requested, library provides %d", provided);
    pagesz = (size_t)sysconf(_SC_PAGESIZE);
    seconds = (double)t_opt_long("seconds", "OMPI_OFI_TEST_STRESS_SECONDS", t_quick ? 6 : 20);
    int nthreads = (int)t_opt_long("threads", NULL, 2);
    int nmem = (int)t_opt_long("mem-threads", NULL, 2);
    int rma = t_opt_flag("rma");
    big = t_opt_flag("big");
    if (nthreads < 1 || nthreads > 8 || nmem < 0 || nmem > 8)
        t_fail("--threads 1..8, --mem-threads 0..8");
    t_section("setup");
    int tprov;
    T_CHECK_MPI(t_mpit_init(&tprov));
    have_rc = t_pvars_open(&rc_vars, rc_names, 7);
    MPI_Comm comms[8], rcomm;
    for (int t = 0; t < nthreads; t++)
        T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comms[t]));
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &rcomm));
    const char *mt = getenv("MALLOC_MMAP_THRESHOLD_"), *tt = getenv("MALLOC_TRIM_THRESHOLD_");
    t_info("%d traffic threads, %d memory threads, rma %s, %.0f s; MALLOC_MMAP_THRESHOLD_=%s MALLOC_TRIM_THRESHOLD_=%s",
           nthreads, nmem, rma ? "on" : "off", seconds, mt ? mt : "unset", tt ? tt : "unset");

    t_section("stress");
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    double t0 = t_now();
    pthread_t mth[8], tth[8];
    struct traffic_arg ta[8];
    for (int m = 0; m < nmem; m++)
        if (pthread_create(&mth[m], NULL, churn, (void *)(intptr_t)m))
            t_fail("pthread_create failed");
    for (int t = 0; t < nthreads; t++) {
        ta[t] = (struct traffic_arg){ .t = t, .comm = comms[t], .t0 = t0 };
        if (pthread_create(&tth[t], NULL, traffic, &ta[t]))
            t_fail("pthread_create failed");
    }
    int rounds = 0;
    if (rma)
        rma_rounds(rcomm, t0, &rounds);
    for (int t = 0; t < nthreads; t++)
        pthread_join(tth[t], NULL);
    __atomic_store_n(&stop_mem, 1, __ATOMIC_RELEASE);
    for (int m = 0; m < nmem; m++)
        pthread_join(mth[m], NULL);
    double el = t_now() - t0;

    t_section("report");
    long sum[NCOUNT];
    T_CHECK_MPI(MPI_Allreduce(counts, sum, NCOUNT, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
    char line[2048];
    size_t off = 0;
    for (int k = 0; k < NCOUNT; k++)
        off += (size_t)snprintf(line + off, sizeof(line) - off, "%s%s %ld", k ? ", " : "", cname[k], sum[k]);
    t_info("%.1f s; summed over ranks: %s", el, line);
    if (sum[C_MSGS] == 0)
        t_fail("no message was exchanged");
    if (nmem && (sum[C_MMAP] == 0 || sum[C_MREMAP] == 0 || sum[C_MADVISE] == 0 || sum[C_MALLOC] == 0))
        t_fail("a kind of memory release never ran: %s", line);
    if (rma && sum[C_RMA_ROUNDS] == 0)
        t_fail("no one-sided round ran");
    if (t_opt_flag("require-brk-shrink") && sum[C_BRK_SHRINK] == 0)
        t_fail("brk never went down: %s", line);

    long ev[2] = { -1, -1 }, maxev[2] = { -1, -1 };
    char rc[1024];
    int have = read_rcache(&ev[0], &ev[1], rc, sizeof(rc)) == 0;
    if (have)
        printf("INFO prog=stress rank=%d rcache: %s\n", t_rank, rc);
    T_CHECK_MPI(MPI_Allreduce(ev, maxev, 2, MPI_LONG, MPI_MAX, MPI_COMM_WORLD));
    if (t_opt_flag("expect-evictions") && maxev[0] <= 0)
        t_fail("--expect-evictions: the registration cache evicted nothing on any rank (here: %s)",
               have ? rc : "btl_ofi_rcache_* not found: is our BTL loaded?");
    if (t_opt_flag("expect-uncached") && maxev[1] <= 0)
        t_fail("--expect-uncached: no registration bypassed the cache on any rank (here: %s)",
               have ? rc : "btl_ofi_rcache_* not found: is our BTL loaded?");
    for (int t = 0; t < nthreads; t++)
        T_CHECK_MPI(MPI_Comm_free(&comms[t]));
    T_CHECK_MPI(MPI_Comm_free(&rcomm));
    t_pvars_close(&rc_vars);
    MPI_T_finalize();
    return t_pass();
}
