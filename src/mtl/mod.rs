//! The OFI MTL: tagged messaging under pml cm.
