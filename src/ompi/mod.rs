//! The boundary with Open MPI: component structs, MCA parameters, output, modex.
//! Everything that touches Open MPI's internals directly lives here or in
//! `opal_glue/`; the data paths call the safe functions of these modules.
pub mod comm;
pub mod component;
pub mod convertor;
pub mod glue;
pub mod modex;
pub mod output;
pub mod params;
pub mod progress;
pub mod pvar;
