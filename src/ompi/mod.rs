//! The boundary with Open MPI: component structs, MCA parameters, output, modex.
//! Everything that touches Open MPI's internals directly lives here or in
//! `opal_glue/`; the data paths call the safe functions of these modules.
pub mod btl;
pub mod comm;
pub mod component;
pub mod convertor;
pub mod error;
pub mod glue;
pub mod memhooks;
pub mod message;
pub mod modex;
pub mod mtl_module;
pub mod mtl_request;
pub mod output;
pub mod params;
pub mod proc;
pub mod progress;
pub mod pvar;
pub mod request;
