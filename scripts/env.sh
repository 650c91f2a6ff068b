# Sourced by the scripts: puts target/mca first on Open MPI's component path.
# Open MPI takes the first component of a name it finds, so ours shadow the C ones.
OMPI_OFI_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OMPI_OFI_MCA_DIR="$OMPI_OFI_ROOT/target/mca"
if [ ! -e "$OMPI_OFI_MCA_DIR/mca_mtl_ofi.so" ]; then
    echo "ompi-ofi: $OMPI_OFI_MCA_DIR has no components; run scripts/build first" >&2
    exit 1
fi
# Open MPI's own component directory, asked of ompi_info once per Open MPI install and
# cached beside our components (ompi_info takes 0.2 s, which every job would pay).
_ompi_ofi_info="$(command -v ompi_info 2>/dev/null)"
_ompi_ofi_key="$(readlink -f "$_ompi_ofi_info" 2>/dev/null) $(stat -c %Y "$_ompi_ofi_info" 2>/dev/null)"
_ompi_ofi_cache="$OMPI_OFI_MCA_DIR/.pkglibdir"
OMPI_OFI_SYS_DIR=""
if [ -r "$_ompi_ofi_cache" ] && [ "$(head -n1 "$_ompi_ofi_cache")" = "$_ompi_ofi_key" ]; then
    OMPI_OFI_SYS_DIR="$(sed -n 2p "$_ompi_ofi_cache")"
fi
if [ ! -d "$OMPI_OFI_SYS_DIR" ]; then
    OMPI_OFI_SYS_DIR="$(ompi_info --path pkglibdir --parsable 2>/dev/null | sed -n 's/^path:pkglibdir://p')"
    if [ -d "$OMPI_OFI_SYS_DIR" ]; then
        printf '%s\n%s\n' "$_ompi_ofi_key" "$OMPI_OFI_SYS_DIR" > "$_ompi_ofi_cache" 2>/dev/null || true
    fi
fi
[ -d "$OMPI_OFI_SYS_DIR" ] || OMPI_OFI_SYS_DIR=/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3
unset _ompi_ofi_info _ompi_ofi_key _ompi_ofi_cache
export OMPI_MCA_mca_base_component_path="$OMPI_OFI_MCA_DIR:$OMPI_OFI_SYS_DIR"
