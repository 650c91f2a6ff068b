/*
 * datatypes: derived datatypes through point-to-point, every byte (and every gap) checked.
 *
 * Each case is a (send type, count) -> (receive type, count) pair with equal type
 * signatures, run around a ring (rank r sends to r+1) three ways: Irecv+Send,
 * Isend+Recv, Sendrecv. Checked: MPI_Get_count with the receive type, MPI_Get_elements,
 * source/tag/error, and the receive memory against the oracle of dt_common.h (gaps must
 * keep their guard bytes). Types: vector, hvector, big vector (4 MiB payload, 8 MiB
 * extent), indexed, hindexed, indexed_block, struct with gaps (plain and resized to
 * sizeof), resized with a positive and a negative lower bound, contiguous of a derived
 * type, vector of a struct, MPI_BOTTOM with absolute addresses (MPI_Get_address) over
 * separate allocations, derived -> contiguous and contiguous -> derived, zero count.
 * Hand-computed checks too: a vector received contiguous, struct gaps left alone, and a
 * partial receive (Get_count MPI_UNDEFINED, Get_elements exact).
 *
 * Options: --quick (skip the 4 MiB vector).
 */
#include "dt_common.h"
#include <stddef.h>

static MPI_Comm comm;

struct S {
    char c;   /* gap of 7 after */
    double d;
    int i[3]; /* gap of 2..4 after, depending on short alignment */
    short s;  /* tail padding */
};

/* absolute-address (MPI_BOTTOM) layouts */
typedef struct {
    double *d;
    int *i;
    char *c;
    MPI_Datatype type;
} bottom_t;

enum { ND = 100, NI = 37, NC = 1000 };

/* Send-side MPI_BOTTOM layout: three allocations, one block each (double, int, char). */
static void bottom_make_a(bottom_t *b, dt_side *s)
{
    int bl[3] = { ND, NI, NC };
    MPI_Aint disp[3];
    MPI_Datatype ty[3] = { MPI_DOUBLE, MPI_INT, MPI_CHAR };
    b->d = t_malloc(sizeof(double) * ND);
    b->i = t_malloc(sizeof(int) * NI);
    b->c = t_malloc(NC);
    memset(b->d, 0, sizeof(double) * ND);
    memset(b->i, 0, sizeof(int) * NI);
    memset(b->c, 0, NC);
    T_CHECK_MPI(MPI_Get_address(b->d, &disp[0]));
    T_CHECK_MPI(MPI_Get_address(b->i, &disp[1]));
    T_CHECK_MPI(MPI_Get_address(b->c, &disp[2]));
    T_CHECK_MPI(MPI_Type_create_struct(3, bl, disp, ty, &b->type));
    T_CHECK_MPI(MPI_Type_commit(&b->type));
    memset(s, 0, sizeof(*s));
    s->type = b->type;
    s->count = 1;
    s->buf = MPI_BOTTOM;
    s->nseg = 3;
    s->seg[0] = (uint8_t *)b->d; s->seglen[0] = sizeof(double) * ND;
    s->seg[1] = (uint8_t *)b->i; s->seglen[1] = sizeof(int) * NI;
    s->seg[2] = (uint8_t *)b->c; s->seglen[2] = NC;
    s->owns = 1;
}

/* Receive-side MPI_BOTTOM layout with the same signature but a different shape: the
 * doubles split over two allocations (the second strided), ints via hindexed blocks
 * inside one allocation with holes, chars in one allocation. */
static void bottom_make_b(bottom_t *b, dt_side *s)
{
    double *d2;
    MPI_Datatype dvec, ihidx, parts[4];
    int bl[4] = { 60, 1, 1, NC };
    MPI_Aint disp[4];
    b->d = t_malloc(sizeof(double) * 60);
    d2 = t_malloc(sizeof(double) * 40 * 3);
    b->i = t_malloc(sizeof(int) * (NI * 2 + 8));
    b->c = t_malloc(NC);
    memset(b->d, 0, sizeof(double) * 60);
    memset(d2, 0, sizeof(double) * 120);
    memset(b->i, 0, sizeof(int) * (NI * 2 + 8));
    memset(b->c, 0, NC);
    /* 40 doubles at stride 3 */
    T_CHECK_MPI(MPI_Type_vector(40, 1, 3, MPI_DOUBLE, &dvec));
    /* 37 ints as blocks of 5,5,...,2 with a 3-int hole after each block */
    {
        int ibl[8];
        MPI_Aint idisp[8];
        int left = NI, k = 0, off = 0;
        while (left > 0) {
            ibl[k] = left > 5 ? 5 : left;
            idisp[k] = (MPI_Aint)off * (MPI_Aint)sizeof(int);
            off += ibl[k] + 3;
            left -= ibl[k];
            k++;
        }
        T_CHECK_MPI(MPI_Type_create_hindexed(k, ibl, idisp, MPI_INT, &ihidx));
    }
    T_CHECK_MPI(MPI_Get_address(b->d, &disp[0]));
    T_CHECK_MPI(MPI_Get_address(d2, &disp[1]));
    T_CHECK_MPI(MPI_Get_address(b->i, &disp[2]));
    T_CHECK_MPI(MPI_Get_address(b->c, &disp[3]));
    parts[0] = MPI_DOUBLE;
    parts[1] = dvec;
    parts[2] = ihidx;
    parts[3] = MPI_CHAR;
    T_CHECK_MPI(MPI_Type_create_struct(4, bl, disp, parts, &b->type));
    T_CHECK_MPI(MPI_Type_commit(&b->type));
    T_CHECK_MPI(MPI_Type_free(&dvec));
    T_CHECK_MPI(MPI_Type_free(&ihidx));
    memset(s, 0, sizeof(*s));
    s->type = b->type;
    s->count = 1;
    s->buf = MPI_BOTTOM;
    s->nseg = 4;
    s->seg[0] = (uint8_t *)b->d; s->seglen[0] = sizeof(double) * 60;
    s->seg[1] = (uint8_t *)d2; s->seglen[1] = sizeof(double) * 120;
    s->seg[2] = (uint8_t *)b->i; s->seglen[2] = sizeof(int) * (NI * 2 + 8);
    s->seg[3] = (uint8_t *)b->c; s->seglen[3] = NC;
    s->owns = 1;
}

typedef struct {
    const char *name;
    int bottom_send, bottom_recv; /* 0 plain, 1 layout a, 2 layout b */
    MPI_Datatype stype, rtype;
    int scount, rcount;
    int elements; /* basic elements in the message */
} dcase;

static void run_case(int ci, const dcase *c, int how)
{
    int to = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    int tag = 500 + ci * 4 + how;
    static const char *hows[3] = { "Irecv+Send", "Isend+Recv", "Sendrecv" };
    dt_side s, r;
    bottom_t bs, br;
    MPI_Request req;
    MPI_Status st;
    int cnt = -7, el = -7;
    char what[300];

    snprintf(what, sizeof(what), "%s via %s %d->%d", c->name, hows[how], from, t_rank);
    t_section("%s", what);
    if (c->bottom_send == 1)
        bottom_make_a(&bs, &s);
    else if (c->bottom_send == 2)
        bottom_make_b(&bs, &s);
    else
        s = dt_side_plain(c->stype, c->scount);
    if (c->bottom_recv == 1)
        bottom_make_a(&br, &r);
    else if (c->bottom_recv == 2)
        bottom_make_b(&br, &r);
    else
        r = dt_side_plain(c->rtype, c->rcount);
    T_ASSERT(dt_bytes(s.type, s.count) == dt_bytes(r.type, r.count), "case sizes differ: %zu vs %zu",
             dt_bytes(s.type, s.count), dt_bytes(r.type, r.count));

    dt_side_fill(&s, t_seed(900, (uint64_t)t_rank, (uint64_t)ci, (uint64_t)how));
    dt_side_set(&r, DT_GUARD);
    t_status_init(&st);
    switch (how) {
    case 0:
        T_CHECK_MPI(MPI_Irecv(r.buf, r.count, r.type, from, tag, comm, &req));
        T_CHECK_MPI(MPI_Send(s.buf, s.count, s.type, to, tag, comm));
        T_CHECK_MPI(MPI_Wait(&req, &st));
        break;
    case 1:
        T_CHECK_MPI(MPI_Isend(s.buf, s.count, s.type, to, tag, comm, &req));
        T_CHECK_MPI(MPI_Recv(r.buf, r.count, r.type, from, tag, comm, &st));
        T_CHECK_MPI(MPI_Wait(&req, MPI_STATUS_IGNORE));
        break;
    case 2:
        T_CHECK_MPI(MPI_Sendrecv(s.buf, s.count, s.type, to, tag, r.buf, r.count, r.type, from, tag, comm, &st));
        break;
    }
    t_check_status(&st, from, tag, r.type, r.count, what);
    T_CHECK_MPI(MPI_Get_elements(&st, r.type, &el));
    if (el != c->elements)
        t_fail("%s: MPI_Get_elements expected %d got %d", what, c->elements, el);
    (void)cnt;
    dt_side_check(&r, t_seed(900, (uint64_t)from, (uint64_t)ci, (uint64_t)how), what);
    if (c->bottom_send)
        T_CHECK_MPI(MPI_Type_free(&bs.type));
    if (c->bottom_recv)
        T_CHECK_MPI(MPI_Type_free(&br.type));
    dt_side_free(&s);
    dt_side_free(&r);
}

/* Hand-computed: vector(1000,3,7) of int sent, 3000 contiguous ints received. */
static void hand_vector(void)
{
    int to = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    MPI_Datatype v;
    int *sb = t_malloc(sizeof(int) * 7000), *rb = t_malloc(sizeof(int) * 3001);
    MPI_Status st;
    t_section("hand-checked vector -> contiguous");
    T_CHECK_MPI(MPI_Type_vector(1000, 3, 7, MPI_INT, &v));
    T_CHECK_MPI(MPI_Type_commit(&v));
    for (int i = 0; i < 7000; i++)
        sb[i] = -1;
    for (int b = 0; b < 1000; b++)
        for (int j = 0; j < 3; j++)
            sb[b * 7 + j] = t_rank * 100000 + b * 3 + j;
    rb[3000] = 0x5a5a5a5a;
    t_status_init(&st);
    T_CHECK_MPI(MPI_Sendrecv(sb, 1, v, to, 1, rb, 3000, MPI_INT, from, 1, comm, &st));
    t_check_status(&st, from, 1, MPI_INT, 3000, "hand vector");
    for (int k = 0; k < 3000; k++)
        if (rb[k] != from * 100000 + k)
            t_fail("hand vector: int %d expected %d got %d", k, from * 100000 + k, rb[k]);
    T_ASSERT(rb[3000] == 0x5a5a5a5a, "hand vector wrote past the receive buffer");
    T_CHECK_MPI(MPI_Type_free(&v));
    free(sb);
    free(rb);
}

/* Hand-computed: struct gaps are left alone by a receive of resized struct type. */
static void hand_struct(MPI_Datatype sres)
{
    int to = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    struct S sb[10], rb[10];
    MPI_Status st;
    t_section("hand-checked struct gaps");
    memset(sb, 0x33, sizeof(sb));
    memset(rb, DT_GUARD, sizeof(rb));
    for (int k = 0; k < 10; k++) {
        sb[k].c = (char)(t_rank + k);
        sb[k].d = t_rank * 1000.0 + k + 0.5;
        sb[k].i[0] = k;
        sb[k].i[1] = -k;
        sb[k].i[2] = t_rank;
        sb[k].s = (short)(k * 3);
    }
    t_status_init(&st);
    T_CHECK_MPI(MPI_Sendrecv(sb, 10, sres, to, 2, rb, 10, sres, from, 2, comm, &st));
    t_check_status(&st, from, 2, sres, 10, "hand struct");
    for (int k = 0; k < 10; k++) {
        const uint8_t *p = (const uint8_t *)&rb[k];
        if (rb[k].c != (char)(from + k) || rb[k].d != from * 1000.0 + k + 0.5 || rb[k].i[0] != k ||
            rb[k].i[1] != -k || rb[k].i[2] != from || rb[k].s != (short)(k * 3))
            t_fail("hand struct: element %d has wrong field values", k);
        for (size_t b = offsetof(struct S, c) + 1; b < offsetof(struct S, d); b++)
            if (p[b] != DT_GUARD)
                t_fail("hand struct: element %d gap byte %zu written (0x%02x)", k, b, p[b]);
        for (size_t b = offsetof(struct S, s) + sizeof(short); b < sizeof(struct S); b++)
            if (p[b] != DT_GUARD)
                t_fail("hand struct: element %d tail byte %zu written (0x%02x)", k, b, p[b]);
    }
}

/* Partial receive: 10 ints into 5 x vector(3,1,2) -> Get_count UNDEFINED, Get_elements 10. */
static void partial(void)
{
    int to = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    MPI_Datatype v;
    int sb[10], rb[25], cnt, el;
    MPI_Status st;
    t_section("partial receive of a derived type");
    T_CHECK_MPI(MPI_Type_vector(3, 1, 2, MPI_INT, &v));
    T_CHECK_MPI(MPI_Type_commit(&v));
    for (int k = 0; k < 10; k++)
        sb[k] = t_rank * 100 + k;
    for (int k = 0; k < 25; k++)
        rb[k] = -1;
    t_status_init(&st);
    T_CHECK_MPI(MPI_Sendrecv(sb, 10, MPI_INT, to, 3, rb, 5, v, from, 3, comm, &st));
    T_CHECK_MPI(MPI_Get_count(&st, v, &cnt));
    T_ASSERT(cnt == MPI_UNDEFINED, "Get_count of 10 ints in vector(3) units: expected MPI_UNDEFINED got %d", cnt);
    T_CHECK_MPI(MPI_Get_elements(&st, v, &el));
    T_ASSERT(el == 10, "Get_elements expected 10 got %d", el);
    T_CHECK_MPI(MPI_Get_count(&st, MPI_INT, &cnt));
    T_ASSERT(cnt == 10, "Get_count(MPI_INT) expected 10 got %d", cnt);
    T_ASSERT(st.MPI_SOURCE == from && st.MPI_TAG == 3, "partial: source %d tag %d", st.MPI_SOURCE, st.MPI_TAG);
    /* extent of vector(3,1,2) is 5 ints: element e block j at int e*5 + j*2 */
    for (int k = 0; k < 25; k++) {
        int expect = -1;
        for (int i = 0; i < 10; i++)
            if ((i / 3) * 5 + (i % 3) * 2 == k)
                expect = from * 100 + i;
        if (rb[k] != expect)
            t_fail("partial: int %d expected %d got %d", k, expect, rb[k]);
    }
    T_CHECK_MPI(MPI_Type_free(&v));
}

int main(int argc, char **argv)
{
    MPI_Datatype vec, hvec, bigvec, idx, hidx, iblk, st_plain, st_res, res_pos, res_neg, contig_st, vec_st,
        st_packed, bvec, dbl;
    dcase cases[40];
    int nc = 0;
    int nbig = 262144; /* 4 MiB of ints in blocks of 4 with stride 8 */

    t_init(&argc, &argv, "datatypes");
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));

    T_CHECK_MPI(MPI_Type_vector(1000, 3, 7, MPI_INT, &vec));
    T_CHECK_MPI(MPI_Type_create_hvector(600, 5, 11 * (MPI_Aint)sizeof(int) + 2, MPI_INT, &hvec)); /* unaligned stride */
    T_CHECK_MPI(MPI_Type_vector(nbig / 4, 4, 8, MPI_INT, &bigvec));
    {
        int bl[7] = { 1, 3, 2, 7, 1, 100, 5 }, dp[7] = { 0, 2, 9, 20, 40, 41, 300 };
        T_CHECK_MPI(MPI_Type_indexed(7, bl, dp, MPI_DOUBLE, &idx)); /* 119 doubles */
    }
    {
        int bl[4] = { 30, 1, 50, 38 };
        MPI_Aint dp[4] = { 3, 400, 1001, 1700 }; /* odd byte offsets */
        T_CHECK_MPI(MPI_Type_create_hindexed(4, bl, dp, MPI_DOUBLE, &hidx)); /* 119 doubles */
    }
    {
        int dp[17];
        for (int k = 0; k < 17; k++)
            dp[k] = (k * 37) % 17 * 9;
        T_CHECK_MPI(MPI_Type_create_indexed_block(17, 7, dp, MPI_DOUBLE, &iblk)); /* 119 doubles, permuted */
    }
    {
        int bl[4] = { 1, 1, 3, 1 };
        MPI_Aint dp[4] = { offsetof(struct S, c), offsetof(struct S, d), offsetof(struct S, i), offsetof(struct S, s) };
        MPI_Datatype ty[4] = { MPI_CHAR, MPI_DOUBLE, MPI_INT, MPI_SHORT };
        T_CHECK_MPI(MPI_Type_create_struct(4, bl, dp, ty, &st_plain));
        T_CHECK_MPI(MPI_Type_create_resized(st_plain, 0, sizeof(struct S), &st_res));
        /* same signature, no gaps */
        MPI_Aint pk[4] = { 0, 1, 9, 21 };
        T_CHECK_MPI(MPI_Type_create_struct(4, bl, pk, ty, &st_packed));
    }
    T_CHECK_MPI(MPI_Type_create_resized(MPI_INT, 0, 12, &res_pos));     /* every third int */
    {
        MPI_Datatype t2;
        /* two ints at bytes -8 and 4 (data before the buffer pointer), extent 24, lb -8 */
        int bl[2] = { 1, 1 };
        MPI_Aint dp[2] = { -8, 4 };
        T_CHECK_MPI(MPI_Type_create_hindexed(2, bl, dp, MPI_INT, &t2));
        T_CHECK_MPI(MPI_Type_create_resized(t2, -8, 24, &res_neg));
        T_CHECK_MPI(MPI_Type_free(&t2));
    }
    T_CHECK_MPI(MPI_Type_contiguous(50, st_res, &contig_st));
    T_CHECK_MPI(MPI_Type_vector(25, 2, 3, st_res, &vec_st));
    T_CHECK_MPI(MPI_Type_vector(100, 7, 13, MPI_BYTE, &bvec));
    dbl = MPI_DOUBLE;
    MPI_Datatype all[] = { vec, hvec, bigvec, idx, hidx, iblk, st_plain, st_res, st_packed, res_pos, res_neg,
                           contig_st, vec_st, bvec };
    for (size_t k = 0; k < sizeof(all) / sizeof(all[0]); k++)
        T_CHECK_MPI(MPI_Type_commit(&all[k]));
    vec = all[0]; hvec = all[1]; bigvec = all[2]; idx = all[3]; hidx = all[4]; iblk = all[5]; st_plain = all[6];
    st_res = all[7]; st_packed = all[8]; res_pos = all[9]; res_neg = all[10]; contig_st = all[11];
    vec_st = all[12]; bvec = all[13];

#define CASE(n, bs, br, st, sc, rt, rc, el) \
    cases[nc++] = (dcase){ n, bs, br, st, rt, sc, rc, el }
    CASE("vector -> contiguous int", 0, 0, vec, 1, MPI_INT, 3000, 3000);
    CASE("contiguous int -> vector", 0, 0, MPI_INT, 3000, vec, 1, 3000);
    CASE("vector -> hvector (unaligned stride)", 0, 0, vec, 1, hvec, 1, 3000);
    CASE("vector x2 -> vector x2", 0, 0, vec, 2, vec, 2, 6000);
    if (!t_quick) {
        CASE("big vector (4 MiB) -> contiguous", 0, 0, bigvec, 1, MPI_INT, nbig, nbig);
        CASE("contiguous (4 MiB) -> big vector", 0, 0, MPI_INT, nbig, bigvec, 1, nbig);
    }
    CASE("indexed x3 -> contiguous double", 0, 0, idx, 3, dbl, 357, 357);
    CASE("contiguous double -> indexed x3", 0, 0, dbl, 357, idx, 3, 357);
    CASE("indexed -> hindexed (odd offsets)", 0, 0, idx, 1, hidx, 1, 119);
    CASE("hindexed -> indexed_block (permuted)", 0, 0, hidx, 1, iblk, 1, 119);
    CASE("struct with gaps (not resized) x1", 0, 0, st_plain, 1, st_plain, 1, 6);
    CASE("struct resized x100 -> struct resized x100", 0, 0, st_res, 100, st_res, 100, 600);
    CASE("struct resized x100 -> packed struct x100", 0, 0, st_res, 100, st_packed, 100, 600);
    CASE("packed struct x100 -> struct resized x100", 0, 0, st_packed, 100, st_res, 100, 600);
    CASE("resized int (extent 12) -> contiguous", 0, 0, res_pos, 1000, MPI_INT, 1000, 1000);
    CASE("contiguous -> resized int (negative lb)", 0, 0, MPI_INT, 2000, res_neg, 1000, 2000);
    CASE("resized negative lb -> resized extent 12", 0, 0, res_neg, 500, res_pos, 1000, 1000);
    CASE("contiguous of struct x2 -> struct resized x100", 0, 0, contig_st, 2, st_res, 100, 600);
    CASE("vector of struct -> contiguous of struct", 0, 0, vec_st, 1, contig_st, 1, 300);
    CASE("byte vector -> bytes", 0, 0, bvec, 3, MPI_BYTE, 2100, 2100);
    CASE("zero count derived", 0, 0, vec, 0, vec, 0, 0);
    CASE("MPI_BOTTOM absolute -> MPI_BOTTOM absolute (other shape)", 1, 2, MPI_DATATYPE_NULL, 1, MPI_DATATYPE_NULL,
         1, ND + NI + NC);
    CASE("MPI_BOTTOM absolute (split) -> MPI_BOTTOM absolute", 2, 1, MPI_DATATYPE_NULL, 1, MPI_DATATYPE_NULL, 1,
         ND + NI + NC);
    {
        /* MPI_BOTTOM <-> contiguous needs a contiguous type with the same signature */
        static MPI_Datatype flat;
        int bl[3] = { ND, NI, NC };
        MPI_Aint dp[3] = { 0, ND * sizeof(double), ND * sizeof(double) + NI * sizeof(int) };
        MPI_Datatype ty[3] = { MPI_DOUBLE, MPI_INT, MPI_CHAR };
        T_CHECK_MPI(MPI_Type_create_struct(3, bl, dp, ty, &flat));
        T_CHECK_MPI(MPI_Type_commit(&flat));
        CASE("MPI_BOTTOM absolute -> contiguous", 1, 0, MPI_DATATYPE_NULL, 1, flat, 1, ND + NI + NC);
        CASE("contiguous -> MPI_BOTTOM absolute", 0, 2, flat, 1, MPI_DATATYPE_NULL, 1, ND + NI + NC);
    }
#undef CASE

    hand_vector();
    hand_struct(st_res);
    partial();
    for (int ci = 0; ci < nc; ci++)
        for (int how = 0; how < 3; how++)
            run_case(ci, &cases[ci], how);

    for (size_t k = 0; k < sizeof(all) / sizeof(all[0]); k++)
        T_CHECK_MPI(MPI_Type_free(&all[k]));
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
