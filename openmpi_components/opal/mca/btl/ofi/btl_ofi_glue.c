/*
 * ompi-ofi: the OFI BTL component. mca_btl_ofi_component is defined by the Rust code
 * in libmca_common_ofi (DSO build) or libopen-pal (--disable-dlopen); this reference
 * makes mca_btl_ofi.so depend on that library even when linked with --as-needed.
 */
#include "opal_config.h"

#include "opal/mca/btl/btl.h"

extern const mca_btl_base_component_3_0_0_t mca_btl_ofi_component;

static const void *const ompi_ofi_btl_component_ref __attribute__((used)) = &mca_btl_ofi_component;
