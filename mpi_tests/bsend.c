/*
 * bsend: buffered sends whose messages wait for their receiver: MPI_Bsend and
 * MPI_Ibsend (bsend_persist: MPI_Bsend_init started again and again), of MPI_INT
 * (4 bytes an element), of a type with gaps and of MPI_BYTE, at sizes from one
 * element to 1 MiB (4 MiB without --quick, 64 MiB with --big), 4 messages each (2 of
 * 64 MiB).
 *
 * Every rank sends to the next rank and receives from the one before, and the
 * receiver posts its receives only after a barrier that the sender reaches once all
 * of its buffered sends have returned: a buffered send must complete without its
 * receiver. The sender changes its buffer after every send (and before each new start
 * of a persistent one); each message must arrive with the contents the buffer had
 * when its send was called or started.
 *
 * bsend_persist is kept apart because pml cm (Open MPI 4.1.4) gets a persistent
 * buffered send wrong whatever the MTL (see README.md): on every start after the
 * first it packs from the attached-buffer copy of the previous start instead of the
 * user's buffer (the message carries old contents), and a start while the MTL has
 * not completed the previous transfer makes a new request with the packed size in
 * bytes as the element count (4 times the data of an MPI_INT message, read past the
 * user's buffer: a segfault in opal_convertor_pack). MPI_BYTE messages of one start
 * do not show either, which is why p2p's Bsend/Ibsend modes never did.
 */
#include "common.h"

static MPI_Comm comm;

enum form { F_BSEND, F_IBSEND, F_PERSIST, NFORMS };
static const char *form_name[NFORMS] = { "MPI_Bsend", "MPI_Ibsend", "MPI_Bsend_init+MPI_Start" };

enum kind { K_INT, K_VECTOR, K_BYTE, NKINDS };
static const char *kind_name[NKINDS] = { "MPI_INT", "vector of MPI_INT (2 of every 3)", "MPI_BYTE" };

/* One message of `bytes` bytes of data in type `k`: the element count, the buffer
 * length (with the vector's gaps) and the datatype. */
static void shape(enum kind k, size_t bytes, int *count, size_t *buflen, MPI_Datatype *type,
                  MPI_Datatype vec)
{
    switch (k) {
    case K_INT:
        *count = (int)(bytes / 4);
        *buflen = (size_t)*count * 4;
        *type = MPI_INT;
        break;
    case K_VECTOR:
        /* vec: 2 ints of every 3, extent 12 bytes, 8 bytes of data */
        *count = (int)(bytes / 8);
        *buflen = (size_t)*count * 12;
        *type = vec;
        break;
    default:
        *count = (int)bytes;
        *buflen = bytes;
        *type = MPI_BYTE;
        break;
    }
}

static uint64_t seed_of(int sender, enum form f, enum kind k, size_t bytes, int i)
{
    return t_seed(70 + (uint64_t)f, (uint64_t)sender, bytes, (uint64_t)(k * 1000 + i));
}

static void one(enum form f, enum kind k, size_t bytes, int nmsg, MPI_Datatype vec)
{
    int peer = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    int count, tag = 70 + (int)f;
    size_t buflen;
    MPI_Datatype type;
    shape(k, bytes, &count, &buflen, &type, vec);
    if (count == 0)
        return;
    t_section("%s of %d x %s (%zu bytes of data), %d messages before the receiver posts",
              form_name[f], count, kind_name[k], bytes, nmsg);

    /* The attached buffer holds every message of this case at once. */
    int packed = 0;
    T_CHECK_MPI(MPI_Pack_size(count, type, comm, &packed));
    size_t attach_len = (size_t)nmsg * ((size_t)packed + MPI_BSEND_OVERHEAD) + 64;
    void *attach = t_malloc(attach_len);
    T_CHECK_MPI(MPI_Buffer_attach(attach, (int)attach_len));

    uint8_t *sbuf = t_malloc(buflen), *rbuf = t_malloc(buflen + 64);
    MPI_Request reqs[4], pr = MPI_REQUEST_NULL;
    if (f == F_PERSIST)
        T_CHECK_MPI(MPI_Bsend_init(sbuf, count, type, peer, tag, comm, &pr));
    for (int i = 0; i < nmsg; i++) {
        /* The sent contents of message i; the vector's gaps hold other bytes. */
        memset(sbuf, 0x5a, buflen);
        t_fill(sbuf, buflen, seed_of(t_rank, f, k, bytes, i));
        switch (f) {
        case F_BSEND:
            T_CHECK_MPI(MPI_Bsend(sbuf, count, type, peer, tag, comm));
            break;
        case F_IBSEND:
            T_CHECK_MPI(MPI_Ibsend(sbuf, count, type, peer, tag, comm, &reqs[i]));
            break;
        default:
            T_CHECK_MPI(MPI_Start(&pr));
            T_CHECK_MPI(MPI_Wait(&pr, MPI_STATUS_IGNORE));
            break;
        }
        if (f == F_IBSEND)
            T_CHECK_MPI(MPI_Wait(&reqs[i], MPI_STATUS_IGNORE));
        /* The send copied the data: what the buffer holds now must not matter. */
        memset(sbuf, 0xc3, buflen);
    }
    T_CHECK_MPI(MPI_Barrier(comm));

    /* The expected contents of message i, through the same datatype. */
    uint8_t *want = t_malloc(buflen + 64);
    for (int i = 0; i < nmsg; i++) {
        MPI_Status st;
        memset(rbuf, 0xee, buflen + 64);
        t_status_init(&st);
        T_CHECK_MPI(MPI_Recv(rbuf, count, type, from, tag, comm, &st));
        t_check_status(&st, from, tag, type, count, "buffered message");
        memset(want, 0xee, buflen + 64);
        {
            /* build what arrives: the sender's fill at the type's data bytes, 0xee in
             * the gaps (the receive leaves them alone) */
            uint8_t *full = t_malloc(buflen);
            memset(full, 0x5a, buflen);
            t_fill(full, buflen, seed_of(from, f, k, bytes, i));
            if (k == K_VECTOR) {
                for (int e = 0; e < count; e++)
                    memcpy(want + (size_t)e * 12, full + (size_t)e * 12, 8);
            } else {
                memcpy(want, full, buflen);
            }
            free(full);
        }
        t_check_mem(rbuf, want, buflen, "buffered message");
        t_check_const(rbuf + buflen, 64, 0xee, "guard after the receive buffer");
    }
    if (f == F_PERSIST)
        T_CHECK_MPI(MPI_Request_free(&pr));
    {
        void *a;
        int n;
        T_CHECK_MPI(MPI_Buffer_detach(&a, &n));
        T_ASSERT(a == attach, "MPI_Buffer_detach returned another buffer");
    }
    T_CHECK_MPI(MPI_Barrier(comm));
    free(attach);
    free(sbuf);
    free(rbuf);
    free(want);
}

int main(int argc, char **argv)
{
    size_t sizes[8];
    int n = 0;
    MPI_Datatype vec;
#ifdef BSEND_PERSIST
    enum form forms[] = { F_PERSIST };
    t_init(&argc, &argv, "bsend_persist");
#else
    enum form forms[] = { F_BSEND, F_IBSEND };
    t_init(&argc, &argv, "bsend");
#endif
    sizes[n++] = 8;
    sizes[n++] = t_inject() + 8;
    sizes[n++] = 16384;
    sizes[n++] = 65536;
    sizes[n++] = 1 << 20;
    if (!t_quick)
        sizes[n++] = 4 << 20;
    if (t_opt_flag("big"))
        sizes[n++] = 64 << 20;
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    {
        MPI_Datatype two;
        T_CHECK_MPI(MPI_Type_contiguous(2, MPI_INT, &two));
        T_CHECK_MPI(MPI_Type_create_resized(two, 0, 12, &vec));
        T_CHECK_MPI(MPI_Type_commit(&vec));
        T_CHECK_MPI(MPI_Type_free(&two));
    }
    for (size_t f = 0; f < sizeof(forms) / sizeof(forms[0]); f++)
        for (int k = 0; k < NKINDS; k++)
            for (int s = 0; s < n; s++)
                one(forms[f], (enum kind)k, sizes[s], sizes[s] > (4 << 20) ? 2 : 4, vec);
    T_CHECK_MPI(MPI_Type_free(&vec));
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
