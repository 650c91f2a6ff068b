/*
 * C glue for what Rust cannot reach in Open MPI 4.1: macros and static inline
 * helpers. One-line forwards only; no logic lives here.
 */
#include "opal_config.h"
#include "opal/mca/pmix/pmix.h"
#include "opal/mca/base/base.h"
#include "opal/util/output.h"

/* OPAL_MODEX_SEND with global scope: publish this process's blob for a component. */
int ompi_ofi_glue_modex_send(const mca_base_component_t *component, const void *data,
                             size_t size)
{
    int rc;
    OPAL_MODEX_SEND(rc, OPAL_PMIX_GLOBAL, component, (void *) data, size);
    return rc;
}

/* OPAL_MODEX_RECV: fetch a peer's blob; *data is malloc'ed and freed by the caller with free(). */
int ompi_ofi_glue_modex_recv(const mca_base_component_t *component,
                             const opal_process_name_t *peer, void **data, size_t *size)
{
    int rc;
    uint8_t *buf = NULL;
    size_t sz = 0;
    OPAL_MODEX_RECV(rc, component, peer, &buf, &sz);
    *data = buf;
    *size = sz;
    return rc;
}

/* The C allocator's free, for memory that Open MPI hands over. */
void ompi_ofi_glue_free(void *p)
{
    free(p);
}

/* OBJ_RELEASE on any opal object (an MCA enumerator, for example). */
void ompi_ofi_glue_obj_release(void *obj)
{
    opal_object_t *o = (opal_object_t *) obj;
    OBJ_RELEASE(o);
}

/* ---- MTL helpers: static inline lookups of Open MPI 4.1 ---- */
#include "ompi/communicator/communicator.h"
#include "ompi/proc/proc.h"
#include "ompi/message/message.h"
#include "opal/datatype/opal_convertor.h"
#include "opal/datatype/opal_datatype.h"

/* ompi_comm_peer_lookup: the proc of `rank` in the communicator's remote group. */
ompi_proc_t *ompi_ofi_glue_comm_peer(ompi_communicator_t *comm, int rank)
{
    return ompi_comm_peer_lookup(comm, rank);
}

/* ompi_comm_lookup: the communicator of context id `cid`, or NULL. */
ompi_communicator_t *ompi_ofi_glue_comm_lookup(uint32_t cid)
{
    return ompi_comm_lookup(cid);
}

/* The size of the communicator's remote group. */
int ompi_ofi_glue_comm_remote_size(ompi_communicator_t *comm)
{
    return ompi_comm_remote_size(comm);
}

/* What the MTL needs to know about a convertor: packed size, whether packing needs a
 * separate buffer, and, when the data is one contiguous block, where it starts.
 * pml cm builds some send convertors for contiguous data by hand (thin requests and
 * blocking sends), with pBaseBuf already moved to the datatype's true lower bound and
 * neither CONVERTOR_SEND nor CONVERTOR_RECV set: there the data starts at pBaseBuf.
 * Prepared convertors (receives, persistent and buffered sends) start at the true
 * lower bound, which carries a displacement, or the absolute address with MPI_BOTTOM. */
void ompi_ofi_glue_convertor_info(opal_convertor_t *conv, size_t *packed_size,
                                  int *contiguous, char **contig_start, int *need_buffers)
{
    opal_convertor_get_packed_size(conv, packed_size);
    *need_buffers = opal_convertor_need_buffers(conv) ? 1 : 0;
    *contiguous = 0;
    *contig_start = NULL;
    if (NULL != conv->pDesc && !(conv->flags & CONVERTOR_COMPLETED) &&
        opal_datatype_is_contiguous_memory_layout(conv->pDesc, conv->count)) {
        *contiguous = 1;
        if (conv->flags & (CONVERTOR_SEND | CONVERTOR_RECV)) {
            opal_convertor_get_current_pointer(conv, (void **) contig_start);
        } else {
            *contig_start = (char *) conv->pBaseBuf;
        }
    }
}

/* ompi_message_alloc: a message handle for MPI_Mprobe/Improbe. */
ompi_message_t *ompi_ofi_glue_message_alloc(void)
{
    return ompi_message_alloc();
}

/* ompi_message_return: give a message handle back. */
void ompi_ofi_glue_message_return(ompi_message_t *msg)
{
    ompi_message_return(msg);
}

/* The process name of a proc (for the modex). */
const opal_process_name_t *ompi_ofi_glue_proc_name(ompi_proc_t *proc)
{
    return &proc->super.proc_name;
}
