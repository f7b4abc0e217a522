//! The demo (filled in next).
