//! One module per CNI command.

pub mod add;
pub mod chained;
pub mod check;
pub mod del;
pub mod gc;
pub mod status;
