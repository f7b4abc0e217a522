//! flowlane's own training-traffic generators and their report.
//!
//! The two communication patterns of distributed training, over plain TCP
//! sockets (so that flowlane's preload library can move them to another lane
//! without the program knowing):
//! - [`ps`]: TensorFlow-style parameter servers (push gradients, pull
//!   parameters, sharded across servers; synchronous or asynchronous);
//! - [`allreduce`]: Horovod/Gloo-style ring all-reduce (chunked
//!   reduce-scatter then all-gather).
//!
//! [`models`] holds the parameter counts and per-step compute times of the
//! models the report covers; [`report`] and [`chart`] turn measured runs into
//! a table, JSON and an SVG chart.

pub mod allreduce;
pub mod chart;
pub mod findings;
pub mod local;
pub mod models;
pub mod ps;
pub mod report;
pub mod stats;
pub mod toy;
pub mod wire;
