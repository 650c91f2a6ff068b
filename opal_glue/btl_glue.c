/*
 * C glue of the OFI BTL: Open MPI macros the BTL needs. One-line forwards only.
 */
#include "opal_config.h"
#include "opal/mca/pmix/pmix.h"
#include "opal/util/proc.h"

/* OPAL_MODEX_RECV_VALUE of the job size (the BTL lives in opal and cannot ask libmpi);
 * 0 when unknown. */
uint32_t ompi_ofi_btl_glue_job_size(void)
{
    int rc;
    uint32_t size = 0, *ptr = &size;
    opal_process_name_t job = OPAL_PROC_MY_NAME;
    job.vpid = OPAL_VPID_WILDCARD;
    OPAL_MODEX_RECV_VALUE_OPTIONAL(rc, OPAL_PMIX_JOB_SIZE, &job, &ptr, OPAL_UINT32);
    return OPAL_SUCCESS == rc ? size : 0;
}
