/* Two-sided traffic through ob1: sizes across eager/rendezvous/pipeline, a
 * non-contiguous datatype, any-source receives, and collectives. Checks every byte. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int errors = 0;
#define CHECK(c, ...) do { if (!(c)) { errors++; fprintf(stderr, __VA_ARGS__); } } while (0)

static unsigned char pat(int src, size_t i, int round) { return (unsigned char)(src * 31 + i * 7 + round * 13); }

int main(int argc, char **argv)
{
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    size_t sizes[] = {0, 1, 7, 64, 1000, 4096, 8192, 8193, 65536, 65537, 300000, 1 << 20, 4 << 20};
    int nsizes = sizeof(sizes) / sizeof(sizes[0]);
    unsigned char *sbuf = malloc(4 << 20), *rbuf = malloc(4 << 20);
    for (int round = 0; round < 3; round++) {
        for (int s = 0; s < nsizes; s++) {
            size_t n = sizes[s];
            int right = (rank + 1) % size, left = (rank + size - 1) % size;
            for (size_t i = 0; i < n; i++) sbuf[i] = pat(rank, i, round);
            memset(rbuf, 0xee, n);
            MPI_Request rq[2];
            MPI_Irecv(rbuf, (int) n, MPI_BYTE, left, s, MPI_COMM_WORLD, &rq[0]);
            if (round == 1) MPI_Issend(sbuf, (int) n, MPI_BYTE, right, s, MPI_COMM_WORLD, &rq[1]);
            else MPI_Isend(sbuf, (int) n, MPI_BYTE, right, s, MPI_COMM_WORLD, &rq[1]);
            MPI_Waitall(2, rq, MPI_STATUSES_IGNORE);
            for (size_t i = 0; i < n; i++) {
                if (rbuf[i] != pat(left, i, round)) { CHECK(0, "rank %d: size %zu byte %zu wrong\n", rank, n, i); break; }
            }
        }
    }
    /* non-contiguous: vector of ints */
    {
        int count = 50000;
        int *v = malloc(sizeof(int) * count * 2), *w = calloc(count * 2, sizeof(int));
        MPI_Datatype vec;
        MPI_Type_vector(count, 1, 2, MPI_INT, &vec);
        MPI_Type_commit(&vec);
        for (int i = 0; i < count * 2; i++) v[i] = rank * 1000000 + i;
        int right = (rank + 1) % size, left = (rank + size - 1) % size;
        MPI_Sendrecv(v, 1, vec, right, 99, w, 1, vec, left, 99, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        for (int i = 0; i < count * 2; i++) {
            int want = (i % 2 == 0) ? left * 1000000 + i : 0;
            if (w[i] != want) { CHECK(0, "rank %d: vector elem %d = %d want %d\n", rank, i, w[i], want); break; }
        }
        MPI_Type_free(&vec);
        free(v); free(w);
    }
    /* any source */
    if (rank == 0) {
        int seen = 0;
        for (int i = 1; i < size; i++) {
            int x; MPI_Status st;
            MPI_Recv(&x, 1, MPI_INT, MPI_ANY_SOURCE, 5, MPI_COMM_WORLD, &st);
            CHECK(x == st.MPI_SOURCE * 3, "any-source value\n");
            seen++;
        }
    } else {
        int x = rank * 3;
        MPI_Send(&x, 1, MPI_INT, 0, 5, MPI_COMM_WORLD);
    }
    /* collectives */
    {
        int n = 100000;
        long *a = malloc(sizeof(long) * n), *b = malloc(sizeof(long) * n);
        for (int i = 0; i < n; i++) a[i] = rank + i;
        MPI_Allreduce(a, b, n, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        for (int i = 0; i < n; i++) {
            long want = (long) size * i + (long) size * (size - 1) / 2;
            if (b[i] != want) { CHECK(0, "allreduce %d\n", i); break; }
        }
        int per = 20000;
        int *sa = malloc(sizeof(int) * per * size), *ra = malloc(sizeof(int) * per * size);
        for (int i = 0; i < per * size; i++) sa[i] = rank * 7 + i;
        MPI_Alltoall(sa, per, MPI_INT, ra, per, MPI_INT, MPI_COMM_WORLD);
        for (int p = 0; p < size; p++)
            for (int i = 0; i < per; i++)
                if (ra[p * per + i] != p * 7 + rank * per + i) { CHECK(0, "alltoall\n"); p = size; break; }
        char *bc = malloc(1 << 20);
        if (rank == 0) for (int i = 0; i < (1 << 20); i++) bc[i] = (char) (i * 3);
        MPI_Bcast(bc, 1 << 20, MPI_CHAR, 0, MPI_COMM_WORLD);
        for (int i = 0; i < (1 << 20); i++) if (bc[i] != (char) (i * 3)) { CHECK(0, "bcast\n"); break; }
        MPI_Barrier(MPI_COMM_WORLD);
        free(a); free(b); free(sa); free(ra); free(bc);
    }
    int total;
    MPI_Allreduce(&errors, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("%s: %d errors\n", total ? "FAIL" : "PASS", total);
    free(sbuf); free(rbuf);
    MPI_Finalize();
    return total ? 1 : 0;
}
