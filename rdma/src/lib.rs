//! RDMA NIC discovery (sysfs) and the transport between node proxies.
