/*
 * stale: a registration cache must not serve a stale registration for reused addresses.
 *
 * Every rank, for each size (4 KiB, 64 KiB, 1 MiB, 8 MiB; 3 rounds each, --rounds N):
 *   1. mmap an anonymous mapping, fill it with pattern A, expose it (MPI_Win_create); the
 *      left neighbour MPI_Gets all of it and MPI_Puts a block into it; both are checked;
 *   2. MPI_Win_free, munmap;
 *   3. mmap a new mapping at the same address (MAP_FIXED_NOREPLACE; if the kernel does
 *      not place it there, retry a few times with other hints; whether the address was
 *      reused is reported) filled with pattern B, expose it (MPI_Win_create);
 *   4. the left neighbour MPI_Gets it and must read B (not A), and MPI_Puts a block that
 *      must land in the new mapping.
 * Variants: the second mapping smaller than the first; larger; and the same memory
 * recycled through malloc/free (M_MMAP_THRESHOLD is fixed at 128 KiB, so the 1 MiB and
 * 8 MiB chunks are mmap'd and munmap'd by glibc, the smaller ones come from the heap).
 * And a madvise case: MADV_DONTNEED on the window memory (private anonymous pages are
 * replaced by zero pages), then pattern C written, then a new window: the peer must read C.
 * Each scenario runs twice: with a window of its own per buffer (MPI_Win_create /
 * MPI_Win_free), and with one dynamic window per scenario that the buffers are attached
 * to and detached from (MPI_Win_attach / MPI_Win_detach, absolute displacements; with
 * --quick not for 8 MiB, slow on udp;ofi_rxd).
 * Then a recycle loop (--loops N, default 100, 20 with --quick): one dynamic window, a
 * 1 MiB mapping attached, read by every rank under MPI_Win_lock_all (passive target),
 * detached, munmap'd and mapped again, alternately at the old address and wherever the
 * kernel puts it, new contents each time (osc rdma's copy of a peer's region table must
 * follow too).
 * A count of reused addresses is printed; with --require-reuse a new mapping of the same
 * size or smaller (and every other one of the loop) not at the old address fails.
 *
 * Registration-cache counters. Providers that read registered memory by virtual
 * address (all of this machine's) return the new contents even through a stale
 * registration, so the data alone cannot show that staleness was handled. When the
 * MPI_T performance variables btl_ofi_rcache_* exist (our BTL), every rank reads its
 * counters (hits, misses, invalidations, evictions, uncached) for each release:
 *   before  = right before the release (munmap, free of an mmap'd chunk, madvise), after
 *             the old memory's window was freed / the old memory detached;
 *   after   = right after the new memory's MPI_Win_create / MPI_Win_attach;
 * and asserts, per scenario, with a FAIL line naming the scenario:
 *   invalidations increased  (the release reached the cache and invalidated the entry),
 *   misses increased         (a fresh registration was made),
 *   hits did not increase    (MPI_Win_attach only, which registers the attached memory
 *                             and nothing else: the new memory is a fresh mapping or
 *                             freshly released pages, so a cached registration covering
 *                             it is stale. MPI_Win_create also registers osc rdma's own
 *                             memory, which may be a legitimate hit: on udp;ofi_rxd an
 *                             8 KiB region of every window).
 * A scenario is checked only when the old memory's registration was in the cache (its
 * MPI_Win_create / MPI_Win_attach left "uncached" unchanged, and nothing was evicted
 * before the release): with btl_ofi_rcache_max_entries / _max_bytes bounds
 * (scripts/test-hostile) some registrations bypass the cache. Heap chunks (malloc below
 * the mmap threshold) are not released by free, so they are not checked. INFO lines give,
 * per kind of release and window, the deltas summed over ranks (--verbose 2: per rank and
 * scenario). Without the variable (ob1 over vader) only the data is checked;
 * --expect-rcache (the runner passes it in the btl lane) makes a missing variable, or no
 * checked scenario at all (say btl_ofi_rcache_max_entries 0, or release events that do
 * not reach the cache, which then caches nothing), a FAIL.
 *
 * Options: --rounds N, --loops N, --require-reuse, --expect-rcache;
 * --bypass-hooks (self-test of the counter check): munmap and madvise through the raw
 * system call, which Open MPI's memory hooks do not see, so the cache never learns of the
 * release; the data still reads right on these providers, the counter check must FAIL.
 */
#include "common.h"
#include <malloc.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

#define MMAP_THRESHOLD (128 * 1024)

static int reused[3], not_reused[3]; /* remap same/shrink, remap grow, malloc */
static int bypass_hooks;
static int release_events = 1;     /* opal_common_ofi_memory_monitor_status */
static char monitor_status[1024] = "unknown";

/* ---------- registration-cache counters (btl_ofi_rcache_* through MPI_T) ---------- */

enum { RC_HITS, RC_MISSES, RC_INVAL, RC_EVICT, RC_UNCACHED, RC_N };
struct rc {
    long v[RC_N];
};
/* the counters around one MPI_Win_create / MPI_Win_attach */
struct rc_win {
    struct rc before, after;
};

enum { K_SAME, K_SMALLER, K_LARGER, K_MALLOC, K_MADVISE, K_LOOP, NKINDS };
static const char *kind_name[NKINDS] = { "munmap + mmap of the same size", "munmap + mmap smaller",
                                         "munmap + mmap larger",           "free + malloc (mmap'd chunk)",
                                         "madvise(MADV_DONTNEED)",         "recycle loop (passive target)" };
/* how the memory is exposed */
enum { M_CREATE, M_ATTACH, NMODES };
static const char *mode_name[NMODES] = { "MPI_Win_create", "MPI_Win_attach" };
static long k_checked[NKINDS][NMODES], k_skipped[NKINDS][NMODES], k_delta[NKINDS][NMODES][RC_N];

/* our BTL's counters (MPI_T performance variables), in the order of enum RC_*; have_rc 0:
 * they do not exist (not our BTL) */
static const char *const rc_names[RC_N] = { "btl_ofi_rcache_hits", "btl_ofi_rcache_misses",
                                            "btl_ofi_rcache_invalidations", "btl_ofi_rcache_evictions",
                                            "btl_ofi_rcache_uncached" };
static t_pvars_t rc_vars;
static int have_rc;

static void rc_read(struct rc *s)
{
    unsigned long long v[RC_N] = { 0 };
    memset(s, 0, sizeof(*s));
    if (!have_rc)
        return;
    t_pvars_read(&rc_vars, v);
    for (int k = 0; k < RC_N; k++)
        s->v[k] = (long)v[k];
}

/*
 * w1: the counters around the old buffer's MPI_Win_create / MPI_Win_attach; before:
 * right before its release; after: right after the new memory's MPI_Win_create /
 * MPI_Win_attach. MPI_Win_attach registers the attached memory and nothing else, so
 * there a hit can only be the new memory's (stale) registration; MPI_Win_create also
 * registers osc rdma's own memory, which may be a legitimate hit (on udp;ofi_rxd every
 * window registers an 8 KiB region that is a hit from the second window on), so hits are
 * checked with MPI_Win_attach only.
 */
static void rc_check(int kind, int mode, const char *release, const struct rc_win *w1, const struct rc *before,
                     const struct rc *after)
{
    long d[RC_N];
    int stale;
    if (!have_rc)
        return;
    if (w1->after.v[RC_UNCACHED] != w1->before.v[RC_UNCACHED] || before->v[RC_EVICT] != w1->after.v[RC_EVICT]) {
        k_skipped[kind][mode]++; /* the old registration may not have been in the cache */
        return;
    }
    for (int k = 0; k < RC_N; k++) {
        d[k] = after->v[k] - before->v[k];
        k_delta[kind][mode][k] += d[k];
    }
    k_checked[kind][mode]++;
    if (t_verbose > 1)
        printf("[stale rank %d] rcache %s, %s: invalidations %+ld misses %+ld hits %+ld uncached %+ld "
               "evictions %+ld\n",
               t_rank, release, mode_name[mode], d[RC_INVAL], d[RC_MISSES], d[RC_HITS], d[RC_UNCACHED],
               d[RC_EVICT]);
    stale = mode == M_ATTACH && d[RC_HITS] > 0;
    if (d[RC_INVAL] <= 0 || d[RC_MISSES] <= 0 || stale)
        t_fail("registration-cache counters (btl_ofi_rcache_*) from before the %s to after the new memory's "
               "%s: invalidations %+ld, misses %+ld, hits %+ld, uncached %+ld, evictions %+ld:%s%s%s",
               release, mode_name[mode], d[RC_INVAL], d[RC_MISSES], d[RC_HITS], d[RC_UNCACHED], d[RC_EVICT],
               d[RC_INVAL] <= 0 ? " the release invalidated no cached registration;" : "",
               d[RC_MISSES] <= 0 ? " no fresh registration was made;" : "",
               stale ? " the attached memory was served a cached (stale) registration" : "");
}

static void rc_report(int expect)
{
    long checked[NKINDS][NMODES], skipped[NKINDS][NMODES], delta[NKINDS][NMODES][RC_N], total = 0;
    if (!have_rc) {
        t_info("registration-cache counters not checked: no MPI_T variables btl_ofi_rcache_* (not our BTL)");
        return;
    }
    T_CHECK_MPI(MPI_Allreduce(k_checked, checked, NKINDS * NMODES, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
    T_CHECK_MPI(MPI_Allreduce(k_skipped, skipped, NKINDS * NMODES, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
    T_CHECK_MPI(MPI_Allreduce(k_delta, delta, NKINDS * NMODES * RC_N, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
    for (int k = 0; k < NKINDS; k++) {
        char line[1024];
        size_t off = 0;
        for (int m = 0; m < NMODES; m++) {
            total += checked[k][m];
            if (checked[k][m] + skipped[k][m] == 0)
                continue;
            off += (size_t)snprintf(line + off, sizeof(line) - off,
                                    "%s%s: checked %ld of %ld, invalidations %+ld misses %+ld hits %+ld uncached "
                                    "%+ld evictions %+ld",
                                    off ? "; " : "", mode_name[m], checked[k][m], checked[k][m] + skipped[k][m],
                                    delta[k][m][RC_INVAL], delta[k][m][RC_MISSES], delta[k][m][RC_HITS],
                                    delta[k][m][RC_UNCACHED], delta[k][m][RC_EVICT]);
        }
        if (off)
            t_info("rcache deltas from before the release to after the new registration, summed over ranks, %s: %s",
                   kind_name[k], line);
    }
    if (expect && total == 0) {
        if (!release_events)
            t_info("--expect-rcache: no scenario checked, as expected: memory releases do not reach the "
                   "BTL's registration cache in this process (%s), so it caches nothing",
                   monitor_status);
        else
            t_fail("--expect-rcache: no scenario could be checked: every old registration bypassed the cache "
                   "(btl_ofi_rcache_* show nothing about invalidation)");
    }
}

/* ---------- memory ---------- */

static void *map_at(void *hint, size_t len)
{
    void *p = mmap(hint, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (hint ? MAP_FIXED_NOREPLACE : 0),
                   -1, 0);
    if (p == MAP_FAILED && hint)
        p = mmap(hint, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); /* plain hint */
    if (p == MAP_FAILED)
        t_fail("mmap(%zu) failed: %s", len, strerror(errno));
    return p;
}

/* The releases under test; --bypass-hooks hides them from Open MPI's memory hooks. */
static void unmap(void *p, size_t len)
{
    int rc = bypass_hooks ? (int)syscall(SYS_munmap, p, len) : munmap(p, len);
    if (rc != 0)
        t_fail("munmap: %s", strerror(errno));
}

static void dontneed(void *p, size_t len)
{
    int rc = bypass_hooks ? (int)syscall(SYS_madvise, p, len, MADV_DONTNEED) : madvise(p, len, MADV_DONTNEED);
    if (rc != 0)
        t_fail("madvise: %s", strerror(errno));
}

/*
 * Expose buf through a window and let the left neighbour get/put it (fence; with
 * passive, only get it under MPI_Win_lock_all), check, give the window up. dyn NULL:
 * a window of its own (MPI_Win_create ... MPI_Win_free); else buf is attached to the
 * dynamic window *dyn (MPI_Win_attach ... MPI_Win_detach), addressed by its absolute
 * address. rc (may be NULL) receives the counters around MPI_Win_create / MPI_Win_attach.
 */
static void exchange(MPI_Win *dyn, uint8_t *buf, size_t len, uint64_t seed, const char *what, int round,
                     int passive, struct rc_win *rc)
{
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    MPI_Win win;
    MPI_Aint *lens = t_malloc(sizeof(MPI_Aint) * (size_t)t_size), *disp = t_malloc(sizeof(MPI_Aint) * (size_t)t_size);
    MPI_Aint mylen = (MPI_Aint)len, rlen, mine = 0;
    uint8_t *got, put[256];
    char w[300];
    size_t putoff;

    T_CHECK_MPI(MPI_Allgather(&mylen, 1, MPI_AINT, lens, 1, MPI_AINT, MPI_COMM_WORLD));
    rlen = lens[right];
    got = t_malloc((size_t)rlen);
    memset(got, 0, (size_t)rlen);
    t_fill(buf, len, seed);
    if (rc)
        rc_read(&rc->before);
    if (dyn) {
        win = *dyn;
        T_CHECK_MPI(MPI_Win_attach(win, buf, (MPI_Aint)len));
    } else {
        T_CHECK_MPI(MPI_Win_create(buf, (MPI_Aint)len, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win));
        MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
    }
    if (rc)
        rc_read(&rc->after);
    if (dyn)
        T_CHECK_MPI(MPI_Get_address(buf, &mine));
    /* after every rank attached: nobody reads a region before it is there */
    T_CHECK_MPI(MPI_Allgather(&mine, 1, MPI_AINT, disp, 1, MPI_AINT, MPI_COMM_WORLD));
    if (passive) {
        T_CHECK_MPI(MPI_Win_lock_all(0, win));
        T_CHECK_MPI(MPI_Get(got, (int)rlen, MPI_BYTE, right, disp[right], (int)rlen, MPI_BYTE, win));
        T_CHECK_MPI(MPI_Win_unlock_all(win));
        T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD)); /* every get of this window done */
    } else {
        t_fill(put, sizeof(put), t_seed(301, (uint64_t)t_rank, (uint64_t)round, (uint64_t)rlen));
        putoff = (size_t)rlen / 3;
        T_CHECK_MPI(MPI_Win_fence(MPI_MODE_NOPRECEDE, win));
        T_CHECK_MPI(MPI_Get(got, (int)rlen, MPI_BYTE, right, disp[right], (int)rlen, MPI_BYTE, win));
        T_CHECK_MPI(MPI_Win_fence(0, win));
        T_CHECK_MPI(MPI_Put(put, (int)sizeof(put), MPI_BYTE, right, disp[right] + (MPI_Aint)putoff,
                            (int)sizeof(put), MPI_BYTE, win));
        T_CHECK_MPI(MPI_Win_fence(MPI_MODE_NOSUCCEED, win));
    }
    /* what we read from the right neighbour: its current pattern, which we know from the
     * seeds it used (the caller passes the same seed scheme on every rank) */
    {
        uint64_t rseed = seed ^ t_seed((uint64_t)t_rank, 0, 0, 0) ^ t_seed((uint64_t)right, 0, 0, 0);
        snprintf(w, sizeof(w), "%s: MPI_Get of rank %d's window (%zu bytes)", what, right, (size_t)rlen);
        t_check(got, (size_t)rlen, rseed, w);
    }
    if (!passive) {
        uint8_t exp[256];
        t_fill(exp, sizeof(exp), t_seed(301, (uint64_t)left, (uint64_t)round, (uint64_t)lens[t_rank]));
        snprintf(w, sizeof(w), "%s: block MPI_Put by rank %d into this window", what, left);
        t_check_mem(buf + len / 3, exp, sizeof(exp), w);
    }
    if (dyn)
        T_CHECK_MPI(MPI_Win_detach(win, buf));
    else
        T_CHECK_MPI(MPI_Win_free(&win));
    free(got);
    free(disp);
    free(lens);
}

/* per-rank seed so that the reader can compute the writer's pattern */
static uint64_t pseed(int phase, int round, size_t len)
{
    return t_seed(300 + (uint64_t)phase, (uint64_t)round, len, 0) ^ t_seed((uint64_t)t_rank, 0, 0, 0);
}

/* The window of one scenario: NULL for MPI_Win_create, else a dynamic window. */
static MPI_Win *scenario_win(int mode, MPI_Win *w)
{
    if (mode != M_ATTACH)
        return NULL;
    T_CHECK_MPI(MPI_Win_create_dynamic(MPI_INFO_NULL, MPI_COMM_WORLD, w));
    MPI_Win_set_errhandler(*w, MPI_ERRORS_RETURN);
    return w;
}

static void scenario_win_free(MPI_Win *dyn)
{
    if (dyn)
        T_CHECK_MPI(MPI_Win_free(dyn));
}

/* mmap len bytes at a (just unmapped), retrying a few times; reports reuse */
static uint8_t *remap_at(uint8_t *a, size_t len, int cls, int require, const char *what)
{
    uint8_t *b = map_at(a, len);
    for (int tries = 0; b != a && tries < 8; tries++) {
        munmap(b, len);
        b = map_at(a, len);
    }
    if (b == a)
        reused[cls]++;
    else
        not_reused[cls]++;
    if (b != a && require)
        t_fail("%s: the new mapping is at %p, not at the old address %p", what, (void *)b, (void *)a);
    return b;
}

static void remap(size_t len1, size_t len2, int round, int require, int mode)
{
    int cls = len2 > len1 ? 1 : 0, kind = len2 > len1 ? K_LARGER : len2 < len1 ? K_SMALLER : K_SAME;
    char what[200];
    uint8_t *a, *b;
    int same, all_same;
    struct rc_win w1, w2;
    struct rc before;
    MPI_Win dw, *dyn;
    snprintf(what, sizeof(what), "mmap %zu -> munmap -> mmap %zu at the same address, %s, round %d", len1, len2,
             mode_name[mode], round);
    t_section("%s", what);
    dyn = scenario_win(mode, &dw);
    a = map_at(NULL, len1);
    exchange(dyn, a, len1, pseed(1 + 10 * mode, round, len1), "first mapping (pattern A)", round, 0, &w1);
    rc_read(&before);
    unmap(a, len1);
    b = remap_at(a, len2, cls, require, what);
    same = b == a;
    T_CHECK_MPI(MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    exchange(dyn, b, len2, pseed(2 + 10 * mode, round, len2),
             all_same ? "new mapping at the reused address (pattern B)"
                      : "new mapping (address not reused on some rank) (pattern B)",
             round, 0, &w2);
    rc_check(kind, mode, "munmap", &w1, &before, &w2.after);
    scenario_win_free(dyn);
    unmap(b, len2);
}

static void via_malloc(size_t len, int round, int mode)
{
    uint8_t *a, *b;
    struct rc_win w1, w2;
    struct rc before;
    MPI_Win dw, *dyn;
    t_section("malloc/free/malloc of %zu bytes, %s, round %d", len, mode_name[mode], round);
    dyn = scenario_win(mode, &dw);
    a = t_malloc(len);
    exchange(dyn, a, len, pseed(3 + 10 * mode, round, len), "first malloc (pattern A)", round, 0, &w1);
    rc_read(&before);
    free(a);
    b = t_malloc(len);
    if (b == a)
        reused[2]++;
    else
        not_reused[2]++;
    exchange(dyn, b, len, pseed(4 + 10 * mode, round, len), "second malloc (pattern B)", round, 0, &w2);
    /* a heap chunk is not given back by free: no release, nothing to invalidate */
    if (len >= MMAP_THRESHOLD)
        rc_check(K_MALLOC, mode, "free of the mmap'd chunk", &w1, &before, &w2.after);
    scenario_win_free(dyn);
    free(b);
}

static void via_madvise(size_t len, int round, int mode)
{
    uint8_t *a = map_at(NULL, len);
    struct rc_win w1, w2;
    struct rc before;
    MPI_Win dw, *dyn;
    t_section("madvise(MADV_DONTNEED) on %zu bytes, %s, round %d", len, mode_name[mode], round);
    dyn = scenario_win(mode, &dw);
    exchange(dyn, a, len, pseed(5 + 10 * mode, round, len), "before madvise (pattern A)", round, 0, &w1);
    rc_read(&before);
    dontneed(a, len);
    exchange(dyn, a, len, pseed(6 + 10 * mode, round, len), "after madvise (pattern C)", round, 0, &w2);
    rc_check(K_MADVISE, mode, "madvise(MADV_DONTNEED)", &w1, &before, &w2.after);
    scenario_win_free(dyn);
    unmap(a, len);
}

/*
 * Recycled memory read under MPI_Win_lock_all (passive target; the former btl_stale.c's loop): one
 * dynamic window, the same length attached, detached, munmap'd and mapped again
 * (alternately at the old address and wherever the kernel puts it) with new contents.
 * Peers also keep osc rdma's copy of the target's region table: it must follow.
 */
static void recycle_loop(int loops, size_t len, int require)
{
    uint8_t *buf = map_at(NULL, len);
    struct rc_win prev, cur;
    struct rc before;
    char what[200];
    MPI_Win dw, *dyn = scenario_win(M_ATTACH, &dw);
    for (int k = 0; k <= loops; k++) {
        snprintf(what, sizeof(what), "recycle loop, %s, passive target: attachment %d of %d, %zu bytes, mapped %s",
                 mode_name[M_ATTACH], k, loops, len,
                 k == 0 ? "first" : k % 2 ? "again at the same address" : "again anywhere");
        t_section("%s", what);
        if (k > 0) {
            uint8_t *old = buf;
            rc_read(&before);
            unmap(buf, len);
            buf = k % 2 ? remap_at(old, len, 0, require, what) : map_at(NULL, len);
        }
        exchange(dyn, buf, len, pseed(7, k, len), "recycled mapping", k, 1, &cur);
        if (k > 0)
            rc_check(K_LOOP, M_ATTACH, "munmap", &prev, &before, &cur.after);
        prev = cur;
    }
    scenario_win_free(dyn);
    unmap(buf, len);
}

int main(int argc, char **argv)
{
    size_t sizes[] = { 4096, 65536, 1 << 20, 8 << 20 };
    int rounds, loops, require, expect_rc, prov;
    t_init(&argc, &argv, "stale");
    rounds = (int)t_opt_long("rounds", NULL, t_quick ? 1 : 3);
    loops = (int)t_opt_long("loops", NULL, t_quick ? 20 : 100);
    require = t_opt_flag("require-reuse");
    expect_rc = t_opt_flag("expect-rcache");
    bypass_hooks = t_opt_flag("bypass-hooks");
    /* a fixed threshold (no dynamic raise after a free): chunks of 128 KiB and more are
     * always mmap'd, and munmap'd by free */
    if (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1)
        t_fail("mallopt(M_MMAP_THRESHOLD) failed");
    T_CHECK_MPI(t_mpit_init(&prov));
    have_rc = t_pvars_open(&rc_vars, rc_names, RC_N);
    if (!have_rc && expect_rc)
        t_fail("--expect-rcache: no MPI_T variables btl_ofi_rcache_*: is our BTL loaded?");
    {
        /* Without Open MPI's memory hooks (e.g. an Open MPI built with --disable-dlopen)
         * the cache is told of no release and caches nothing: it cannot go stale, and
         * there is nothing to count. The status says so. */
        int st_idx, cnt;
        MPI_T_cvar_handle h;
        if (MPI_T_cvar_get_index("opal_common_ofi_memory_monitor_status", &st_idx) == MPI_SUCCESS &&
            MPI_T_cvar_handle_alloc(st_idx, NULL, &h, &cnt) == MPI_SUCCESS) {
            MPI_T_cvar_read(h, monitor_status);
            MPI_T_cvar_handle_free(&h);
            release_events = strstr(monitor_status, "release events to our caches: no") == NULL;
        }
    }
    if (bypass_hooks)
        t_info("--bypass-hooks: munmap and madvise bypass Open MPI's memory hooks; the counter check must fail");
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < 4; i++)
            for (int m = 0; m < NMODES; m++) {
                if (m == M_ATTACH && t_quick && sizes[i] > (1 << 20))
                    continue; /* --quick: 8 MiB windows only once (slow on udp;ofi_rxd) */
                remap(sizes[i], sizes[i], r, require, m);
                remap(sizes[i], sizes[i] / 2, r, require, m);
                remap(sizes[i], sizes[i] * 2, r, 0, m);
                via_malloc(sizes[i], r, m);
                via_madvise(sizes[i], r, m);
            }
    if (loops > 0)
        recycle_loop(loops, 1 << 20, require);
    t_section("report");
    t_info("rank 0: address reused/not reused: mmap same size or smaller (and the loop's) %d/%d, mmap larger "
           "%d/%d (growing in place is usually impossible), malloc %d/%d",
           reused[0], not_reused[0], reused[1], not_reused[1], reused[2], not_reused[2]);
    rc_report(expect_rc);
    t_pvars_close(&rc_vars);
    T_CHECK_MPI(MPI_T_finalize());
    return t_pass();
}
