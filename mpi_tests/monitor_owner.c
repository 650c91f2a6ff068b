/*
 * monitor_owner: which memory monitor did the job choose, and who owns the memory
 * functions at the end of a job that moved data and released memory?
 *
 * Every rank exchanges 1 MiB messages with its ring neighbours from freshly mmap'd
 * buffers (checked, then unmapped) and frees large malloc blocks, then:
 *   1. reads the read-only MPI_T variable opal_common_ofi_memory_monitor_status
 *      ("<monitor>; munmap: <owner>", published by our components at setup);
 *   2. runs its own patch check, independent of the library: for mmap, munmap,
 *      mremap, madvise, shmat, shmdt and brk (the functions both Open MPI's patcher and
 *      libfabric's memhooks intercept) it reads the first 13 bytes; the x86-64
 *      trampoline `49 bb <imm64> 41 ff e3` means "patched", and dladdr() of the jump
 *      target names the patcher (libopen-pal / mca_memory_patcher: Open MPI; libfabric).
 * FAIL when:
 *   - libfabric owns any of those functions while Open MPI's patcher owns any of them
 *     (two patchers in one process: one of them misses releases), always;
 *   - --expect-monitor M: the status does not start with "M;";
 *   - --expect-patcher yes|no: Open MPI owns munmap (yes) / owns none of them (no), and
 *     the status names the same owner of munmap as this check;
 *   - the status variable is missing (our components are not loaded).
 * Rank 0 prints one line: INFO ... status=<status> owners=<fn>:<owner>,...
 */
#include "common.h"
#include <dlfcn.h>
#include <sys/mman.h>

static const char *fns[] = { "munmap", "mmap", "mremap", "madvise", "shmat", "shmdt", "brk" };
#define NFN ((int)(sizeof(fns) / sizeof(fns[0])))

enum owner { O_UNPATCHED, O_OMPI, O_LIBFABRIC, O_OTHER, O_UNKNOWN };
static const char *oname[] = { "unpatched", "openmpi", "libfabric", "other", "unknown" };

static enum owner owner_of(const char *fn, char *obj, size_t objlen)
{
    snprintf(obj, objlen, "-");
    void *f = dlsym(RTLD_DEFAULT, fn);
    if (!f)
        return O_UNKNOWN;
    unsigned char b[13];
    memcpy(b, f, sizeof(b)); /* text is readable; a function is longer than 13 bytes */
    if (!(b[0] == 0x49 && b[1] == 0xbb && b[10] == 0x41 && b[11] == 0xff && b[12] == 0xe3))
        return O_UNPATCHED;
    uint64_t target;
    memcpy(&target, b + 2, 8);
    Dl_info di;
    if (!dladdr((void *)(uintptr_t)target, &di) || !di.dli_fname)
        return O_OTHER;
    snprintf(obj, objlen, "%s", di.dli_fname);
    if (strstr(di.dli_fname, "libfabric"))
        return O_LIBFABRIC;
    if (strstr(di.dli_fname, "libopen-pal") || strstr(di.dli_fname, "mca_memory_patcher"))
        return O_OMPI;
    return O_OTHER;
}

static int read_status(char *buf, size_t len)
{
    int idx, cnt, prov;
    MPI_T_cvar_handle h;
    char tmp[1024] = "";
    buf[0] = 0;
    T_CHECK_MPI(t_mpit_init(&prov));
    int ok = MPI_T_cvar_get_index("opal_common_ofi_memory_monitor_status", &idx) == MPI_SUCCESS &&
             MPI_T_cvar_handle_alloc(idx, NULL, &h, &cnt) == MPI_SUCCESS;
    if (ok) {
        MPI_T_cvar_read(h, tmp);
        MPI_T_cvar_handle_free(&h);
        snprintf(buf, len, "%s", tmp);
    }
    MPI_T_finalize();
    return ok ? 0 : -1;
}

int main(int argc, char **argv)
{
    t_init(&argc, &argv, "monitor_owner");
    const char *want_mon = t_opt_str("expect-monitor", NULL);
    const char *want_patcher = t_opt_str("expect-patcher", NULL);
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    size_t n = 1 << 20;

    t_section("traffic with releases");
    for (int it = 0; it < 20; it++) {
        uint8_t *s = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        uint8_t *r = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (s == MAP_FAILED || r == MAP_FAILED)
            t_fail("mmap: %s", strerror(errno));
        t_fill(s, n, t_seed(t_rank, it, 5, 0));
        T_CHECK_MPI(MPI_Sendrecv(s, (int)n, MPI_BYTE, right, it, r, (int)n, MPI_BYTE, left, it, MPI_COMM_WORLD,
                                 MPI_STATUS_IGNORE));
        t_check(r, n, t_seed(left, it, 5, 0), "1 MiB ring exchange");
        munmap(s, n);
        munmap(r, n);
        free(t_malloc(4 << 20));
    }

    t_section("status and patch check");
    char status[1024];
    if (read_status(status, sizeof(status)))
        t_fail("MPI_T variable opal_common_ofi_memory_monitor_status not found: are our components loaded?");
    enum owner own[NFN];
    char objs[NFN][256], line[2048];
    size_t off = 0;
    int any_ompi = 0, any_lf = 0;
    for (int i = 0; i < NFN; i++) {
        own[i] = owner_of(fns[i], objs[i], sizeof(objs[i]));
        any_ompi |= own[i] == O_OMPI;
        any_lf |= own[i] == O_LIBFABRIC;
        off += (size_t)snprintf(line + off, sizeof(line) - off, "%s%s:%s", i ? "," : "", fns[i], oname[own[i]]);
    }
    t_info("status=%s owners=%s", status, line);
    if (any_ompi && any_lf)
        t_fail("two patchers: libfabric and Open MPI both own memory functions (%s)", line);
    if (want_mon) {
        char pre[64];
        snprintf(pre, sizeof(pre), "%s;", want_mon);
        if (strncmp(status, pre, strlen(pre)) != 0)
            t_fail("memory monitor status '%s' does not start with '%s'", status, pre);
    }
    if (want_patcher) {
        int yes = strcmp(want_patcher, "yes") == 0;
        if (yes && own[0] != O_OMPI)
            t_fail("Open MPI's patcher should own munmap; it is %s (%s)", oname[own[0]], objs[0]);
        if (!yes && any_ompi)
            t_fail("Open MPI's patcher is disabled but owns memory functions (%s)", line);
        const char *st_owner = strstr(status, "munmap: ");
        if (!st_owner)
            t_fail("status '%s' does not name the owner of munmap", status);
        st_owner += 8;
        int st_ompi = strncmp(st_owner, "Open MPI", 8) == 0, st_unp = strncmp(st_owner, "unpatched", 9) == 0;
        if ((own[0] == O_OMPI) != st_ompi || (own[0] == O_UNPATCHED) != st_unp)
            t_fail("status says munmap: %s, this check finds %s", st_owner, oname[own[0]]);
    }
    return t_pass();
}
