pub mod csv;
pub mod svg;
