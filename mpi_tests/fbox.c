/*
 * fbox: messages between ranks of one node through fast boxes (shared-memory rings
 * beside the shm provider, src/common/fbox.rs): the BTL's under pml ob1, the MTL's
 * software matching under pml cm; and larger ones whose data goes through the
 * provider.
 *
 * 1. Flood: every rank sends every other rank --n messages, sizes cycling from 16 to
 *    20,000 bytes (below the eager limit through the boxes only; above it a rendezvous
 *    whose header takes the box and whose data the provider carries), with
 *    MPI_Isend in windows of --window per peer (a tag per window) without waiting for
 *    the receiver: rings fill, and fragments wait for room in order. Receivers take each
 *    window with MPI_Recv from MPI_ANY_SOURCE (every other window from each source by
 *    name), checking every byte and that each source's messages arrive in the order
 *    sent (MPI's non-overtaking rule).
 * 2. Threads (with --threads: MPI_THREAD_MULTIPLE): 4 threads per rank each send
 *    --thread-n messages (default --n / 8) to the right neighbour under their own tag
 *    (MPI_Isend) and receive their tag from the left neighbour in order, with MPI_Recv
 *    and with MPI_Irecv and MPI_Wait in turn. Fast boxes stay on under
 *    MPI_THREAD_MULTIPLE for both components. MPI_T is initialised at the level MPI
 *    provided (t_mpit_init): with MPI_THREAD_SINGLE Open MPI 4.1.4 drops its own thread
 *    level to SINGLE, and ob1's MPI_Recv then completes receives with no message or
 *    another thread's, under btl/vader as under ours (docs/testing.md, "Open MPI
 *    4.1.4's own layers").
 * 3. The MPI_T counters of the component in use (pml cm: mtl_ofi_fbox_sent /
 *    _received, else btl_ofi_fbox_sent / _received): over shm with its fbox_size above
 *    0 both must have moved on every rank; otherwise both stay 0.
 *
 * Options: --n N (default 20000), --window W (default 64), --threads, --thread-n M.
 */
#include "common.h"

#define MAXLEN 20000
#define NTHREADS 4

static int len_of(int seq)
{
    return 16 + (int)(((unsigned)seq * 97u) % (MAXLEN - 15));
}

static uint64_t seed_of(int src, int dst, int tag, int seq)
{
    return t_seed((uint64_t)src, (uint64_t)dst, (uint64_t)tag, (uint64_t)seq);
}

/* A message: its sequence number, then the pattern of (src, dst, tag, seq). */
static void fill(char *buf, int src, int dst, int tag, int seq)
{
    int len = len_of(seq);
    memcpy(buf, &seq, sizeof(seq));
    t_fill(buf + 8, (size_t)len - 8, seed_of(src, dst, tag, seq));
}

static void check(const char *buf, const MPI_Status *st, int dst, int tag, int *next, const char *what)
{
    int src = st->MPI_SOURCE, seq, count;
    char w[160];
    memcpy(&seq, buf, sizeof(seq));
    if (seq != next[src])
        t_fail("%s: from rank %d, message #%d arrived where #%d was due (overtaken)", what, src, seq,
               next[src]);
    T_CHECK_MPI(MPI_Get_count(st, MPI_BYTE, &count));
    if (count != len_of(seq))
        t_fail("%s: message #%d from rank %d has %d bytes, sent %d", what, seq, src, count, len_of(seq));
    if (st->MPI_TAG != tag)
        t_fail("%s: message #%d from rank %d has tag %d, sent %d", what, seq, src, st->MPI_TAG, tag);
    snprintf(w, sizeof(w), "%s: message #%d from rank %d", what, seq, src);
    t_check(buf + 8, (size_t)count - 8, seed_of(src, dst, tag, seq), w);
    next[src]++;
}

static void flood(int n, int window)
{
    int peers = t_size - 1;
    char *sbuf = t_malloc((size_t)peers * window * MAXLEN), *rbuf = t_malloc(MAXLEN);
    MPI_Request *rq = t_malloc(sizeof(*rq) * (size_t)peers * window);
    int *next = calloc((size_t)t_size, sizeof(int));
    for (int base = 0, w = 0; base < n; base += window, w++) {
        /* a tag per window: a receive from MPI_ANY_SOURCE must not take a message of the
         * next window from a peer that is ahead */
        int cnt = n - base < window ? n - base : window, k = 0, tag = 1000 + w;
        t_section("flood: window %d (messages %d to %d)", w, base, base + cnt - 1);
        for (int p = 1; p <= peers; p++) {
            int dst = (t_rank + p) % t_size;
            for (int i = 0; i < cnt; i++, k++) {
                char *b = sbuf + (size_t)k * MAXLEN;
                fill(b, t_rank, dst, tag, base + i);
                T_CHECK_MPI(MPI_Isend(b, len_of(base + i), MPI_BYTE, dst, tag, MPI_COMM_WORLD, &rq[k]));
            }
        }
        for (int p = 1; p <= peers; p++) {
            int src = (t_rank + t_size - p) % t_size;
            for (int i = 0; i < cnt; i++) {
                MPI_Status st;
                t_status_init(&st);
                T_CHECK_MPI(MPI_Recv(rbuf, MAXLEN, MPI_BYTE, w % 2 ? src : MPI_ANY_SOURCE, tag, MPI_COMM_WORLD,
                                     &st));
                check(rbuf, &st, t_rank, tag, next, "flood");
            }
        }
        T_CHECK_MPI(MPI_Waitall(k, rq, MPI_STATUSES_IGNORE));
    }
    for (int s = 0; s < t_size; s++)
        if (s != t_rank && next[s] != n)
            t_fail("flood: %d messages from rank %d, sent %d", next[s], s, n);
    free(sbuf);
    free(rbuf);
    free(rq);
    free(next);
}

struct thread_arg {
    int tag, n;
};

static void *thread_main(void *p)
{
    struct thread_arg *a = p;
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    char *sbuf = t_malloc(MAXLEN), *rbuf = t_malloc(MAXLEN);
    int *next = calloc((size_t)t_size, sizeof(int));
    for (int i = 0; i < a->n; i++) {
        MPI_Request r;
        MPI_Status st;
        fill(sbuf, t_rank, right, a->tag, i);
        T_CHECK_MPI(MPI_Isend(sbuf, len_of(i), MPI_BYTE, right, a->tag, MPI_COMM_WORLD, &r));
        t_status_init(&st);
        if (i % 2 == 0) {
            T_CHECK_MPI(MPI_Recv(rbuf, MAXLEN, MPI_BYTE, left, a->tag, MPI_COMM_WORLD, &st));
        } else {
            MPI_Request rr;
            T_CHECK_MPI(MPI_Irecv(rbuf, MAXLEN, MPI_BYTE, left, a->tag, MPI_COMM_WORLD, &rr));
            T_CHECK_MPI(MPI_Wait(&rr, &st));
        }
        check(rbuf, &st, t_rank, a->tag, next, "threads");
        T_CHECK_MPI(MPI_Wait(&r, MPI_STATUS_IGNORE));
        t_touch();
    }
    free(sbuf);
    free(rbuf);
    free(next);
    return NULL;
}

/* Whether the "pml" control variable says cm (the tests always name the PML). */
static int pml_is_cm(void)
{
    int idx, cnt;
    char v[4096] = "";
    MPI_T_cvar_handle h;
    if (MPI_T_cvar_get_index("pml", &idx) != MPI_SUCCESS || MPI_T_cvar_handle_alloc(idx, NULL, &h, &cnt) != MPI_SUCCESS)
        return 0;
    if (cnt < (int)sizeof(v) && MPI_T_cvar_read(h, v) != MPI_SUCCESS)
        v[0] = 0;
    MPI_T_cvar_handle_free(&h);
    return strcmp(v, "cm") == 0;
}

static long long cvar_int(const char *name, long long def)
{
    int idx, cnt;
    long long v = def;
    MPI_T_cvar_handle h;
    if (MPI_T_cvar_get_index(name, &idx) != MPI_SUCCESS || MPI_T_cvar_handle_alloc(idx, NULL, &h, &cnt) != MPI_SUCCESS)
        return def;
    {
        int iv = 0;
        if (MPI_T_cvar_read(h, &iv) == MPI_SUCCESS)
            v = iv;
    }
    MPI_T_cvar_handle_free(&h);
    return v;
}

int main(int argc, char **argv)
{
    static const char *const btl_names[] = { "btl_ofi_fbox_sent", "btl_ofi_fbox_received" };
    static const char *const mtl_names[] = { "mtl_ofi_fbox_sent", "mtl_ofi_fbox_received" };
    unsigned long long v[2] = { 0, 0 };
    t_pvars_t pv;
    int n, window, provided, tprov, have, threads, mtl, thread_n;
    long long size;
    const char *comp;

    threads = 0;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--threads") == 0)
            threads = 1;
    provided = t_init_thread(&argc, &argv, "fbox", threads ? MPI_THREAD_MULTIPLE : MPI_THREAD_SINGLE);
    n = (int)t_opt_long("n", NULL, 20000);
    window = (int)t_opt_long("window", NULL, 64);
    thread_n = (int)t_opt_long("thread-n", NULL, n / (2 * NTHREADS));
    T_CHECK_MPI(t_mpit_init(&tprov));
    {
        int level = -1;
        T_CHECK_MPI(MPI_Query_thread(&level));
        if (level != provided)
            t_fail("after MPI_T_init_thread, MPI_Query_thread says %d where MPI_Init_thread provided %d", level,
                   provided);
    }
    mtl = pml_is_cm();
    comp = mtl ? "mtl" : "btl";
    have = t_pvars_open(&pv, mtl ? mtl_names : btl_names, 2);
    size = cvar_int(mtl ? "mtl_ofi_fbox_size" : "btl_ofi_fbox_size", -1);
    if (t_size < 2) {
        t_info("one rank: nothing to send");
    } else {
        flood(n, window);
        if (threads && provided == MPI_THREAD_MULTIPLE) {
            pthread_t th[NTHREADS];
            struct thread_arg a[NTHREADS];
            t_section("threads: %d threads, %d messages each", NTHREADS, thread_n);
            for (int i = 0; i < NTHREADS; i++) {
                a[i].tag = 100 + i;
                a[i].n = thread_n;
                if (pthread_create(&th[i], NULL, thread_main, &a[i]) != 0)
                    t_fail("pthread_create failed");
            }
            for (int i = 0; i < NTHREADS; i++)
                pthread_join(th[i], NULL);
        } else if (threads) {
            t_fail("--threads: MPI_THREAD_MULTIPLE not provided (%d)", provided);
        }
    }
    t_section("counters");
    if (have) {
        int shm = strcmp(t_provider(), "shm") == 0;
        int on = shm && size > 0;
        t_pvars_read(&pv, v);
        if (t_verbose || t_rank == 0)
            t_info("rank %d: %s_ofi_fbox_size %lld, sent %llu and received %llu through fast boxes", t_rank, comp,
                   size, v[0], v[1]);
        if (t_size > 1 && on && (v[0] == 0 || v[1] == 0))
            t_fail("over shm with %s_ofi_fbox_size %lld%s: %llu sent and %llu received through fast boxes, "
                   "expected some",
                   comp, size, threads ? ", MPI_THREAD_MULTIPLE" : "", v[0], v[1]);
        if (!on && (v[0] != 0 || v[1] != 0))
            t_fail("provider %s, %s_ofi_fbox_size %lld%s: %llu sent and %llu received through fast boxes, "
                   "expected none",
                   t_provider(), comp, size, threads ? ", MPI_THREAD_MULTIPLE" : "", v[0], v[1]);
        t_pvars_close(&pv);
    } else {
        t_info("no MPI_T variables %s_ofi_fbox_*: our %s is not loaded; counters not checked", comp,
               mtl ? "MTL" : "BTL");
    }
    T_CHECK_MPI(MPI_T_finalize());
    return t_pass();
}
