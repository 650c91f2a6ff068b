/*
 * stale: a registration cache must not serve a stale registration for reused addresses.
 *
 * Every rank, for each size (4 KiB, 64 KiB, 1 MiB, 8 MiB; 3 rounds each, --rounds N):
 *   1. mmap an anonymous mapping, fill it with pattern A, MPI_Win_create on it; the left
 *      neighbour MPI_Gets all of it and MPI_Puts a block into it; both are checked;
 *   2. MPI_Win_free, munmap;
 *   3. mmap a new mapping at the same address (MAP_FIXED_NOREPLACE; if the kernel does
 *      not place it there, retry a few times with other hints; whether the address was
 *      reused is reported) filled with pattern B, MPI_Win_create on it;
 *   4. the left neighbour MPI_Gets it and must read B (not A), and MPI_Puts a block that
 *      must land in the new mapping.
 * Variants: the second mapping smaller than the first; larger; and the same memory
 * recycled through malloc/free (large malloc chunks are mmap'd by glibc). And a madvise
 * case: MADV_DONTNEED on the window memory (private anonymous pages are replaced by zero
 * pages), then pattern C written, then a new window: the peer must read C.
 * A count of reused addresses is printed; with --require-reuse a non-reused address fails.
 *
 * Options: --rounds N, --require-reuse.
 */
#include "common.h"
#include <sys/mman.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

static int reused[3], not_reused[3]; /* remap same/shrink, remap grow, malloc */

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

/* Create a window on buf, let the left neighbour get/put it, check, free the window. */
static void exchange(uint8_t *buf, size_t len, uint64_t seed, const char *what, int round)
{
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    MPI_Win win;
    MPI_Aint *lens = t_malloc(sizeof(MPI_Aint) * (size_t)t_size);
    MPI_Aint mylen = (MPI_Aint)len, rlen;
    uint8_t *got, put[256];
    char w[300];
    size_t putoff;

    T_CHECK_MPI(MPI_Allgather(&mylen, 1, MPI_AINT, lens, 1, MPI_AINT, MPI_COMM_WORLD));
    rlen = lens[right];
    got = t_malloc((size_t)rlen);
    memset(got, 0, (size_t)rlen);
    t_fill(buf, len, seed);
    T_CHECK_MPI(MPI_Win_create(buf, (MPI_Aint)len, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win));
    MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
    t_fill(put, sizeof(put), t_seed(301, (uint64_t)t_rank, (uint64_t)round, (uint64_t)rlen));
    putoff = (size_t)rlen / 3;
    T_CHECK_MPI(MPI_Win_fence(MPI_MODE_NOPRECEDE, win));
    T_CHECK_MPI(MPI_Get(got, (int)rlen, MPI_BYTE, right, 0, (int)rlen, MPI_BYTE, win));
    T_CHECK_MPI(MPI_Win_fence(0, win));
    T_CHECK_MPI(MPI_Put(put, (int)sizeof(put), MPI_BYTE, right, (MPI_Aint)putoff, (int)sizeof(put), MPI_BYTE, win));
    T_CHECK_MPI(MPI_Win_fence(MPI_MODE_NOSUCCEED, win));
    /* what we read from the right neighbour: its current pattern, which we know from the
     * seeds it used (the caller passes the same seed scheme on every rank) */
    {
        uint64_t rseed = seed ^ t_seed((uint64_t)t_rank, 0, 0, 0) ^ t_seed((uint64_t)right, 0, 0, 0);
        snprintf(w, sizeof(w), "%s: MPI_Get of rank %d's window (%zu bytes)", what, right, (size_t)rlen);
        t_check(got, (size_t)rlen, rseed, w);
    }
    {
        uint8_t exp[256];
        t_fill(exp, sizeof(exp), t_seed(301, (uint64_t)left, (uint64_t)round, (uint64_t)lens[t_rank]));
        snprintf(w, sizeof(w), "%s: block MPI_Put by rank %d into this window", what, left);
        t_check_mem(buf + len / 3, exp, sizeof(exp), w);
    }
    T_CHECK_MPI(MPI_Win_free(&win));
    free(got);
    free(lens);
}

/* per-rank seed so that the reader can compute the writer's pattern */
static uint64_t pseed(int phase, int round, size_t len)
{
    return t_seed(300 + (uint64_t)phase, (uint64_t)round, len, 0) ^ t_seed((uint64_t)t_rank, 0, 0, 0);
}

static void remap(size_t len1, size_t len2, int round, int require)
{
    int cls = len2 > len1 ? 1 : 0;
    char what[200];
    uint8_t *a, *b;
    int same, all_same;
    snprintf(what, sizeof(what), "mmap %zu -> munmap -> mmap %zu at the same address, round %d", len1, len2, round);
    t_section("%s", what);
    a = map_at(NULL, len1);
    exchange(a, len1, pseed(1, round, len1), "first mapping (pattern A)", round);
    if (munmap(a, len1) != 0)
        t_fail("munmap: %s", strerror(errno));
    b = map_at(a, len2);
    for (int tries = 0; b != a && tries < 8; tries++) {
        munmap(b, len2);
        b = map_at(a, len2);
    }
    same = b == a;
    if (same)
        reused[cls]++;
    else
        not_reused[cls]++;
    if (!same && require)
        t_fail("%s: the new mapping is at %p, not at the old address %p", what, (void *)b, (void *)a);
    T_CHECK_MPI(MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    exchange(b, len2, pseed(2, round, len2), all_same ? "new mapping at the reused address (pattern B)"
                                                      : "new mapping (address not reused on some rank) (pattern B)",
             round);
    if (munmap(b, len2) != 0)
        t_fail("munmap: %s", strerror(errno));
}

static void via_malloc(size_t len, int round)
{
    uint8_t *a, *b;
    t_section("malloc/free/malloc of %zu bytes, round %d", len, round);
    a = t_malloc(len);
    exchange(a, len, pseed(3, round, len), "first malloc (pattern A)", round);
    free(a);
    b = t_malloc(len);
    if (b == a)
        reused[2]++;
    else
        not_reused[2]++;
    exchange(b, len, pseed(4, round, len), "second malloc (pattern B)", round);
    free(b);
}

static void via_madvise(size_t len, int round)
{
    uint8_t *a = map_at(NULL, len);
    t_section("madvise(MADV_DONTNEED) on %zu bytes, round %d", len, round);
    exchange(a, len, pseed(5, round, len), "before madvise (pattern A)", round);
    if (madvise(a, len, MADV_DONTNEED) != 0)
        t_fail("madvise: %s", strerror(errno));
    exchange(a, len, pseed(6, round, len), "after madvise (pattern C)", round);
    munmap(a, len);
}

int main(int argc, char **argv)
{
    size_t sizes[] = { 4096, 65536, 1 << 20, 8 << 20 };
    int rounds, require;
    t_init(&argc, &argv, "stale");
    rounds = (int)t_opt_long("rounds", NULL, t_quick ? 1 : 3);
    require = t_opt_flag("require-reuse");
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < 4; i++) {
            remap(sizes[i], sizes[i], r, require);
            remap(sizes[i], sizes[i] / 2, r, require);
            remap(sizes[i], sizes[i] * 2, r, 0);
            via_malloc(sizes[i], r);
            via_madvise(sizes[i], r);
        }
    t_info("rank 0: address reused/not reused: mmap same size or smaller %d/%d, mmap larger %d/%d (growing "
           "in place is usually impossible), malloc %d/%d",
           reused[0], not_reused[0], reused[1], not_reused[1], reused[2], not_reused[2]);
    return t_pass();
}
