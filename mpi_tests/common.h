/*
 * Shared helpers for the ompi-ofi MPI test programs.
 *
 * Every program includes this header once (it is a single translation unit per
 * program, so the helpers are `static`). It provides:
 *   - start-up/finish (t_init / t_pass) and option parsing (argv and env),
 *   - deterministic fill patterns and byte checks that report the first wrong byte,
 *   - status checks (MPI_SOURCE, MPI_TAG, MPI_ERROR, MPI_Get_count),
 *   - a failure path that prints one line naming program, provider, rank and sub-test
 *     and then calls MPI_Abort.
 *
 * Failure line format (the runner and humans grep for it):
 *   FAIL prog=<p> provider=<OMPI_OFI_TEST_PROVIDER> rank=<r>/<np> test=[<section>]: <what>
 * Byte mismatches read:
 *   ...: <what>: byte <index> of <len>: expected 0x<xx> got 0x<yy>
 */
#ifndef OMPI_OFI_MPI_TESTS_COMMON_H
#define OMPI_OFI_MPI_TESTS_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <mpi.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#define T_UNUSED __attribute__((unused))

static const char *t_prog = "?";
static int t_rank = -1, t_size = 0;
static char t_where[512] = "init";
static int t_verbose = 0;
static int t_quick = 0;
static int t_argc = 0;
static char **t_argv = NULL;

/* Value stored in status fields before a call so we can see what the call wrote. */
#define T_ERR_SENTINEL 0x7e57
#define T_SRC_SENTINEL (-0x7e57)
#define T_TAG_SENTINEL (-0x7e58)

static T_UNUSED const char *t_provider(void)
{
    const char *p = getenv("OMPI_OFI_TEST_PROVIDER");
    return (p && *p) ? p : "none";
}

static T_UNUSED double t_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static T_UNUSED void t_sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

__attribute__((format(printf, 1, 2), noreturn)) static T_UNUSED void t_fail(const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stdout, "FAIL prog=%s provider=%s rank=%d/%d test=[%s]: %s\n", t_prog, t_provider(),
            t_rank, t_size, t_where, msg);
    fflush(stdout);
    fflush(stderr);
    /* Give mpirun's I/O forwarding a moment to ship the line before the abort kills us. */
    t_sleep_ms(300);
    MPI_Abort(MPI_COMM_WORLD, 1);
    _exit(1);
}

static volatile unsigned long t_progress; /* bumped by t_section / t_touch */

/* Tell the watchdog that a long-running section is still making progress. */
static T_UNUSED void t_touch(void)
{
    __atomic_add_fetch(&t_progress, 1, __ATOMIC_RELAXED);
}

/* Name the current sub-test; it appears in any FAIL line. */
__attribute__((format(printf, 1, 2))) static T_UNUSED void t_section(const char *fmt, ...)
{
    va_list ap;
    t_touch();
    va_start(ap, fmt);
    vsnprintf(t_where, sizeof(t_where), fmt, ap);
    va_end(ap);
    if (t_verbose > 1 || (t_verbose && t_rank == 0)) {
        fprintf(stdout, "[%s rank %d] %s\n", t_prog, t_rank, t_where);
        fflush(stdout);
    }
}

/* Print from rank 0 only (informational lines that the runner shows). */
__attribute__((format(printf, 1, 2))) static T_UNUSED void t_info(const char *fmt, ...)
{
    if (t_rank != 0)
        return;
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stdout, "INFO prog=%s provider=%s np=%d: %s\n", t_prog, t_provider(), t_size, msg);
    fflush(stdout);
}

static T_UNUSED const char *t_errstr(int rc)
{
    static char buf[MPI_MAX_ERROR_STRING + 64];
    char s[MPI_MAX_ERROR_STRING];
    int len = 0, cls = -1;
    s[0] = 0;
    MPI_Error_class(rc, &cls);
    MPI_Error_string(rc, s, &len);
    snprintf(buf, sizeof(buf), "rc=%d class=%d (%s)", rc, cls, s);
    return buf;
}

#define T_CHECK_MPI(call)                                                                   \
    do {                                                                                    \
        int t_rc_ = (call);                                                                 \
        if (t_rc_ != MPI_SUCCESS)                                                           \
            t_fail("%s:%d: %s returned %s", __FILE__, __LINE__, #call, t_errstr(t_rc_));   \
    } while (0)

#define T_ASSERT(cond, ...)                                                                 \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            char t_m_[1024];                                                                \
            snprintf(t_m_, sizeof(t_m_), __VA_ARGS__);                                      \
            t_fail("%s:%d: assertion '%s' failed: %s", __FILE__, __LINE__, #cond, t_m_);   \
        }                                                                                   \
    } while (0)

/* ---------- options ---------- */

/* Finds "--name value" or "--name=value" in argv; returns NULL when absent. */
static T_UNUSED const char *t_opt_str(const char *name, const char *def)
{
    size_t n = strlen(name);
    for (int i = 1; i < t_argc; i++) {
        const char *a = t_argv[i];
        if (strncmp(a, "--", 2) != 0 || strncmp(a + 2, name, n) != 0)
            continue;
        if (a[2 + n] == '=')
            return a + 3 + n;
        if (a[2 + n] == 0 && i + 1 < t_argc)
            return t_argv[i + 1];
    }
    return def;
}

static T_UNUSED int t_opt_flag(const char *name)
{
    for (int i = 1; i < t_argc; i++)
        if (strncmp(t_argv[i], "--", 2) == 0 && strcmp(t_argv[i] + 2, name) == 0)
            return 1;
    return 0;
}

/* Parses "123", "64K", "4M", "1G" (binary units). Returns -1 on garbage. */
static T_UNUSED long long t_parse_size(const char *s)
{
    char *end = NULL;
    long long v = strtoll(s, &end, 0);
    if (end == s)
        return -1;
    switch (*end) {
    case 'k': case 'K': v <<= 10; end++; break;
    case 'm': case 'M': v <<= 20; end++; break;
    case 'g': case 'G': v <<= 30; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'B')
        end++;
    return *end ? -1 : v;
}

/* argv "--name N" wins over env var `env` (may be NULL) which wins over def. */
static T_UNUSED long long t_opt_long(const char *name, const char *env, long long def)
{
    const char *s = t_opt_str(name, NULL);
    if (!s && env)
        s = getenv(env);
    if (!s || !*s)
        return def;
    long long v = t_parse_size(s);
    if (v < 0)
        t_fail("bad value '%s' for --%s", s, name);
    return v;
}

static T_UNUSED size_t t_inject(void)
{
    return (size_t)t_opt_long("inject", "OMPI_OFI_TEST_INJECT", 64);
}

/*
 * Message size list. Default: 0,1,inject-1,inject,inject+1,64K,4M (+64M with --big).
 * Override with --sizes LIST or env OMPI_OFI_TEST_SIZES; items are numbers with
 * optional K/M/G suffix or the words inject, inject-1, inject+1. Duplicates are dropped.
 */
static T_UNUSED int t_sizes_def(size_t *out, int max, const char *defspec)
{
    const char *spec = t_opt_str("sizes", getenv("OMPI_OFI_TEST_SIZES"));
    char buf[1024];
    size_t inj = t_inject();
    int n = 0;
    if (!spec || !*spec)
        spec = defspec;
    snprintf(buf, sizeof(buf), "%s", spec);
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        long long v;
        if (strcmp(tok, "inject") == 0)
            v = (long long)inj;
        else if (strcmp(tok, "inject-1") == 0)
            v = inj ? (long long)inj - 1 : 0;
        else if (strcmp(tok, "inject+1") == 0)
            v = (long long)inj + 1;
        else
            v = t_parse_size(tok);
        if (v < 0)
            t_fail("bad size '%s' in size list '%s'", tok, spec);
        int dup = 0;
        for (int i = 0; i < n; i++)
            dup |= out[i] == (size_t)v;
        if (!dup && n < max)
            out[n++] = (size_t)v;
    }
    return n;
}

/* The default sizes; 8064 and 8065 straddle the largest eager message of the MTL's
 * software matching on shm (two injects of 4096 bytes less their 64-byte headers). */
static T_UNUSED int t_sizes(size_t *out, int max)
{
    return t_sizes_def(out, max,
                       t_opt_flag("big")
                           ? "0,1,inject-1,inject,inject+1,8064,8065,8193,64K,65537,4M,64M"
                           : "0,1,inject-1,inject,inject+1,8064,8065,8193,64K,65537,4M");
}

/* ---------- memory and patterns ---------- */

static T_UNUSED void *t_malloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        t_fail("malloc(%zu) failed", n);
    return p;
}

static inline uint64_t t_mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* Combines small integers into a pattern seed; distinct tuples give distinct patterns. */
static T_UNUSED uint64_t t_seed(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return t_mix(t_mix(t_mix(t_mix(a + 0x1234567) ^ b) ^ c) ^ d);
}

static inline uint64_t t_word(uint64_t seed, size_t w)
{
    return t_mix(seed + 0x9e3779b97f4a7c15ull * (uint64_t)(w + 1));
}

/* Byte i of pattern `seed`. */
static inline uint8_t t_pat(uint64_t seed, size_t i)
{
    return (uint8_t)(t_word(seed, i / 8) >> (8 * (i % 8)));
}

static T_UNUSED void t_fill(void *buf, size_t n, uint64_t seed)
{
    uint8_t *b = buf;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = t_word(seed, i / 8);
        memcpy(b + i, &w, 8); /* little-endian host: byte k of w is t_pat(seed, i+k) */
    }
    for (; i < n; i++)
        b[i] = t_pat(seed, i);
}

/*
 * Self-test of the checkers: with OMPI_OFI_TEST_CORRUPT=1 the last rank flips one byte
 * in the middle of every non-empty buffer it checks, so the program must FAIL with a
 * first-wrong-byte line. (The runner's --selftest uses it.)
 */
static T_UNUSED void t_maybe_corrupt(const void *buf, size_t n)
{
    static int on = -1;
    if (on < 0)
        on = getenv("OMPI_OFI_TEST_CORRUPT") && atoi(getenv("OMPI_OFI_TEST_CORRUPT")) != 0;
    if (on && n && t_rank == t_size - 1)
        ((uint8_t *)(uintptr_t)buf)[n / 2] ^= 0x40;
}

static T_UNUSED void t_check(const void *buf, size_t n, uint64_t seed, const char *what)
{
    const uint8_t *b = buf;
    size_t i = 0;
    t_maybe_corrupt(buf, n);
    for (; i + 8 <= n; i += 8) {
        uint64_t w = t_word(seed, i / 8), g;
        memcpy(&g, b + i, 8);
        if (g != w)
            break;
    }
    for (; i < n; i++)
        if (b[i] != t_pat(seed, i))
            t_fail("%s: byte %zu of %zu: expected 0x%02x got 0x%02x", what, i, n, t_pat(seed, i), b[i]);
}

/* Compare against an expected buffer (for derived-datatype oracles). */
static T_UNUSED void t_check_mem(const void *got, const void *exp, size_t n, const char *what)
{
    const uint8_t *g = got, *e = exp;
    t_maybe_corrupt(got, n);
    if (memcmp(g, e, n) == 0)
        return;
    for (size_t i = 0; i < n; i++)
        if (g[i] != e[i])
            t_fail("%s: byte %zu of %zu: expected 0x%02x got 0x%02x", what, i, n, e[i], g[i]);
}

/* Every byte equals v (guard areas). */
static T_UNUSED void t_check_const(const void *buf, size_t n, uint8_t v, const char *what)
{
    const uint8_t *b = buf;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v)
            t_fail("%s: byte %zu of %zu: expected 0x%02x got 0x%02x", what, i, n, v, b[i]);
}

/* ---------- statuses ---------- */

static T_UNUSED void t_status_init(MPI_Status *st)
{
    memset(st, 0x5a, sizeof(*st));
    st->MPI_SOURCE = T_SRC_SENTINEL;
    st->MPI_TAG = T_TAG_SENTINEL;
    st->MPI_ERROR = T_ERR_SENTINEL;
}

static T_UNUSED void t_status_init_n(MPI_Status *st, int n)
{
    for (int i = 0; i < n; i++)
        t_status_init(&st[i]);
}

/*
 * Checks source, tag, MPI_Get_count(type) == count, and MPI_ERROR. For a successful
 * operation MPI_ERROR may be left untouched (single-completion calls, or multi-completion
 * calls that returned MPI_SUCCESS) or set to MPI_SUCCESS; anything else is wrong.
 * count < 0 means MPI_UNDEFINED is expected.
 */
static T_UNUSED void t_check_status(const MPI_Status *st, int src, int tag, MPI_Datatype type, int count,
                                    const char *what)
{
    int c = -12345;
    if (st->MPI_SOURCE != src)
        t_fail("%s: status.MPI_SOURCE expected %d got %d", what, src, st->MPI_SOURCE);
    if (st->MPI_TAG != tag)
        t_fail("%s: status.MPI_TAG expected %d got %d", what, tag, st->MPI_TAG);
    if (st->MPI_ERROR != MPI_SUCCESS && st->MPI_ERROR != T_ERR_SENTINEL)
        t_fail("%s: status.MPI_ERROR expected MPI_SUCCESS (or untouched) got %s", what,
               t_errstr(st->MPI_ERROR));
    T_CHECK_MPI(MPI_Get_count(st, type, &c));
    if (count < 0 ? c != MPI_UNDEFINED : c != count)
        t_fail("%s: MPI_Get_count expected %d got %d", what, count < 0 ? MPI_UNDEFINED : count, c);
}

static T_UNUSED void t_check_status_bytes(const MPI_Status *st, int src, int tag, size_t bytes, const char *what)
{
    t_check_status(st, src, tag, MPI_BYTE, (int)bytes, what);
}

/* Status of a receive from MPI_PROC_NULL. */
static T_UNUSED void t_check_status_procnull(const MPI_Status *st, const char *what)
{
    t_check_status(st, MPI_PROC_NULL, MPI_ANY_TAG, MPI_BYTE, 0, what);
}

/* ---------- start and finish ---------- */

/*
 * Watchdog: when no t_section/t_touch happened for OMPI_OFI_TEST_WATCHDOG seconds
 * (default 300; 0 disables; the runner sets it below its own timeout), print a FAIL line
 * naming the section that hangs and exit. It makes no MPI call (the main thread may be
 * stuck inside MPI); mpirun then tears the job down.
 */
static void *t_watchdog(void *arg)
{
    double limit = *(double *)arg, since = t_now();
    unsigned long last = t_progress;
    for (;;) {
        t_sleep_ms(500);
        if (t_progress != last) {
            last = t_progress;
            since = t_now();
        } else if (t_now() - since > limit) {
            char where[sizeof(t_where)];
            memcpy(where, t_where, sizeof(where));
            where[sizeof(where) - 1] = 0;
            fprintf(stdout, "FAIL prog=%s provider=%s rank=%d/%d test=[%s]: no progress for %.0f s (hang)\n", t_prog,
                    t_provider(), t_rank, t_size, where, limit);
            fflush(stdout);
            t_sleep_ms(300);
            _exit(3);
        }
    }
    return NULL;
}

static void t_start_watchdog(void)
{
    static double limit;
    pthread_t th;
    const char *e = getenv("OMPI_OFI_TEST_WATCHDOG");
    limit = e ? atof(e) : 300;
    if (limit <= 0)
        return;
    if (pthread_create(&th, NULL, t_watchdog, &limit) == 0)
        pthread_detach(th);
}

static T_UNUSED int t_init_thread(int *argc, char ***argv, const char *prog, int required)
{
    int provided = MPI_THREAD_SINGLE;
    t_prog = prog;
    t_argc = *argc;
    t_argv = *argv;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (required == MPI_THREAD_SINGLE)
        T_CHECK_MPI(MPI_Init(argc, argv));
    else
        T_CHECK_MPI(MPI_Init_thread(argc, argv, required, &provided));
    MPI_Comm_rank(MPI_COMM_WORLD, &t_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &t_size);
    t_argc = *argc;
    t_argv = *argv;
    t_start_watchdog();
    t_quick = t_opt_flag("quick") || (getenv("OMPI_OFI_TEST_QUICK") && atoi(getenv("OMPI_OFI_TEST_QUICK")));
    t_verbose = (int)t_opt_long("verbose", "OMPI_OFI_TEST_VERBOSE", 0);
    if (t_opt_flag("v"))
        t_verbose = 1;
    /* Errors return so that T_CHECK_MPI can print a FAIL line naming the sub-test and then
     * abort; every call in the programs is checked. Communicators duplicated from
     * MPI_COMM_WORLD inherit this. */
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    return provided;
}

static T_UNUSED void t_init(int *argc, char ***argv, const char *prog)
{
    t_init_thread(argc, argv, prog, MPI_THREAD_SINGLE);
}

static T_UNUSED int t_pass(void)
{
    t_section("finish");
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    if (t_rank == 0) {
        fprintf(stdout, "PASS prog=%s provider=%s np=%d\n", t_prog, t_provider(), t_size);
        fflush(stdout);
    }
    T_CHECK_MPI(MPI_Finalize());
    return 0;
}

/* True when every rank runs on this host (timing checks that compare clocks need it). */
static T_UNUSED int t_all_local(void)
{
    char name[MPI_MAX_PROCESSOR_NAME] = { 0 }, *all;
    int len, same = 1;
    MPI_Get_processor_name(name, &len);
    all = t_malloc((size_t)t_size * MPI_MAX_PROCESSOR_NAME);
    MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all, MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                  MPI_COMM_WORLD);
    for (int i = 0; i < t_size; i++)
        same &= strcmp(all + (size_t)i * MPI_MAX_PROCESSOR_NAME, name) == 0;
    free(all);
    return same;
}

/* ---------- MPI_T performance variables (our BTL's counters, src/btl/stats.rs) ---------- */

#define T_PVARS_MAX 8
typedef struct {
    int n;
    MPI_T_pvar_session session;
    MPI_T_pvar_handle h[T_PVARS_MAX];
} t_pvars_t;

/*
 * MPI_T_init_thread at the thread level MPI_Init_thread provided. Open MPI 4.1.4's first
 * MPI_T_init_thread sets the MPI library's own thread level to the one it is asked for
 * (ompi_mpi_thread_level), even after MPI_Init_thread: asked for MPI_THREAD_SINGLE in a
 * program running MPI_THREAD_MULTIPLE, MPI_Query_thread then says SINGLE and ob1's
 * blocking MPI_Recv shares one cached request among threads, so receives complete with
 * no message or another thread's (mpi_tests/repro/ob1_recv_threads.c; docs/testing.md,
 * "Open MPI 4.1.4's own layers").
 */
static T_UNUSED int t_mpit_init(int *provided)
{
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return MPI_T_init_thread(level, provided);
}

/*
 * Binds the performance variables `names` (full names, e.g. "btl_ofi_rcache_hits") in a
 * session of their own: from here on a counter reads the events since this call, a level
 * its current value. Call after t_mpit_init (MPI_T_init_thread). Returns 1 when all are
 * bound, 0 (and binds nothing) when one does not exist, i.e. our BTL is not loaded.
 */
static T_UNUSED int t_pvars_open(t_pvars_t *p, const char *const *names, int n)
{
    int idx[T_PVARS_MAX];
    memset(p, 0, sizeof(*p));
    T_ASSERT(n <= T_PVARS_MAX, "%d MPI_T variables asked for, at most %d", n, T_PVARS_MAX);
    for (int i = 0; i < n; i++)
        if (MPI_T_pvar_get_index(names[i], MPI_T_PVAR_CLASS_COUNTER, &idx[i]) != MPI_SUCCESS &&
            MPI_T_pvar_get_index(names[i], MPI_T_PVAR_CLASS_LEVEL, &idx[i]) != MPI_SUCCESS)
            return 0;
    T_CHECK_MPI(MPI_T_pvar_session_create(&p->session));
    for (int i = 0; i < n; i++) {
        int count = 0;
        T_CHECK_MPI(MPI_T_pvar_handle_alloc(p->session, idx[i], NULL, &p->h[i], &count));
        T_ASSERT(count == 1, "MPI_T variable %s has %d values, expected 1", names[i], count);
    }
    p->n = n;
    return 1;
}

/* Reads every bound variable into v[0..n). */
static T_UNUSED void t_pvars_read(t_pvars_t *p, unsigned long long *v)
{
    for (int i = 0; i < p->n; i++)
        T_CHECK_MPI(MPI_T_pvar_read(p->session, p->h[i], &v[i]));
}

static T_UNUSED void t_pvars_close(t_pvars_t *p)
{
    if (p->n > 0)
        T_CHECK_MPI(MPI_T_pvar_session_free(&p->session));
    p->n = 0;
}

#endif
