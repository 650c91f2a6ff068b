/*
 * atomics: the atomic half of onesided.c (MPI_Get_accumulate, MPI_Fetch_and_op,
 * MPI_Compare_and_swap on every window kind and synchronisation mode; see there), then
 * the part "btl" below (--ops btl; in the default set): every operation osc rdma can
 * give to a BTL's atomics, on MPI_INT32_T, MPI_INT and MPI_INT64_T, from every rank to
 * the same words of every rank at once, each result checked exactly, and, where our
 * BTL is loaded, proof through MPI_T (btl_ofi_rdma_*) that its atomics did the work.
 *
 * What Open MPI 4.1.4's osc rdma gives to the BTL (ompi/mca/osc/rdma):
 *   - MPI_Accumulate, MPI_Get_accumulate and MPI_Fetch_and_op on a predefined integer
 *     type of 4 or 8 bytes, up to osc_rdma_network_amo_max_count (32) elements, with
 *     SUM, BAND, BOR, BXOR, LAND, LOR, LXOR, MIN, MAX or REPLACE
 *     (osc_rdma_accumulate.c, ompi_osc_rdma_op_mapping): one btl_atomic_fop per
 *     element, also for MPI_Accumulate: ompi_osc_rdma_gacc_amo allocates a scratch
 *     result when the caller has none, so its branch to btl_atomic_op
 *     (ompi_osc_rdma_acc_single_atomic) is never taken. MPI_NO_OP has no mapping: a get.
 *   - MPI_Compare_and_swap on 8 bytes: btl_atomic_cswap. On 4 bytes
 *     ompi_osc_rdma_cas_atomic looks for MCA_BTL_ATOMIC_SUPPORTS_32BIT in btl_flags
 *     instead of btl_atomic_flags, so it is a get and a put under the accumulate lock.
 *   - Only towards memory this process cannot reach itself: on one node osc rdma puts
 *     MPI_Win_allocate memory and the window state (its locks) in shared memory and
 *     uses CPU atomics there, so only MPI_Win_create and dynamic windows of other ranks
 *     go through the BTL (this part uses those). btl_atomic_op is left to lock releases
 *     and PSCW completion between nodes (osc_rdma_lock.h, osc_rdma_active_target.c).
 *   - Nothing is to be set for it: osc_rdma_acc_use_amo is on by default, and
 *     osc_rdma_acc_single_intrinsic (or the window info key of that name) only decides
 *     whether compare-and-swap takes the accumulate lock, which it does not anyway with
 *     the default accumulate_ops same_op_no_op.
 *
 * The checks: for the fetching operations, the fetched values of all origins must be
 * the states of one sequence of the operations applied one after the other from the
 * initial value and ending at the final one (operands chosen so that no state comes
 * back: SUM adds positive numbers, BAND/BOR/BXOR clear or set a bit of their own, MIN
 * and MAX get distinct values of both signs, REPLACE distinct values; LXOR, which does
 * come back, by counting); for MPI_Accumulate the final value; MPI_NO_OP must return
 * the word; compare-and-swap: all origins race for one word (one winner) and count
 * another up with compare-and-swap loops (exactly K increments each); then every rank
 * reads its neighbour's words back with MPI_NO_OP.
 *
 * The BTL's counters (MPI_T performance variables btl_ofi_rdma_*), read after the
 * window's creation and after MPI_Win_free, must have grown by at least the operations
 * this rank sent to other ranks: fetching atomics plus atomics >= the elements of the
 * mapped operations, compare-and-swaps >= the 8-byte compare-and-swaps. They are
 * required when OMPI_OFI_TEST_PROVIDER names an OFI provider (the btl lane; it is
 * "vader" in the ob1 lane, where they are not looked for); --no-btl-counters skips them.
 */
#define ONESIDED_ATOMICS 1
#define ONESIDED_EXTRA btl_part
static void btl_part(void);
#include "onesided.c"

/* the operations, in the order of the slots */
enum { O_SUM, O_BAND, O_BOR, O_BXOR, O_MIN, O_MAX, O_REPLACE, O_LAND, O_LOR, O_LXOR, NOPS };
static const char *op_name[NOPS] = { "SUM", "BAND", "BOR", "BXOR", "MIN", "MAX", "REPLACE", "LAND", "LOR", "LXOR" };
static MPI_Op op_of(int i)
{
    const MPI_Op ops[NOPS] = { MPI_SUM, MPI_BAND, MPI_BOR, MPI_BXOR, MPI_MIN,
                               MPI_MAX, MPI_REPLACE, MPI_LAND, MPI_LOR, MPI_LXOR };
    return ops[i];
}

/* 8-byte slots of one type's block: MPI_Accumulate targets, MPI_Fetch_and_op targets,
 * the MPI_NO_OP word, the MPI_Get_accumulate vector (NVEC elements of the type), the
 * compare-and-swap race and counter */
#define NVEC 4
enum { S_ACC = 0, S_FOP = NOPS, S_NOOP = 2 * NOPS, S_VEC, S_RACE = S_VEC + NVEC, S_COUNT, NSLOT };
#define NTYPES 3
static const char *type_name[NTYPES] = { "MPI_INT32_T", "MPI_INT", "MPI_INT64_T" };
static MPI_Datatype type_of(int ti)
{
    return ti == 0 ? MPI_INT32_T : ti == 1 ? MPI_INT : MPI_INT64_T;
}
static int width_of(int ti)
{
    return ti == 2 ? 8 : 4;
}

static size_t slot_off(int ti, int s)
{
    return ((size_t)ti * NSLOT + (size_t)s) * 8;
}

static int64_t trunc_w(int64_t v, int w)
{
    return w == 4 ? (int64_t)(int32_t)(uint32_t)(uint64_t)v : v;
}

static int64_t ld(const void *p, int w)
{
    return w == 4 ? (int64_t) * (const int32_t *)p : *(const int64_t *)p;
}

static void st(void *p, int w, int64_t v)
{
    if (w == 4)
        *(int32_t *)p = (int32_t)trunc_w(v, 4);
    else
        *(int64_t *)p = v;
}

/* what the target does, as MPI defines it for C integers */
static int64_t apply_op(int i, int64_t a, int64_t b, int w)
{
    int64_t r;
    switch (i) {
    case O_SUM: r = (int64_t)((uint64_t)a + (uint64_t)b); break;
    case O_BAND: r = a & b; break;
    case O_BOR: r = a | b; break;
    case O_BXOR: r = a ^ b; break;
    case O_MIN: r = a < b ? a : b; break;
    case O_MAX: r = a > b ? a : b; break;
    case O_REPLACE: r = b; break;
    case O_LAND: r = a && b; break;
    case O_LOR: r = a || b; break;
    default: r = !a != !b; break;
    }
    return trunc_w(r, w);
}

static int64_t big(int w) /* scales the values so that 8-byte ones use the high half */
{
    return w == 8 ? 0x100000001LL : 65537;
}

/* initial value of operation i's words */
static int64_t init_of(int i, int w)
{
    switch (i) {
    case O_SUM: return w == 8 ? 1LL << 40 : 1000;
    case O_BAND: return -1;
    case O_MIN: return w == 8 ? 1LL << 61 : 1 << 30;
    case O_MAX: return w == 8 ? -(1LL << 61) : -(1 << 30);
    case O_REPLACE: return w == 8 ? -12345 - (1LL << 50) : -12345;
    case O_LAND: return 3;
    default: return 0; /* BOR, BXOR, LOR, LXOR */
    }
}

/* operand of the g-th operation (g = origin * K + round) of nk, on operation i's words */
static int64_t operand_of(int i, int g, int nk, int w)
{
    int64_t bit = trunc_w((int64_t)(1ULL << ((g * 5) % (8 * w))), w); /* distinct for g < 8 * w */
    switch (i) {
    case O_SUM: return trunc_w((int64_t)(g + 1) * (w == 8 ? big(8) : 1), w);
    case O_BAND: return trunc_w(~bit, w);
    case O_BOR:
    case O_BXOR: return bit;
    case O_MIN:
    case O_MAX: return ((g & 1) ? -1 : 1) * (int64_t)(g + 1) * big(w);
    case O_REPLACE: return (int64_t)(g + 1) * big(w) + 7;
    case O_LAND: return g == nk / 2 ? 0 : g + 2;
    case O_LOR: return g == nk / 2 ? 9 : 0;
    default: return g % 3 == 0 ? 0 : 5; /* LXOR */
    }
}

static int64_t vec_init(int e, int w)
{
    return (w == 8 ? 1LL << 41 : 2000) + e;
}

static int64_t vec_operand(int g, int e, int w)
{
    return trunc_w((int64_t)(g + 1) * (e + 1) * (w == 8 ? big(8) : 1), w);
}

static int64_t noop_word(int t, int w)
{
    return trunc_w(0x123456789abLL + 1000 * t, w);
}

static int64_t race_init(int w)
{
    return w == 8 ? -7 - (1LL << 45) : -7;
}

static int64_t race_value(int o, int w)
{
    return (o + 1) + (w == 8 ? 1LL << 44 : 0);
}

static int64_t count_init(int w)
{
    return w == 8 ? 100 + (1LL << 36) : 100;
}

/*
 * Is there an order of the n operations (operands v, fetched values f) that, applied
 * one after the other from init, has each fetch the state before it and ends at fin?
 * For operations whose states never come back: the operations that fetched the
 * current state come one after the other, and only the last of them may change it.
 * Returns NULL, or what is wrong (in why).
 */
static const char *walk(int i, int w, int64_t init, const int64_t *v, const int64_t *f, int n, int64_t fin,
                        char *why, size_t len)
{
    char *used = t_malloc((size_t)n + 1);
    int left = n;
    int64_t cur = init;
    const char *res = NULL;
    memset(used, 0, (size_t)n + 1);
    while (left > 0) {
        int same = 0, changers = 0, ch = -1;
        for (int j = 0; j < n; j++)
            if (!used[j] && f[j] == cur) {
                used[j] = 1;
                left--;
                same++;
                if (apply_op(i, cur, v[j], w) != cur) {
                    changers++;
                    ch = j;
                }
            }
        if (changers > 1) {
            snprintf(why, len, "%d operations fetched 0x%llx and each would change it: no order of the operations gives these "
                     "values (not atomic, or a wrong operation)", changers,
                     (unsigned long long)cur);
            res = why;
            break;
        }
        if (!changers) {
            if (left > 0) {
                int j = 0;
                while (used[j])
                    j++;
                snprintf(why, len,
                         "%d operations fetched values the word never held in any order of the operations "
                         "(e.g. 0x%llx; it stays 0x%llx)",
                         left, (unsigned long long)f[j], (unsigned long long)cur);
                res = why;
            }
            break;
        }
        cur = apply_op(i, cur, v[ch], w);
    }
    if (!res && cur != fin) {
        snprintf(why, len, "final value 0x%llx, but the fetched values lead to 0x%llx", (unsigned long long)fin,
                 (unsigned long long)cur);
        res = why;
    }
    free(used);
    return res;
}

/* LXOR's states alternate: the operations with a non-zero operand fetch 0, 1, 0, ... */
static const char *lxor_check(const int64_t *v, const int64_t *f, int n, int64_t fin, char *why, size_t len)
{
    int toggles = 0, zeros = 0, ones = 0;
    for (int j = 0; j < n; j++) {
        if (f[j] != 0 && f[j] != 1) {
            snprintf(why, len, "fetched 0x%llx: not 0 or 1", (unsigned long long)f[j]);
            return why;
        }
        if (v[j]) {
            toggles++;
            zeros += f[j] == 0;
            ones += f[j] == 1;
        }
    }
    if (zeros != (toggles + 1) / 2 || ones != toggles / 2 || fin != toggles % 2) {
        snprintf(why, len, "%d toggling operations fetched 0 %d times and 1 %d times, final %lld (not atomic, or a wrong "
                 "operation)",
                 toggles, zeros, ones, (long long)fin);
        return why;
    }
    return NULL;
}

/* the BTL's counters (MPI_T performance variables btl_ofi_rdma_*) */
typedef struct {
    long long put, get, op, fop, cas;
} counts_t;
static const char *const count_names[5] = { "btl_ofi_rdma_puts", "btl_ofi_rdma_gets", "btl_ofi_rdma_atomics",
                                            "btl_ofi_rdma_fetching_atomics", "btl_ofi_rdma_cswaps" };
static t_pvars_t count_vars;
static int have_counts;

static int read_counts(counts_t *c)
{
    unsigned long long v[5] = { 0 };
    memset(c, 0, sizeof(*c));
    if (!have_counts)
        return 0;
    t_pvars_read(&count_vars, v);
    c->put = (long long)v[0];
    c->get = (long long)v[1];
    c->op = (long long)v[2];
    c->fop = (long long)v[3];
    c->cas = (long long)v[4];
    return 1;
}

static void btl_kind(int kind, int want_counts, int nops)
{
    const int K0 = t_quick ? 4 : 8;
    const int K = K0 * np <= 32 ? K0 : (32 / np > 0 ? 32 / np : 1), nk = np * K;
    const size_t size = slot_off(NTYPES, 0) + 64;
    /* per target t: operands and results [t][type][op][round]; each origin sends each
     * target a record of rec_len values: the fetched ones at rec_fop, the vector's at
     * rec_vec, the compare-and-swap race's at rec_race */
    const size_t rec_fop = 0, rec_vec = (size_t)NTYPES * NOPS * K, rec_race = rec_vec + (size_t)NTYPES * NVEC * K,
                 rec_len = rec_race + NTYPES;
    int64_t *oper = t_malloc(8 * (size_t)np * NTYPES * NOPS * K);
    int64_t *vsrc = t_malloc(8 * (size_t)np * NTYPES * NVEC * K);
    int64_t *fres = t_malloc(8 * (size_t)np * NTYPES * NOPS * K);
    int64_t *vres = t_malloc(8 * (size_t)np * NTYPES * NVEC * K);
    int64_t *nres = t_malloc(8 * (size_t)np * NTYPES * K);
    int64_t *rval = t_malloc(8 * (size_t)np * NTYPES), *rcmp = t_malloc(8 * (size_t)np * NTYPES);
    int64_t *rres = t_malloc(8 * (size_t)np * NTYPES);
    int64_t *out = t_malloc(8 * (size_t)np * rec_len), *in = t_malloc(8 * (size_t)np * rec_len);
    int64_t *guess = t_malloc(8 * (size_t)np * NTYPES);
    uint8_t *base = t_malloc(size), *mine = t_malloc(size), *theirs = t_malloc(size), *back = t_malloc(size);
    MPI_Aint *tbase = t_malloc(sizeof(MPI_Aint) * (size_t)np);
    long long want_fop = 0, want_cas = 0;
    counts_t c0, c1;
    int have0 = 0, have1 = 0;
    char what[200], why[300];
    MPI_Win win;
#define OPER(t, ti, i, k) oper[(((size_t)(t) * NTYPES + (size_t)(ti)) * NOPS + (size_t)(i)) * K + (size_t)(k)]
#define FRES(t, ti, i, k) fres[(((size_t)(t) * NTYPES + (size_t)(ti)) * NOPS + (size_t)(i)) * K + (size_t)(k)]
#define VSRC(t, ti, k) (&vsrc[(((size_t)(t) * NTYPES + (size_t)(ti)) * K + (size_t)(k)) * NVEC])
#define VRES(t, ti, k) (&vres[(((size_t)(t) * NTYPES + (size_t)(ti)) * K + (size_t)(k)) * NVEC])
#define TD(t, ti, s) (tbase[t] + (MPI_Aint)slot_off(ti, s))

    memset(fres, 0, 8 * (size_t)np * NTYPES * NOPS * K);
    memset(oper, 0, 8 * (size_t)np * NTYPES * NOPS * K);
    T_ASSERT(sizeof(int) == 4, "MPI_INT is taken for a 4-byte type");
    T_ASSERT(np <= 32, "the BTL part supports up to 32 ranks (a bit per operation)");
    snprintf(what, sizeof(what), "%s btl atomics", kind_name[kind]);
    t_section("%s: create the window", what);
    memset(base, 0, size);
    for (int ti = 0; ti < NTYPES; ti++) {
        int w = width_of(ti);
        for (int i = 0; i < NOPS; i++) {
            st(base + slot_off(ti, S_ACC + i), w, init_of(i, w));
            st(base + slot_off(ti, S_FOP + i), w, init_of(i, w));
        }
        st(base + slot_off(ti, S_NOOP), w, noop_word(me, w));
        for (int e = 0; e < NVEC; e++)
            st(base + slot_off(ti, S_VEC) + (size_t)e * (size_t)w, w, vec_init(e, w));
        st(base + slot_off(ti, S_RACE), w, race_init(w));
        st(base + slot_off(ti, S_COUNT), w, count_init(w));
    }
    if (kind == W_CREATE) {
        T_CHECK_MPI(MPI_Win_create(base, (MPI_Aint)size, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win));
        memset(tbase, 0, sizeof(MPI_Aint) * (size_t)np);
    } else {
        MPI_Aint a;
        T_CHECK_MPI(MPI_Win_create_dynamic(MPI_INFO_NULL, MPI_COMM_WORLD, &win));
        T_CHECK_MPI(MPI_Win_attach(win, base, (MPI_Aint)size));
        T_CHECK_MPI(MPI_Get_address(base, &a));
        T_CHECK_MPI(MPI_Allgather(&a, 1, MPI_AINT, tbase, 1, MPI_AINT, MPI_COMM_WORLD));
    }
    MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    have0 = read_counts(&c0);

    /* every rank, the target itself included, applies each operation K times to the same
     * words of every rank, all in one passive epoch */
    t_section("%s: MPI_Accumulate, MPI_Fetch_and_op, MPI_Get_accumulate from %d ranks, %d rounds", what, np, K);
    T_CHECK_MPI(MPI_Win_lock_all(0, win));
    for (int k = 0; k < K; k++) {
        int g = me * K + k;
        for (int d = 0; d < np; d++) {
            int t = (me + d + k) % np;
            for (int ti = 0; ti < NTYPES; ti++) {
                MPI_Datatype ty = type_of(ti);
                int w = width_of(ti);
                for (int i = 0; i < nops; i++) {
                    int64_t *o = &OPER(t, ti, i, k);
                    st(o, w, operand_of(i, g, nk, w));
                    T_CHECK_MPI(MPI_Accumulate(o, 1, ty, t, TD(t, ti, S_ACC + i), 1, ty, op_of(i), win));
                    T_CHECK_MPI(MPI_Fetch_and_op(o, &FRES(t, ti, i, k), ty, t, TD(t, ti, S_FOP + i), op_of(i), win));
                }
                T_CHECK_MPI(MPI_Fetch_and_op(NULL, &nres[((size_t)t * NTYPES + (size_t)ti) * K + (size_t)k], ty, t,
                                             TD(t, ti, S_NOOP), MPI_NO_OP, win));
                for (int e = 0; e < NVEC; e++)
                    st((uint8_t *)VSRC(t, ti, k) + (size_t)e * (size_t)w, w, vec_operand(g, e, w));
                T_CHECK_MPI(MPI_Get_accumulate(VSRC(t, ti, k), NVEC, ty, VRES(t, ti, k), NVEC, ty, t, TD(t, ti, S_VEC),
                                               NVEC, ty, MPI_SUM, win));
                if (t != me)
                    want_fop += 2 * nops + NVEC;
            }
        }
        t_touch();
    }
    T_CHECK_MPI(MPI_Win_flush_all(win));
    T_CHECK_MPI(MPI_Win_unlock_all(win));

    /* compare-and-swap: the other ranks race for one word of each, then count another up
     * K times each with compare-and-swap loops */
    t_section("%s: MPI_Compare_and_swap race and counter from %d ranks, %d rounds", what, np - 1, K);
    T_CHECK_MPI(MPI_Win_lock_all(0, win));
    for (int ti = 0; ti < NTYPES; ti++) {
        int w = width_of(ti);
        for (int d = 1; d < np; d++) {
            int t = (me + d) % np;
            size_t x = (size_t)t * NTYPES + (size_t)ti;
            st(&rval[x], w, race_value(me, w));
            st(&rcmp[x], w, race_init(w));
            T_CHECK_MPI(MPI_Compare_and_swap(&rval[x], &rcmp[x], &rres[x], type_of(ti), t, TD(t, ti, S_RACE), win));
            want_cas += w == 8;
            guess[x] = count_init(w);
        }
    }
    T_CHECK_MPI(MPI_Win_flush_all(win));
    for (int k = 0; k < K; k++) {
        for (int d = 1; d < np; d++) {
            int t = (me + 1 + (d - 1 + k) % (np - 1)) % np; /* every other rank, from a different one each round */
            for (int ti = 0; ti < NTYPES; ti++) {
                int w = width_of(ti);
                size_t x = (size_t)t * NTYPES + (size_t)ti;
                int64_t cmp, nv, res = 0;
                for (int tries = 0;; tries++) {
                    T_ASSERT(tries < 100000, "%s: %s compare-and-swap counter at rank %d never caught up", what,
                             type_name[ti], t);
                    st(&cmp, w, guess[x]);
                    st(&nv, w, guess[x] + 1);
                    T_CHECK_MPI(MPI_Compare_and_swap(&nv, &cmp, &res, type_of(ti), t, TD(t, ti, S_COUNT), win));
                    T_CHECK_MPI(MPI_Win_flush(t, win));
                    want_cas += w == 8;
                    if (ld(&res, w) == guess[x]) {
                        guess[x]++;
                        break;
                    }
                    if (ld(&res, w) < guess[x])
                        t_fail("%s: %s compare-and-swap counter at rank %d went back from %lld to %lld", what,
                               type_name[ti], t, (long long)guess[x], (long long)ld(&res, w));
                    guess[x] = ld(&res, w);
                }
            }
        }
        t_touch();
    }
    T_CHECK_MPI(MPI_Win_unlock_all(win));
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));

    /* MPI_NO_OP fetched the target's word */
    for (int t = 0; t < np; t++)
        for (int ti = 0; ti < NTYPES; ti++)
            for (int k = 0; k < K; k++) {
                int w = width_of(ti);
                int64_t got = ld(&nres[((size_t)t * NTYPES + (size_t)ti) * K + (size_t)k], w);
                if (got != noop_word(t, w))
                    t_fail("%s: %s MPI_Fetch_and_op(MPI_NO_OP) from rank %d round %d fetched 0x%llx, the word is 0x%llx",
                           what, type_name[ti], t, k, (unsigned long long)got, (unsigned long long)noop_word(t, w));
            }

    /* what each rank fetched goes to the target */
    t_section("%s: check", what);
    for (int t = 0; t < np; t++) {
        int64_t *r = out + (size_t)t * rec_len;
        for (int ti = 0; ti < NTYPES; ti++) {
            int w = width_of(ti);
            for (int i = 0; i < NOPS; i++)
                for (int k = 0; k < K; k++)
                    r[rec_fop + ((size_t)ti * NOPS + (size_t)i) * K + (size_t)k] = ld(&FRES(t, ti, i, k), w);
            for (int k = 0; k < K; k++)
                for (int e = 0; e < NVEC; e++)
                    r[rec_vec + ((size_t)ti * K + (size_t)k) * NVEC + (size_t)e] =
                        ld((uint8_t *)VRES(t, ti, k) + (size_t)e * (size_t)w, w);
            r[rec_race + (size_t)ti] = t == me ? 0 : ld(&rres[(size_t)t * NTYPES + (size_t)ti], w);
        }
    }
    T_CHECK_MPI(MPI_Alltoall(out, (int)rec_len, MPI_INT64_T, in, (int)rec_len, MPI_INT64_T, xcomm));

    T_CHECK_MPI(MPI_Win_lock(MPI_LOCK_SHARED, me, 0, win));
    memcpy(mine, base, size);
    T_CHECK_MPI(MPI_Win_unlock(me, win));
    {
        int64_t *v = t_malloc(8 * (size_t)nk), *f = t_malloc(8 * (size_t)nk);
        for (int ti = 0; ti < NTYPES; ti++) {
            int w = width_of(ti);
            for (int i = 0; i < nops; i++) {
                int64_t acc = ld(mine + slot_off(ti, S_ACC + i), w), fin = ld(mine + slot_off(ti, S_FOP + i), w);
                int64_t e = init_of(i, w);
                const char *bad;
                /* MPI_Accumulate: the final value */
                if (i == O_REPLACE) {
                    int ok = 0;
                    for (int o = 0; o < np; o++)
                        ok |= acc == operand_of(i, o * K + K - 1, nk, w);
                    if (!ok)
                        t_fail("%s: %s MPI_Accumulate(MPI_REPLACE) left 0x%llx, not the last value of any origin", what,
                               type_name[ti], (unsigned long long)acc);
                } else {
                    for (int g = 0; g < nk; g++)
                        e = apply_op(i, e, operand_of(i, g, nk, w), w);
                    if (acc != e)
                        t_fail("%s: %s MPI_Accumulate(MPI_%s) from %d ranks x %d: expected 0x%llx got 0x%llx", what,
                               type_name[ti], op_name[i], np, K, (unsigned long long)e, (unsigned long long)acc);
                }
                /* MPI_Fetch_and_op: the fetched values and the final one */
                for (int o = 0; o < np; o++)
                    for (int k = 0; k < K; k++) {
                        v[o * K + k] = operand_of(i, o * K + k, nk, w);
                        f[o * K + k] = in[(size_t)o * rec_len + rec_fop + ((size_t)ti * NOPS + (size_t)i) * K + (size_t)k];
                    }
                bad = i == O_LXOR ? lxor_check(v, f, nk, fin, why, sizeof(why))
                                  : walk(i, w, init_of(i, w), v, f, nk, fin, why, sizeof(why));
                if (bad)
                    t_fail("%s: %s MPI_Fetch_and_op(MPI_%s) from %d ranks x %d: %s", what, type_name[ti], op_name[i], np,
                           K, bad);
            }
            /* MPI_Get_accumulate of NVEC elements: each a SUM history of its own */
            for (int el = 0; el < NVEC; el++) {
                int64_t fin = ld(mine + slot_off(ti, S_VEC) + (size_t)el * (size_t)w, w);
                const char *bad;
                for (int o = 0; o < np; o++)
                    for (int k = 0; k < K; k++) {
                        v[o * K + k] = vec_operand(o * K + k, el, w);
                        f[o * K + k] = in[(size_t)o * rec_len + rec_vec + ((size_t)ti * K + (size_t)k) * NVEC + (size_t)el];
                    }
                bad = walk(O_SUM, w, vec_init(el, w), v, f, nk, fin, why, sizeof(why));
                if (bad)
                    t_fail("%s: %s MPI_Get_accumulate(MPI_SUM) of %d elements, element %d: %s", what, type_name[ti],
                           NVEC, el, bad);
            }
            if (ld(mine + slot_off(ti, S_NOOP), w) != noop_word(me, w))
                t_fail("%s: %s word read with MPI_NO_OP changed", what, type_name[ti]);
            /* compare-and-swap */
            {
                int64_t slot = ld(mine + slot_off(ti, S_RACE), w), cnt = ld(mine + slot_off(ti, S_COUNT), w);
                int wins = 0;
                for (int o = 0; o < np; o++) {
                    int64_t got = in[(size_t)o * rec_len + rec_race + (size_t)ti];
                    if (o == me)
                        continue;
                    if (got == race_init(w)) {
                        wins++;
                        if (slot != race_value(o, w))
                            t_fail("%s: %s rank %d won the compare-and-swap race but the word holds 0x%llx", what,
                                   type_name[ti], o, (unsigned long long)slot);
                    } else if (got != slot)
                        t_fail("%s: %s rank %d lost the compare-and-swap race but fetched 0x%llx, not the winner's "
                               "0x%llx",
                               what, type_name[ti], o, (unsigned long long)got, (unsigned long long)slot);
                }
                if (np > 1 && wins != 1)
                    t_fail("%s: %s compare-and-swap race: %d winners", what, type_name[ti], wins);
                if (cnt != count_init(w) + (int64_t)(np - 1) * K)
                    t_fail("%s: %s compare-and-swap counter: expected %lld got %lld (increments lost or doubled)", what,
                           type_name[ti], (long long)(count_init(w) + (int64_t)(np - 1) * K), (long long)cnt);
            }
        }
        free(v);
        free(f);
    }

    /* the neighbour's words, read back through the window with MPI_NO_OP */
    if (np > 1) {
        int right = (me + 1) % np, left = (me + np - 1) % np;
        t_section("%s: read the words of rank %d back with MPI_NO_OP", what, right);
        T_CHECK_MPI(MPI_Sendrecv(mine, (int)size, MPI_BYTE, left, 5, theirs, (int)size, MPI_BYTE, right, 5, xcomm,
                                 MPI_STATUS_IGNORE));
        memset(back, 0, size);
        T_CHECK_MPI(MPI_Win_lock(MPI_LOCK_SHARED, right, 0, win));
        for (int ti = 0; ti < NTYPES; ti++)
            for (int s = 0; s < NSLOT; s++)
                if (s < S_VEC || s >= S_RACE)
                    T_CHECK_MPI(MPI_Fetch_and_op(NULL, back + slot_off(ti, s), type_of(ti), right, TD(right, ti, s),
                                                 MPI_NO_OP, win));
                else if (s == S_VEC)
                    T_CHECK_MPI(MPI_Get_accumulate(NULL, 0, type_of(ti), back + slot_off(ti, s), NVEC, type_of(ti),
                                                   right, TD(right, ti, s), NVEC, type_of(ti), MPI_NO_OP, win));
        T_CHECK_MPI(MPI_Win_unlock(right, win));
        for (int ti = 0; ti < NTYPES; ti++) {
            int w = width_of(ti);
            for (int s = 0; s < NSLOT; s++) {
                int n = s == S_VEC ? NVEC : 1;
                if (s > S_VEC && s < S_RACE)
                    continue;
                for (int e = 0; e < n; e++) {
                    size_t at = slot_off(ti, s) + (size_t)e * (size_t)w;
                    if (ld(back + at, w) != ld(theirs + at, w))
                        t_fail("%s: %s word %d(+%d) of rank %d read with MPI_NO_OP: 0x%llx, rank %d holds 0x%llx",
                               what, type_name[ti], s, e, right, (unsigned long long)ld(back + at, w), right,
                               (unsigned long long)ld(theirs + at, w));
                }
            }
        }
    }
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));

    t_section("%s: free the window", what);
    if (kind == W_DYNAMIC)
        T_CHECK_MPI(MPI_Win_detach(win, base));
    T_CHECK_MPI(MPI_Win_free(&win));
    have1 = read_counts(&c1);

    {
        long long d[5] = { c1.op - c0.op, c1.fop - c0.fop, c1.cas - c0.cas, want_fop, want_cas }, sum[5];
        int have = have0 && have1;
        T_CHECK_MPI(MPI_Allreduce(d, sum, 5, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
        if (want_counts && !have)
            t_fail("%s: btl_ofi_rdma_* not found through MPI_T (is our BTL loaded? --no-btl-counters skips this)",
                   what);
        if (have) {
            t_info("%s: BTL counters, all ranks: %lld atomics, %lld fetching atomics, %lld compare-and-swaps; "
                   "sent to other ranks: %lld elements of mapped operations, %lld 8-byte compare-and-swaps",
                   what, sum[0], sum[1], sum[2], sum[3], sum[4]);
            if (want_counts && (d[0] + d[1] < want_fop || d[2] < want_cas))
                t_fail("%s: the BTL's atomics were not used: its counters grew by %lld atomics + %lld fetching atomics "
                       "(expected at least %lld) and %lld compare-and-swaps (expected at least %lld)",
                       what, d[0], d[1], want_fop, d[2], want_cas);
        }
    }
    free(oper); free(vsrc); free(fres); free(vres); free(nres); free(rval); free(rcmp); free(rres);
    free(out); free(in); free(guess); free(base); free(mine); free(theirs); free(back); free(tbase);
#undef OPER
#undef FRES
#undef VSRC
#undef VRES
#undef TD
}

static void btl_part(void)
{
    const char *prov = t_provider();
    int vader = strcmp(prov, "vader") == 0;
    int want_counts = !vader && strcmp(prov, "none") != 0 && !t_opt_flag("no-btl-counters");
    /* vader offers no LAND, LOR, LXOR (btl_vader_component.c) and osc rdma hands them to
     * it all the same (it checks the width, not the operation): wrong results */
    int nops = vader ? O_LAND : NOPS;
    int provided;
    if (!selected("ops", "btl"))
        return;
    if (vader)
        t_info("btl part: MPI_LAND, MPI_LOR and MPI_LXOR skipped over vader (osc rdma gives them to vader, which "
               "does not have them)");
    T_CHECK_MPI(t_mpit_init(&provided));
    have_counts = t_pvars_open(&count_vars, count_names, 5);
    if (selected("kinds", "create"))
        btl_kind(W_CREATE, want_counts, nops);
    if (selected("kinds", "dynamic"))
        btl_kind(W_DYNAMIC, want_counts, nops);
    t_pvars_close(&count_vars);
    MPI_T_finalize();
}
