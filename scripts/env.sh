# Sourced by the scripts: puts target/mca first on Open MPI's component path.
# Open MPI takes the first component of a name it finds, so ours shadow the C ones.
OMPI_OFI_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OMPI_OFI_MCA_DIR="$OMPI_OFI_ROOT/target/mca"
if [ ! -e "$OMPI_OFI_MCA_DIR/mca_mtl_ofi.so" ]; then
    echo "ompi-ofi: $OMPI_OFI_MCA_DIR has no components; run scripts/build first" >&2
    exit 1
fi
OMPI_OFI_SYS_DIR="$(ompi_info --path pkglibdir --parsable 2>/dev/null | sed -n 's/^path:pkglibdir://p')"
[ -d "$OMPI_OFI_SYS_DIR" ] || OMPI_OFI_SYS_DIR=/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3
export OMPI_MCA_mca_base_component_path="$OMPI_OFI_MCA_DIR:$OMPI_OFI_SYS_DIR"
