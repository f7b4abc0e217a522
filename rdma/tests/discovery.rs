//! Discovery and GID selection against the fake sysfs trees in
//! `tests/fixtures/` (see `generate.py` there for where each value comes from).

use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};

use flowlane_rdma::{
    discover, select_gid, GidType, Inventory, LinkLayer, NoGidReason, NodeAddress, Sysfs,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn inventory(name: &str) -> Inventory {
    discover(&Sysfs::new(fixture(name))).expect("discover")
}

fn addr(ip: &str, netdev: Option<&str>) -> NodeAddress {
    NodeAddress {
        ip: ip.parse().unwrap(),
        netdev: netdev.map(str::to_string),
    }
}

/// A private copy of a fixture that a test may modify; removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn of(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "flowlane-rdma-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let ok = std::process::Command::new("cp")
            .arg("-a")
            .arg(fixture(name))
            .arg(&dir)
            .status()
            .unwrap()
            .success();
        assert!(ok, "copy fixture");
        Scratch(dir)
    }

    fn port(&self, dev: &str) -> PathBuf {
        self.0.join("class/infiniband").join(dev).join("ports/1")
    }

    fn inventory(&self) -> Inventory {
        discover(&Sysfs::new(&self.0)).expect("discover")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn connectx_roce_port_is_read_completely() {
    let inv = inventory("mlx5-roce");
    assert_eq!(inv.devices.len(), 1);
    let d = &inv.devices[0];
    assert_eq!(d.name, "mlx5_0");
    assert_eq!(d.node_type.as_deref(), Some("CA"));
    assert_eq!(d.node_guid.as_deref(), Some("b859:9f03:00d4:1e2a"));
    assert_eq!(d.fw_ver.as_deref(), Some("16.35.2000"));
    assert_eq!(d.driver.as_deref(), Some("mlx5_core"));
    assert_eq!(d.parent, None);
    assert_eq!(
        d.netdevs,
        vec!["ens1f0np0".to_string()],
        "eno1 has no RDMA device"
    );
    let p = &d.ports[0];
    assert_eq!(p.number, 1);
    assert!(p.is_active());
    assert_eq!(p.state.name, "ACTIVE");
    assert_eq!(p.phys_state.as_ref().unwrap().name, "LinkUp");
    assert_eq!(p.link_layer, LinkLayer::Ethernet);
    assert_eq!(p.rate.as_deref(), Some("100 Gb/sec (4X EDR)"));
    assert_eq!(p.netdev.as_deref(), Some("ens1f0np0"));
    assert_eq!(p.netdev_mtu, Some(9000));
    assert_eq!(p.active_mtu, Some(4096));
    assert_eq!(p.gid_table_len, 16);
    assert_eq!(p.gids.len(), 6, "zero entries are not listed");
    let v2: Vec<u32> = p
        .gids
        .iter()
        .filter(|g| g.gid_type == Some(GidType::RoceV2))
        .map(|g| g.index)
        .collect();
    assert_eq!(v2, vec![1, 3, 5]);
    assert_eq!(
        p.gids[3].gid,
        "::ffff:10.204.10.11".parse::<Ipv6Addr>().unwrap()
    );
    assert!(p
        .gids
        .iter()
        .all(|g| g.netdev.as_deref() == Some("ens1f0np0")));
}

#[test]
fn connectx_roce_selects_the_ipv4_mapped_roce_v2_gid() {
    let inv = inventory("mlx5-roce");
    let sel = select_gid(
        &inv,
        &[
            addr("fd00:204::11", Some("ens1f0np0")),
            addr("10.204.10.11", Some("ens1f0np0")),
        ],
    )
    .expect("usable gid");
    assert_eq!(
        (sel.device.as_str(), sel.port, sel.gid_index),
        ("mlx5_0", 1, 3)
    );
    assert_eq!(sel.gid_type, GidType::RoceV2);
    assert_eq!(
        sel.address,
        "10.204.10.11".parse::<IpAddr>().unwrap(),
        "IPv4 first"
    );
    assert_eq!(sel.netdev.as_deref(), Some("ens1f0np0"));
    assert_eq!(sel.active_mtu, Some(4096));
}

#[test]
fn ipv6_only_node_selects_its_global_ipv6_gid() {
    let inv = inventory("mlx5-roce");
    let sel = select_gid(
        &inv,
        &[
            addr("fe80::ba59:9fff:fed4:1e2a", Some("ens1f0np0")),
            addr("fd00:204::11", Some("ens1f0np0")),
        ],
    )
    .expect("usable gid");
    assert_eq!(
        sel.gid_index, 5,
        "the RoCE v2 entry of fd00:204::11, not link-local"
    );
    assert_eq!(sel.gid, "fd00:204::11".parse::<Ipv6Addr>().unwrap());
}

#[test]
fn infiniband_port_is_chosen_through_its_ipoib_netdev() {
    let inv = inventory("mlx5-ib");
    let d = &inv.devices[0];
    assert_eq!(d.name, "mlx5_1");
    assert_eq!(d.fw_ver.as_deref(), Some("20.36.1010"));
    let p = &d.ports[0];
    assert_eq!(p.link_layer, LinkLayer::InfiniBand);
    assert_eq!(p.rate.as_deref(), Some("200 Gb/sec (4X HDR)"));
    assert_eq!(
        p.netdev.as_deref(),
        Some("ib0"),
        "from class/net/ib0/device/infiniband"
    );
    assert_eq!(p.active_mtu, None, "sysfs has no IB port MTU");
    assert_eq!(p.gids[0].netdev, None, "IB GIDs have no netdev");

    let sel = select_gid(&inv, &[addr("10.204.20.11", Some("ib0"))]).expect("usable gid");
    assert_eq!((sel.device.as_str(), sel.gid_index), ("mlx5_1", 0));
    assert_eq!(sel.link_layer, LinkLayer::InfiniBand);
    assert_eq!(
        sel.gid,
        "fe80::c42:a103:65:8f3c".parse::<Ipv6Addr>().unwrap()
    );

    // The node's address on the Ethernet NIC: InfiniBand cannot carry it.
    let err = select_gid(&inv, &[addr("192.168.1.5", Some("eno1"))]).unwrap_err();
    assert_eq!(err.reason, NoGidReason::AddressNotInGidTable);
    assert!(err.detail.contains("mlx5_1/1 on ib0"), "{}", err.detail);
}

#[test]
fn soft_roce_device_is_found_through_its_parent_netdev() {
    let inv = inventory("rxe");
    let d = &inv.devices[0];
    assert_eq!(d.name, "rxe0");
    assert_eq!(d.driver, None, "rxe has no PCI device");
    assert_eq!(d.parent.as_deref(), Some("vA"));
    assert_eq!(d.fw_ver.as_deref(), Some("0.0.0"));
    assert_eq!(d.netdevs, vec!["vA".to_string()]);
    let p = &d.ports[0];
    assert_eq!(p.netdev.as_deref(), Some("vA"));
    assert_eq!(
        p.active_mtu,
        Some(1024),
        "as ibv_devinfo showed for rxe on a 1500-byte veth"
    );
    assert_eq!(p.gids.len(), 2);
    let sel = select_gid(&inv, &[addr("192.0.2.1", Some("vA"))]).expect("usable gid");
    assert_eq!(sel.gid_index, 1);
    assert_eq!(sel.gid.to_string(), "::ffff:192.0.2.1");
}

#[test]
fn port_down_is_explained() {
    let s = Scratch::of("mlx5-roce");
    std::fs::write(s.port("mlx5_0").join("state"), "1: DOWN\n").unwrap();
    std::fs::write(s.port("mlx5_0").join("phys_state"), "3: Disabled\n").unwrap();
    let inv = s.inventory();
    assert!(!inv.devices[0].ports[0].is_active());
    let err = select_gid(&inv, &[addr("10.204.10.11", Some("ens1f0np0"))]).unwrap_err();
    assert_eq!(err.reason, NoGidReason::PortDown);
    assert!(err.detail.contains("mlx5_0/1 is 1: DOWN"), "{}", err.detail);
}

#[test]
fn roce_v1_only_is_explained() {
    let s = Scratch::of("mlx5-roce");
    let types = s.port("mlx5_0").join("gid_attrs/types");
    for i in [1, 3, 5] {
        std::fs::write(types.join(i.to_string()), "IB/RoCE v1\n").unwrap();
    }
    let err = select_gid(&s.inventory(), &[addr("10.204.10.11", Some("ens1f0np0"))]).unwrap_err();
    assert_eq!(err.reason, NoGidReason::NoRoceV2Gid);
    assert!(err.detail.contains("IB/RoCE v1"), "{}", err.detail);
}

#[test]
fn netdev_mismatch_is_explained() {
    // The node's address is reported on a macvlan, not on the RoCE netdev.
    let err = select_gid(
        &inventory("mlx5-roce"),
        &[addr("10.204.10.11", Some("macvlan0"))],
    )
    .unwrap_err();
    assert_eq!(err.reason, NoGidReason::NetdevMismatch);
    assert!(
        err.detail.contains("ens1f0np0") && err.detail.contains("macvlan0"),
        "{}",
        err.detail
    );
}

#[test]
fn all_zero_gid_table_is_explained() {
    let s = Scratch::of("rxe");
    let port = s.port("rxe0");
    for i in 0..16 {
        std::fs::write(
            port.join("gids").join(i.to_string()),
            "0000:0000:0000:0000:0000:0000:0000:0000\n",
        )
        .unwrap();
        let _ = std::fs::remove_file(port.join("gid_attrs/types").join(i.to_string()));
        let _ = std::fs::remove_file(port.join("gid_attrs/ndevs").join(i.to_string()));
    }
    let inv = s.inventory();
    assert_eq!(inv.devices[0].ports[0].gids.len(), 0);
    assert_eq!(
        inv.devices[0].ports[0].netdev.as_deref(),
        Some("vA"),
        "parent still maps it"
    );
    let err = select_gid(&inv, &[addr("192.0.2.1", Some("vA"))]).unwrap_err();
    assert_eq!(err.reason, NoGidReason::AllZeroGids);
}

#[test]
fn address_missing_from_gid_tables_is_explained() {
    let err = select_gid(&inventory("rxe"), &[addr("10.9.9.9", Some("eth0"))]).unwrap_err();
    assert_eq!(err.reason, NoGidReason::AddressNotInGidTable);
    assert!(
        err.detail.contains("10.9.9.9 on eth0") && err.detail.contains("rxe0/1 on vA"),
        "{}",
        err.detail
    );
}

#[test]
fn node_without_rdma_has_an_empty_inventory() {
    let empty = std::env::temp_dir().join(format!("flowlane-rdma-none-{}", std::process::id()));
    std::fs::create_dir_all(empty.join("class/net")).unwrap();
    let inv = discover(&Sysfs::new(&empty)).expect("no class/infiniband is not an error");
    assert!(inv.devices.is_empty());
    let err = select_gid(&inv, &[addr("10.0.0.1", None)]).unwrap_err();
    assert_eq!(err.reason, NoGidReason::NoDevices);
    let err = select_gid(&inventory("rxe"), &[addr("127.0.0.1", Some("lo"))]).unwrap_err();
    assert_eq!(err.reason, NoGidReason::NoNodeAddress);
    std::fs::remove_dir_all(&empty).unwrap();
}

#[test]
fn inventory_and_selection_serialise_for_diag_json() {
    let inv = inventory("mlx5-roce");
    let json = serde_json::to_value(&inv).unwrap();
    let port = &json["devices"][0]["ports"][0];
    assert_eq!(port["link_layer"], "Ethernet");
    assert_eq!(port["state"]["name"], "ACTIVE");
    assert_eq!(port["gids"][1]["type"], "RoCE v2");
    assert_eq!(port["gids"][3]["gid"], "::ffff:10.204.10.11");
    let back: Inventory = serde_json::from_value(json).unwrap();
    assert_eq!(back, inv);
    let err = select_gid(&inv, &[addr("10.1.1.1", None)]).unwrap_err();
    assert_eq!(
        serde_json::to_value(&err).unwrap()["reason"],
        "address_not_in_gid_table"
    );
}
