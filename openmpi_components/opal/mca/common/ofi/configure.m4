# -*- shell-script -*-
#
# ompi-ofi: the common OFI component, written in Rust (https://... this repository).
# scripts/build-openmpi copies this directory over Open MPI's opal/mca/common/ofi.
# The Rust code is built by cargo at `make` time into one relocatable object that
# holds the common state, the BTL and the MTL (see Makefile.am).
#
# MCA_opal_common_ofi_CONFIG([action-if-can-compile],
#                            [action-if-cant-compile])
# ------------------------------------------------
AC_DEFUN([MCA_opal_common_ofi_CONFIG],[
    AC_CONFIG_FILES([opal/mca/common/ofi/Makefile])

    AC_ARG_WITH([ompi-ofi-source],
        [AS_HELP_STRING([--with-ompi-ofi-source=DIR],
            [Source tree of ompi-ofi, the Rust OFI components (default: the tree this Open MPI source was patched from)])])
    AC_ARG_VAR([CARGO], [cargo, used to build the Rust OFI components (ompi-ofi)])
    AC_ARG_VAR([RUSTC], [rustc, used by cargo for the Rust OFI components (ompi-ofi)])

    OPAL_CHECK_OFI

    opal_common_ofi_happy=no
    AS_IF([test "$opal_ofi_happy" = "yes"],
          [_OMPI_OFI_CHECK_RUST
           opal_common_ofi_happy=yes])

    # Note that $opal_common_ofi_happy is used by the btl and mtl
    # configure.m4's (common components are configured first).
    AS_IF([test "$opal_common_ofi_happy" = "yes"],
          [common_ofi_WRAPPER_EXTRA_LDFLAGS=$opal_ofi_LDFLAGS
           common_ofi_WRAPPER_EXTRA_LIBS=$opal_ofi_LIBS
           $1],
          [$2])
])dnl

# The components are Rust: without cargo and rustc they cannot be built. Fail loudly
# rather than dropping them (a user who gets no ofi components would only notice at
# run time). --without-ofi (or --enable-mca-no-build) is the way to build without.
AC_DEFUN([_OMPI_OFI_CHECK_RUST],[
    ompi_ofi_source="${with_ompi_ofi_source:-__OMPI_OFI_SOURCE__}"
    AC_MSG_CHECKING([for the ompi-ofi (Rust) source tree])
    AS_IF([test -f "$ompi_ofi_source/Cargo.toml" && test -f "$ompi_ofi_source/src/lib.rs"],
          [AC_MSG_RESULT([$ompi_ofi_source])],
          [AC_MSG_RESULT([not found])
           AC_MSG_ERROR([ompi-ofi: the OFI components of this Open MPI tree are written in Rust,
but their source tree "$ompi_ofi_source" has no Cargo.toml.
Configure with --with-ompi-ofi-source=DIR (a checkout of ompi-ofi), or --without-ofi.])])

    ompi_ofi_rust_path="$PATH:$HOME/.cargo/bin"
    AC_PATH_PROG([CARGO], [cargo], [], [$ompi_ofi_rust_path])
    AC_PATH_PROG([RUSTC], [rustc], [], [$ompi_ofi_rust_path])
    AS_IF([test -z "$CARGO" || test -z "$RUSTC"],
          [AC_MSG_ERROR([ompi-ofi: the OFI components (common/ofi, btl/ofi, mtl/ofi) are written
in Rust and need cargo and rustc, which were not found in PATH or ~/.cargo/bin
(cargo: ${CARGO:-missing}, rustc: ${RUSTC:-missing}).
Install a Rust toolchain (https://rustup.rs, or "apt-get install cargo"), or set
CARGO=/path/to/cargo RUSTC=/path/to/rustc, or configure --without-ofi.])])
    AC_MSG_CHECKING([whether $RUSTC works])
    ompi_ofi_rustc_version=`"$RUSTC" --version 2>&AS_MESSAGE_LOG_FD`
    AS_IF([test $? -eq 0 && test -n "$ompi_ofi_rustc_version"],
          [AC_MSG_RESULT([$ompi_ofi_rustc_version])],
          [AC_MSG_RESULT([no])
           AC_MSG_ERROR([ompi-ofi: $RUSTC --version failed; the Rust toolchain is not usable (see config.log)])])
    # offset_of! (used by the components) is stable since Rust 1.77.
    ompi_ofi_rustc_minor=`echo "$ompi_ofi_rustc_version" | sed -n 's/^rustc 1\.\([[0-9]]*\)\..*/\1/p'`
    AS_IF([test -z "$ompi_ofi_rustc_minor" || test "$ompi_ofi_rustc_minor" -lt 77],
          [AC_MSG_ERROR([ompi-ofi: $ompi_ofi_rustc_version is too old; the OFI components need Rust 1.77 or newer])])
    AC_MSG_CHECKING([whether $CARGO works])
    ompi_ofi_cargo_version=`"$CARGO" --version 2>&AS_MESSAGE_LOG_FD`
    AS_IF([test $? -eq 0 && test -n "$ompi_ofi_cargo_version"],
          [AC_MSG_RESULT([$ompi_ofi_cargo_version])],
          [AC_MSG_RESULT([no])
           AC_MSG_ERROR([ompi-ofi: $CARGO --version failed; the Rust toolchain is not usable (see config.log)])])
    # The Rust code is linked as one relocatable object (ld -r), with its internal
    # symbols made local and its references into libmpi made weak (objcopy).
    AC_CHECK_TOOL([OBJCOPY], [objcopy])
    AS_IF([test -z "$OBJCOPY"],
          [AC_MSG_ERROR([ompi-ofi: objcopy (binutils) is needed to build the OFI components])])
    OMPI_OFI_SOURCE=$ompi_ofi_source
    AC_SUBST([OMPI_OFI_SOURCE])
])dnl
