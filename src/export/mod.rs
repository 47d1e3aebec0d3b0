pub mod cast;
pub mod csv;
pub mod svg;
