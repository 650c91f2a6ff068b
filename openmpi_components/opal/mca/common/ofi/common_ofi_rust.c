/*
 * ompi-ofi: the common OFI component. Everything (common state, BTL, MTL) is Rust,
 * in ompi_ofi_rust.o (see Makefile.am); this file only ties the library to that
 * object: referencing both component structs keeps them (and the Rust code they
 * reach) in libmca_common_ofi / libopen-pal whatever the linker's flags.
 */
#include "opal_config.h"

#include "opal/mca/mca.h"

extern const mca_base_component_t mca_btl_ofi_component;
extern const mca_base_component_t mca_mtl_ofi_component;

static const void *const ompi_ofi_components[] __attribute__((used)) = {
    &mca_btl_ofi_component,
    &mca_mtl_ofi_component,
};
