# -*- shell-script -*-
#
# ompi-ofi: the OFI BTL. Its code is Rust and lives in opal/mca/common/ofi's object
# (one copy of the common state per process); this directory only makes the
# component known to Open MPI (mca_btl_ofi.so, or a static component in libopen-pal).
#
# MCA_opal_btl_ofi_CONFIG([action-if-can-compile],
#                         [action-if-cant-compile])
# ------------------------------------------------
AC_DEFUN([MCA_opal_btl_ofi_CONFIG],[
    AC_CONFIG_FILES([opal/mca/btl/ofi/Makefile])

    OPAL_CHECK_OFI

    AS_IF([test "$opal_ofi_happy" = "yes" && test "$opal_common_ofi_happy" = "yes"],
          [$1],
          [$2])
])dnl
