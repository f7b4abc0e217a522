//! flowlane's end-to-end tests: ONE test binary (`--test e2e`) with a module
//! per area and a module per suite, so the harness (`flowlane-e2e`, tests/src)
//! and its dependencies are linked once instead of once per suite.
//!
//! A test's path is `area::suite::name`; select an area or a suite with a
//! filter, e.g. `cargo test ... --test e2e -- shm::lane::`. Suites run one
//! after another as the separate binaries did ([`turn`]); a suite's tests run
//! side by side as before (`--test-threads=2` in `tests/run`).

/// One suite at a time: every test first takes its suite's turn.
mod turn;

/// The local cluster (`flowlane cluster`).
mod cluster {
    mod lifecycle;
}

/// The CNI plugin run as a runtime runs it.
mod cni {
    mod chain;
    mod chained;
    mod commands;
    mod concurrency;
    mod cri;
    mod delegation;
    mod errors;
    mod lifecycle;
}

/// The CSI node plugin driven as the kubelet drives it.
mod csi {
    mod node;
}

/// Flowlaned: its socket, broker, node view, process scan, pod routes.
mod daemon {
    mod access;
    mod bench;
    mod broker;
    mod common;
    mod fuzz;
    mod nodes;
    mod pod_routes;
    mod processes;
    mod restart;
    mod status;
}

/// The Soft-RoCE rig suites (two QEMU guests).
mod rdma {
    mod demo_rows;
    mod link_down;
    mod rig;
    mod transport;
}

/// The node installer and DaemonSet on a one-machine cluster.
mod deploy {
    mod cluster;
}

/// `flowlane diag` on a node and on the local cluster.
mod diag {
    mod cluster;
    mod node;
}

/// PyTorch and TensorFlow jobs across pods.
mod frameworks {
    mod tf;
    mod torch;
}

/// The webhook's injection under containerd and Pod Security.
mod inject {
    mod images;
    mod pod_security;
}

/// The shipped preload library.
mod preload {
    mod glibc_floor;
}

/// The cross-node relay.
mod relay {
    mod lane;
    mod rdma;
}

/// Hostile peers on the shared-memory lane.
mod security {
    mod rings;
    mod stock;
}

/// The same-node shared-memory lane.
mod shm {
    mod event_loops;
    mod lane;
    mod peer_table;
    mod programs;
    mod ring_growth;
    mod semantics;
    mod service_ips;
    mod stock;
}

/// The training workloads and the demo report.
mod workloads {
    mod grpc_ps;
    mod report;
}
