/*
 * One-sided operations on a dynamic window whose target keeps attaching and
 * detaching memory below the region they address.
 *
 * Rank 0 attaches one page (the "top" page: a counter and a pattern) and publishes its
 * address; then, until every origin is done, it attaches and detaches a page below it
 * in a loop. osc rdma keeps each process's attached regions in a table sorted by
 * address, so every attach of the lower page moves the top page's entry up by one and
 * every detach moves it back. Every other rank, meanwhile, adds to the counter
 * (MPI_Fetch_and_op), compares and swaps a second word (MPI_Compare_and_swap), and
 * reads the pattern (MPI_Get), flushing each.
 *
 * What it checks: every operation returns MPI_SUCCESS (the window's error handler is
 * MPI_ERRORS_RETURN), every get reads the pattern, every fetch returns a value in
 * range, and at the end the counter holds exactly the number of additions made.
 *
 * Why: in Open MPI 4.1.4, osc rdma looks the target's region up under a lock but
 * hands the BTL a pointer into that table after releasing it; a BTL that registers
 * memory then reads the handle of whichever region the table holds there by then
 * (src/btl/resolve.rs). MPICH's rma/linked_list_lockall met it over tcp.
 *
 *   dyn_attach [--ops N]   operations per origin (default 3000; --quick 600)
 */
#include "common.h"

#define PAGE_WORDS 512 /* 4 KiB of uint64_t */
#define PATTERN_WORDS 8

int main(int argc, char **argv)
{
    t_init(&argc, &argv, "dyn_attach");
    if (t_size < 2) {
        t_fail("needs at least 2 ranks");
    }
    long long nops = t_opt_long("ops", NULL, t_quick ? 600 : 3000);
    long page = sysconf(_SC_PAGESIZE);
    if (page < (long)(PAGE_WORDS * sizeof(uint64_t))) {
        page = PAGE_WORDS * sizeof(uint64_t);
    }

    MPI_Win win;
    t_section("create the dynamic window");
    T_CHECK_MPI(MPI_Win_create_dynamic(MPI_INFO_NULL, MPI_COMM_WORLD, &win));
    T_CHECK_MPI(MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN));

    /* Two pages, the lower one first: the top page's address is above the lower's. */
    uint64_t *pages = NULL;
    if (posix_memalign((void **)&pages, (size_t)page, 2 * (size_t)page) != 0) {
        t_fail("posix_memalign of 2 pages failed");
    }
    memset(pages, 0, 2 * (size_t)page);
    uint64_t *low = pages;
    uint64_t *top = (uint64_t *)((char *)pages + page);
    /* top[0]: the counter; top[1]: the compare-and-swap word; top[8..16): the pattern. */
    for (int i = 0; i < PATTERN_WORDS; i++) {
        top[8 + i] = t_word(t_seed(7, 0, 0, 0), (size_t)i);
    }
    MPI_Aint top_addr = 0;
    if (t_rank == 0) {
        T_CHECK_MPI(MPI_Win_attach(win, top, (MPI_Aint)page));
        T_CHECK_MPI(MPI_Get_address(top, &top_addr));
    }
    T_CHECK_MPI(MPI_Bcast(&top_addr, 1, MPI_AINT, 0, MPI_COMM_WORLD));

    t_section("operations while the target attaches and detaches below");
    T_CHECK_MPI(MPI_Win_lock_all(0, win));
    long long toggles = 0;
    uint64_t one = 1, fetched = 0;
    if (t_rank == 0) {
        /* Until every origin said it is done (a zero-byte message each). */
        int done = 0;
        while (done < t_size - 1) {
            T_CHECK_MPI(MPI_Win_attach(win, low, (MPI_Aint)page));
            T_CHECK_MPI(MPI_Win_detach(win, low));
            toggles++;
            int flag = 0;
            MPI_Status st;
            T_CHECK_MPI(MPI_Iprobe(MPI_ANY_SOURCE, 99, MPI_COMM_WORLD, &flag, &st));
            if (flag) {
                T_CHECK_MPI(MPI_Recv(NULL, 0, MPI_BYTE, st.MPI_SOURCE, 99, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
                done++;
            }
            if ((toggles & 255) == 0) {
                t_touch();
            }
        }
    } else {
        uint64_t got[PATTERN_WORDS];
        uint64_t mine = (uint64_t)t_rank, old = 0;
        for (long long k = 0; k < nops; k++) {
            switch (k % 3) {
            case 0:
                T_CHECK_MPI(MPI_Fetch_and_op(&one, &fetched, MPI_UINT64_T, 0, top_addr, MPI_SUM, win));
                T_CHECK_MPI(MPI_Win_flush(0, win));
                if (fetched >= (uint64_t)nops * (uint64_t)(t_size - 1)) {
                    t_fail("operation %lld: the counter read %llu, more than all additions", k,
                           (unsigned long long)fetched);
                }
                break;
            case 1:
                /* Swap our rank in when the word is 0, then back to 0. */
                T_CHECK_MPI(MPI_Compare_and_swap(&mine, &(uint64_t){ 0 }, &old, MPI_UINT64_T, 0,
                                                 top_addr + (MPI_Aint)sizeof(uint64_t), win));
                T_CHECK_MPI(MPI_Win_flush(0, win));
                if (old == 0) {
                    uint64_t zero = 0, back = 0;
                    T_CHECK_MPI(MPI_Compare_and_swap(&zero, &mine, &back, MPI_UINT64_T, 0,
                                                     top_addr + (MPI_Aint)sizeof(uint64_t), win));
                    T_CHECK_MPI(MPI_Win_flush(0, win));
                    if (back != mine) {
                        t_fail("operation %lld: the swap word held %llu, not our %llu", k,
                               (unsigned long long)back, (unsigned long long)mine);
                    }
                } else if (old >= (uint64_t)t_size) {
                    t_fail("operation %lld: the swap word held %llu, not a rank", k, (unsigned long long)old);
                }
                break;
            default:
                memset(got, 0, sizeof(got));
                T_CHECK_MPI(MPI_Get(got, PATTERN_WORDS, MPI_UINT64_T, 0, top_addr + 8 * (MPI_Aint)sizeof(uint64_t),
                                    PATTERN_WORDS, MPI_UINT64_T, win));
                T_CHECK_MPI(MPI_Win_flush(0, win));
                t_check_mem(got, &top[8], sizeof(got), "pattern read from rank 0's top page");
                break;
            }
            if ((k & 63) == 0) {
                t_touch();
            }
        }
        T_CHECK_MPI(MPI_Send(NULL, 0, MPI_BYTE, 0, 99, MPI_COMM_WORLD));
    }
    T_CHECK_MPI(MPI_Win_unlock_all(win));
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));

    t_section("check the counter");
    if (t_rank == 0) {
        long long adds = (nops + 2) / 3; /* operations 0, 3, 6, ... of each origin */
        uint64_t want = (uint64_t)adds * (uint64_t)(t_size - 1);
        if (top[0] != want) {
            t_fail("the counter holds %llu after %llu additions", (unsigned long long)top[0],
                   (unsigned long long)want);
        }
        if (top[1] != 0) {
            t_fail("the swap word holds %llu at the end, not 0", (unsigned long long)top[1]);
        }
        if (t_verbose) {
            printf("dyn_attach: %lld attach/detach pairs during %lld operations per origin\n", toggles, nops);
        }
        T_CHECK_MPI(MPI_Win_detach(win, top));
    }
    T_CHECK_MPI(MPI_Win_free(&win));
    free(pages);
    return t_pass();
}
