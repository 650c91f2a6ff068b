/*
 * ompi-ofi: the OFI MTL component. mca_mtl_ofi_component is defined by the Rust code
 * in libmca_common_ofi (DSO build) or libopen-pal (--disable-dlopen); this reference
 * makes mca_mtl_ofi.so depend on that library even when linked with --as-needed.
 */
#include "ompi_config.h"

#include "ompi/mca/mtl/mtl.h"

extern const mca_mtl_base_component_2_0_0_t mca_mtl_ofi_component;

static const void *const ompi_ofi_mtl_component_ref __attribute__((used)) = &mca_mtl_ofi_component;
