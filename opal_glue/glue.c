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
