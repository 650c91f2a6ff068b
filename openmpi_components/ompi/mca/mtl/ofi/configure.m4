# -*- shell-script -*-
#
# ompi-ofi: the OFI MTL. Its code is Rust and lives in opal/mca/common/ofi's object
# (one copy of the common state per process); this directory only makes the
# component known to Open MPI (mca_mtl_ofi.so, or a static component of libmpi).
#
# The MTL keeps its endpoint in ompi_proc_t's proc_endpoints[] like the C MTL, so
# the MTL endpoint tag must exist (this changes ompi_proc_t, which the Rust bindings
# read from this very build tree).
AC_DEFUN([MCA_ompi_mtl_ofi_POST_CONFIG], [
    AS_IF([test "$1" = "1"], [OMPI_REQUIRE_ENDPOINT_TAG([MTL])])
])dnl

# MCA_ompi_mtl_ofi_CONFIG([action-if-can-compile],
#                         [action-if-cant-compile])
# ------------------------------------------------
AC_DEFUN([MCA_ompi_mtl_ofi_CONFIG],[
    AC_CONFIG_FILES([ompi/mca/mtl/ofi/Makefile])

    OPAL_CHECK_OFI

    AS_IF([test "$opal_ofi_happy" = "yes" && test "$opal_common_ofi_happy" = "yes"],
          [$1],
          [$2])
])dnl
