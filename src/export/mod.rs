pub mod cast;
pub mod chart;
pub mod compare_svg;
pub mod csv;
pub mod svg;
pub mod svg_controls;
