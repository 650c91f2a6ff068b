/*
 * Helpers for derived-datatype tests (datatypes, alltoallw_bottom).
 *
 * A "side" is the memory a (type, count) pair describes: one allocation for ordinary
 * buffers, or several separate allocations addressed absolutely through MPI_BOTTOM.
 *
 * Oracle: the data in flight is always the pattern stream t_fill(stream, type_size*count,
 * seed). The sender produces it by MPI_Unpack-ing the stream into its send layout; the
 * receiver, after the receive, snapshots its memory, re-fills it with the guard byte,
 * MPI_Unpack-s the same stream with the receive type, and compares byte by byte. Gaps
 * that the receive type does not cover therefore must keep the guard byte. This relies
 * only on the local pack engine, never on the transport under test.
 */
#ifndef OMPI_OFI_DT_COMMON_H
#define OMPI_OFI_DT_COMMON_H
#include "common.h"

#define DT_GUARD 0xee
#define DT_MAXSEG 8

typedef struct {
    MPI_Datatype type;
    int count;
    void *buf; /* what is passed to MPI: a pointer or MPI_BOTTOM */
    int nseg;
    uint8_t *seg[DT_MAXSEG];
    size_t seglen[DT_MAXSEG];
    int owns; /* segments were allocated by dt_side_plain */
} dt_side;

static T_UNUSED size_t dt_bytes(MPI_Datatype type, int count)
{
    int sz;
    T_CHECK_MPI(MPI_Type_size(type, &sz));
    return (size_t)sz * (size_t)count;
}

/* One allocation big enough for `count` elements of `type`, honouring lb/true_lb. */
static T_UNUSED dt_side dt_side_plain(MPI_Datatype type, int count)
{
    dt_side s;
    MPI_Aint lb, ext, tlb, text;
    size_t len;
    memset(&s, 0, sizeof(s));
    T_CHECK_MPI(MPI_Type_get_extent(type, &lb, &ext));
    T_CHECK_MPI(MPI_Type_get_true_extent(type, &tlb, &text));
    T_ASSERT(ext >= 0, "negative extents not supported by the test harness");
    len = count ? (size_t)((MPI_Aint)(count - 1) * ext + text) : 0;
    s.type = type;
    s.count = count;
    s.nseg = 1;
    s.seglen[0] = len;
    s.seg[0] = t_malloc(len + 1);
    s.buf = s.seg[0] - tlb;
    s.owns = 1;
    return s;
}

static T_UNUSED void dt_side_free(dt_side *s)
{
    if (s->owns)
        for (int i = 0; i < s->nseg; i++)
            free(s->seg[i]);
    s->nseg = 0;
}

static T_UNUSED void dt_side_set(dt_side *s, uint8_t v)
{
    for (int i = 0; i < s->nseg; i++)
        memset(s->seg[i], v, s->seglen[i]);
}

/* Writes the stream of `seed` into the layout (send side). Gaps get noise. */
static T_UNUSED void dt_side_fill(dt_side *s, uint64_t seed)
{
    size_t n = dt_bytes(s->type, s->count);
    uint8_t *stream = t_malloc(n);
    int pos = 0;
    for (int i = 0; i < s->nseg; i++)
        t_fill(s->seg[i], s->seglen[i], seed ^ 0xdeadbeefull ^ (uint64_t)i);
    t_fill(stream, n, seed);
    T_CHECK_MPI(MPI_Unpack(stream, (int)n, &pos, s->buf, s->count, s->type, MPI_COMM_SELF));
    T_ASSERT((size_t)pos == n, "MPI_Unpack consumed %d of %zu bytes", pos, n);
    free(stream);
}

/* Compares received memory against the oracle (receive side); see the header comment. */
static T_UNUSED void dt_side_check(dt_side *s, uint64_t seed, const char *what)
{
    size_t n = dt_bytes(s->type, s->count);
    uint8_t *stream = t_malloc(n), *snap[DT_MAXSEG];
    int pos = 0;
    char w[400];
    for (int i = 0; i < s->nseg; i++) {
        snap[i] = t_malloc(s->seglen[i]);
        memcpy(snap[i], s->seg[i], s->seglen[i]);
    }
    dt_side_set(s, DT_GUARD);
    t_fill(stream, n, seed);
    T_CHECK_MPI(MPI_Unpack(stream, (int)n, &pos, s->buf, s->count, s->type, MPI_COMM_SELF));
    for (int i = 0; i < s->nseg; i++) {
        snprintf(w, sizeof(w), "%s (receive memory segment %d, offsets are within it)", what, i);
        t_check_mem(snap[i], s->seg[i], s->seglen[i], w);
        /* restore what was received, in case the caller looks again */
        memcpy(s->seg[i], snap[i], s->seglen[i]);
        free(snap[i]);
    }
    free(stream);
}

#endif
