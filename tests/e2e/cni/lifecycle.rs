//! ADD / CHECK / DEL of the real plugin binary in real network namespaces,
//! driven exactly as a runtime does (environment + stdin).

use std::net::IpAddr;

use flowlane_e2e::binaries::PluginUnderTest;
use flowlane_e2e::cni::{code, Pod, TestNet};
use flowlane_e2e::result::{expect_valid, CniResult};
use flowlane_e2e::traffic;

/// Versions a test exercises: all result formats for flowlane; the reference
/// plugin (harness self-check mode) stops at 1.0.0.
fn versions() -> Vec<&'static str> {
    match PluginUnderTest::from_env() {
        PluginUnderTest::Flowlane => vec!["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"],
        PluginUnderTest::Reference => vec!["0.3.0", "0.3.1", "0.4.0", "1.0.0"],
    }
}

/// Asserts the pod's netns holds exactly what `res` claims: the interface
/// with its MAC, up, carrying every result address; a default route via the
/// gateway for every family with an address.
fn assert_wired(pod: &Pod, res: &CniResult) {
    let iface = res.sandbox_iface(&pod.netns.path_str()).unwrap_or_else(|| {
        panic!(
            "no interface with sandbox {} in {:#}",
            pod.netns.path_str(),
            res.raw
        )
    });
    assert_eq!(iface.name, pod.ifname);
    let link = pod
        .netns
        .link(&pod.ifname)
        .unwrap_or_else(|| panic!("{} missing in {}", pod.ifname, pod.netns.name()));
    assert!(link.is_up(), "{} is down: {link:?}", pod.ifname);
    assert_eq!(
        link.address.to_lowercase(),
        iface.mac.to_lowercase(),
        "MAC differs from result"
    );
    let cidrs = link.cidrs();
    assert!(!res.ips.is_empty(), "result has no IPs");
    for ip in &res.ips {
        assert!(
            cidrs.contains(&ip.cidr()),
            "{} not on {}: {cidrs:?}",
            ip.cidr(),
            pod.ifname
        );
        if let Some(idx) = ip.interface {
            assert_eq!(
                res.interfaces[idx].name, pod.ifname,
                "ips[].interface points elsewhere"
            );
        }
        let gw = ip.gateway.expect("result IP has a gateway (isGateway)");
        let family = if ip.address.is_ipv4() { 4 } else { 6 };
        let routes = pod.netns.routes(family);
        let has_default = routes.iter().any(|r| {
            r["dst"] == "default"
                && r["gateway"].as_str().and_then(|g| g.parse::<IpAddr>().ok()) == Some(gw)
                && r["dev"] == pod.ifname.as_str()
        });
        assert!(has_default, "no default route via {gw} in {routes:#?}");
    }
    let default_dst = |r: &(String, Option<IpAddr>)| r.0 == "0.0.0.0/0" || r.0 == "::/0";
    assert!(
        res.routes.iter().any(default_dst),
        "result lists no default route: {:#}",
        res.raw
    );
}

#[test]
fn add_check_del_in_every_result_version() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("ver", &["10.201.1.0/24"]);
    let mut ids = Vec::new();
    for version in versions() {
        let pod = Pod::new("ver");
        let raw = net.add(&pod, version);
        let res = expect_valid(version, &raw);
        assert_eq!(res.ips.len(), 1, "{version}: one IPv4 expected: {raw:#}");
        let ip = res.ipv4().unwrap();
        assert!(
            ip.cidr().starts_with("10.201.1."),
            "{version}: {}",
            ip.cidr()
        );
        assert_eq!(ip.prefix, 24);
        assert_wired(&pod, &res);
        // The bridge exists with the gateway address on it.
        let br = flowlane_e2e::host::link(&net.name).expect("bridge created");
        assert!(
            br.cidrs().contains(&"10.201.1.1/24".to_string()),
            "gateway not on bridge: {br:?}"
        );
        assert_eq!(flowlane_e2e::host::bridge_ports(&net.name).len(), 1);

        if !version.starts_with("0.3") {
            // CHECK exists since 0.4.0.
            net.check(&pod, version, &raw).expect_ok();
        }
        net.del(&pod, version, Some(&raw)).expect_ok();
        assert!(
            pod.netns.link(&pod.ifname).is_none(),
            "{version}: link survived DEL"
        );
        if !version.starts_with("0.3") {
            let e = net.check(&pod, version, &raw).error();
            assert!(
                e.code == code::UNKNOWN_CONTAINER || e.code >= 100 || e.code == code::IO_FAILURE,
                "{version}: CHECK after DEL: unexpected code {}: {}",
                e.code,
                e.msg
            );
        }
        ids.push(pod.id.clone());
        net.assert_clean(&[&pod.id]);
    }
}

#[test]
fn dual_stack_pods_talk_over_v4_and_v6() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("ds", &["10.201.2.0/24", "fd00:201:2::/64"]);
    let a = Pod::new("dsa");
    let b = Pod::new("dsb");
    let ra = expect_valid("1.0.0", &net.add(&a, "1.0.0"));
    let rb = expect_valid("1.0.0", &net.add(&b, "1.0.0"));
    for r in [&ra, &rb] {
        assert_eq!(
            r.ips.len(),
            2,
            "dual stack gives two addresses: {:#}",
            r.raw
        );
        assert!(
            r.ipv6().unwrap().cidr().starts_with("fd00:201:2::"),
            "{:#}",
            r.raw
        );
        assert_eq!(r.ipv6().unwrap().prefix, 64);
    }
    assert_wired(&a, &ra);
    assert_wired(&b, &rb);
    // The node forwards for its gateways (the sysctls forwarding needs).
    assert_eq!(
        flowlane_e2e::host::sysctl("net.ipv4.ip_forward").as_deref(),
        Some("1")
    );
    assert_eq!(
        flowlane_e2e::host::sysctl("net.ipv6.conf.all.forwarding").as_deref(),
        Some("1")
    );
    let (a6, b6) = (ra.ipv6().unwrap().address, rb.ipv6().unwrap().address);
    let b4 = rb.ipv4().unwrap().address;
    assert!(traffic::ping(&a.netns, b4, 10), "ping {b4}");
    assert!(traffic::ping(&a.netns, b6, 20), "ping6 {b6}");
    // The gateway answers on v6 too.
    let gw6 = ra.ipv6().unwrap().gateway.unwrap();
    assert!(traffic::ping(&a.netns, gw6, 20), "ping6 gateway {gw6}");
    let rep = traffic::tcp_echo(&b.netns, b6, 7601, &a.netns, 1 << 20).expect("tcp over v6");
    assert_eq!(rep.received, rep.sent);
    assert_eq!(rep.server_hash, rep.sent_hash);
    assert_eq!(rep.echoed_hash, rep.sent_hash);
    assert_eq!(rep.peer, a6, "server sees the client's pod address");
    net.del(&a, "1.0.0", Some(&ra.raw)).expect_ok();
    net.del(&b, "1.0.0", Some(&rb.raw)).expect_ok();
    net.assert_clean(&[&a.id, &b.id]);
}

#[test]
fn two_pods_exchange_a_tcp_stream_through_the_bridge() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("tcp", &["10.201.3.0/24"]);
    let a = Pod::new("tcpa");
    let b = Pod::new("tcpb");
    let ra = expect_valid(version_latest(), &net.add(&a, version_latest()));
    let rb = expect_valid(version_latest(), &net.add(&b, version_latest()));
    let (a4, b4) = (ra.ipv4().unwrap().address, rb.ipv4().unwrap().address);
    assert_ne!(a4, b4);
    let rep = traffic::tcp_echo(&b.netns, b4, 7602, &a.netns, 8 << 20).expect("tcp stream");
    assert_eq!(rep.received, 8 << 20, "every byte came back");
    assert_eq!(rep.server_hash, rep.sent_hash, "server got the exact bytes");
    assert_eq!(
        rep.echoed_hash, rep.sent_hash,
        "client got the exact bytes back"
    );
    assert_eq!(rep.peer, a4, "no NAT between pods on one bridge");
    // The pod reaches its gateway (the host side of the bridge).
    assert!(traffic::ping(
        &a.netns,
        ra.ipv4().unwrap().gateway.unwrap(),
        5
    ));
    net.del(&a, version_latest(), Some(&ra.raw)).expect_ok();
    net.del(&b, version_latest(), Some(&rb.raw)).expect_ok();
    net.assert_clean(&[&a.id, &b.id]);
}

fn version_latest() -> &'static str {
    versions().last().copied().unwrap()
}

#[test]
fn del_is_idempotent_the_way_containerd_calls_it() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = TestNet::new("del", &["10.201.4.0/24"]);

    // containerd: DEL with netns + prevResult, then DEL again with CNI_NETNS="" and no prevResult.
    let pod = Pod::new("dela");
    let raw = net.add(&pod, v);
    net.del(&pod, v, Some(&raw)).expect_ok();
    net.invoke("DEL")
        .container_id(&pod.id)
        .netns("")
        .ifname(&pod.ifname)
        .args(&pod.cni_args)
        .config(&net.conf(v))
        .run()
        .expect_ok();
    net.assert_clean(&[&pod.id]);

    // DEL with CNI_NETNS empty, no prevResult, while the pod is still wired: the
    // lease and registry entry go; the link goes with its netns.
    let pod = Pod::new("delb");
    let _raw = net.add(&pod, v);
    net.invoke("DEL")
        .container_id(&pod.id)
        .netns("")
        .ifname(&pod.ifname)
        .config(&net.conf(v))
        .run()
        .expect_ok();
    assert!(
        net.leases().is_empty(),
        "DEL without netns must still release the IP"
    );
    assert!(net.registry_entries().is_empty() || net.plugin == PluginUnderTest::Reference);
    drop(pod);
    assert!(flowlane_e2e::wait::until(
        flowlane_e2e::wait::LIVENESS,
        || { flowlane_e2e::host::bridge_ports(&net.name).is_empty() }
    ));

    // DEL whose netns is gone (pod sandbox already destroyed).
    let pod = Pod::new("delc");
    let raw = net.add(&pod, v);
    let gone = pod.netns.path_str();
    let id = pod.id.clone();
    let (ifname, args) = (pod.ifname.clone(), pod.cni_args.clone());
    drop(pod);
    let mut conf = net.conf(v);
    conf["prevResult"] = raw.clone();
    net.invoke("DEL")
        .container_id(&id)
        .netns(&gone)
        .ifname(&ifname)
        .args(&args)
        .config(&conf)
        .run()
        .expect_ok();
    net.assert_clean(&[&id]);

    // DEL whose link was already removed (netns still there).
    let pod = Pod::new("deld");
    let raw = net.add(&pod, v);
    pod.netns
        .ip(&["link", "del", &pod.ifname])
        .expect_ok("ip link del");
    net.del(&pod, v, Some(&raw)).expect_ok();
    net.assert_clean(&[&pod.id]);

    // DEL with an empty prevResult object.
    let pod = Pod::new("dele");
    let _raw = net.add(&pod, v);
    net.del(&pod, v, Some(&serde_json::json!({}))).expect_ok();
    assert!(pod.netns.link(&pod.ifname).is_none(), "link survived DEL");
    net.assert_clean(&[&pod.id]);

    // DEL of a container that was never added.
    let pod = Pod::new("delf");
    net.del(&pod, v, None).expect_ok();
    net.del(&pod, v, None).expect_ok();
    net.assert_clean(&[&pod.id]);
}

#[test]
fn registry_entry_records_the_attachment() {
    let _turn = crate::turn::take(module_path!());
    if PluginUnderTest::from_env() == PluginUnderTest::Reference {
        return; // the registry is flowlane's own
    }
    let v = version_latest();
    let net = TestNet::new("reg", &["10.201.5.0/24", "fd00:201:5::/64"]);
    let pod = Pod::new("reg");
    let before = flowlane_registry::now_unix();
    let res = expect_valid(v, &net.add(&pod, v));
    let entries = net.registry_entries();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let e = &entries[0];
    let path = net
        .state_dir()
        .join("pods")
        .join(&net.name)
        .join(format!("{}-{}.json", pod.id, pod.ifname));
    assert!(path.exists(), "entry file at {}", path.display());
    assert_eq!(e.network, net.name);
    assert_eq!(e.container_id, pod.id);
    assert_eq!(e.ifname, "eth0");
    assert_eq!(e.netns, pod.netns.path_str());
    assert_eq!(e.netns_inode, pod.netns.inode());
    let mut want: Vec<String> = res.ips.iter().map(|i| i.cidr()).collect();
    let mut got = e.ips.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    let mac = &res.sandbox_iface(&pod.netns.path_str()).unwrap().mac;
    assert_eq!(e.mac.to_lowercase(), mac.to_lowercase());
    assert_eq!(e.pod_namespace.as_deref(), Some("flt-ns"));
    assert_eq!(e.pod_name.as_deref(), Some(pod.netns.name()));
    assert_eq!(
        e.pod_uid.as_deref(),
        Some(format!("uid-{}", pod.netns.name()).as_str())
    );
    assert!(e.created_unix >= before && e.created_unix <= flowlane_registry::now_unix());
    net.del(&pod, v, Some(&res.raw)).expect_ok();
    assert!(!path.exists(), "DEL removes the entry");
    net.assert_clean(&[&pod.id]);
}

#[test]
fn reference_bridge_config_keys_are_honoured() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = TestNet::new("keys", &["10.201.6.0/24"]);
    let mut conf = net.conf(v);
    conf["mtu"] = serde_json::json!(1400);
    conf["hairpinMode"] = serde_json::json!(true);
    conf["isDefaultGateway"] = serde_json::json!(false);
    conf["ipam"]["routes"] = serde_json::json!([{"dst": "192.0.2.0/24"}]);
    let pod = Pod::new("keys");
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    let res = expect_valid(v, &raw);
    let eth0 = pod.netns.link("eth0").expect("eth0");
    assert_eq!(eth0.mtu, 1400, "mtu in the pod");
    let ports = flowlane_e2e::host::bridge_ports(&net.name);
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].mtu, 1400, "mtu of the host veth");
    let detail =
        flowlane_e2e::process::sh(&["ip", "-j", "-d", "link", "show", "dev", &ports[0].ifname])
            .expect_ok("ip -d link")
            .stdout;
    let detail: serde_json::Value = serde_json::from_str(detail.trim()).unwrap();
    assert_eq!(
        detail[0]["linkinfo"]["info_slave_data"]["hairpin"], true,
        "hairpin on the bridge port: {detail:#}"
    );
    let br = flowlane_e2e::host::link(&net.name).expect("bridge");
    assert!(
        br.cidrs().contains(&"10.201.6.1/24".to_string()),
        "isGateway: {br:?}"
    );
    let routes = pod.netns.routes(4);
    assert!(
        !routes.iter().any(|r| r["dst"] == "default"),
        "no default route without isDefaultGateway: {routes:#?}"
    );
    assert!(
        routes
            .iter()
            .any(|r| r["dst"] == "192.0.2.0/24" && r["gateway"] == "10.201.6.1"),
        "ipam.routes route via the gateway: {routes:#?}"
    );
    assert!(
        res.routes.iter().any(|r| r.0 == "192.0.2.0/24"),
        "result lists the route: {raw:#}"
    );
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del).run().expect_ok();
    net.assert_clean(&[&pod.id]);
}

#[test]
fn promisc_mode_sets_the_bridge_promiscuous() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = TestNet::new("prom", &["10.201.7.0/24"]);
    let mut conf = net.conf(v);
    conf["promiscMode"] = serde_json::json!(true);
    let pod = Pod::new("prom");
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    let br = flowlane_e2e::host::link(&net.name).expect("bridge");
    assert!(
        br.flags.iter().any(|f| f == "PROMISC"),
        "promiscMode: {:?}",
        br.flags
    );
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del).run().expect_ok();
    net.assert_clean(&[&pod.id]);
}

/// The host's packet filter rules (nftables, which also holds iptables-nft
/// rules), to look for a pod's masquerade rule whatever tool installed it.
fn filter_rules() -> String {
    let nft = flowlane_e2e::process::sh(&["nft", "list", "ruleset"]).stdout;
    let ipt = flowlane_e2e::process::sh(&["iptables-save"]).stdout;
    format!("{nft}\n{ipt}")
}

#[test]
fn ip_masq_hides_the_pod_address_outside_its_subnet_until_del() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = TestNet::new("masq", &["10.201.8.0/24"]);
    let mut conf = net.conf(v);
    conf["ipMasq"] = serde_json::json!(true);
    // An "outside" network: a netns behind a veth from the host, 10.201.9.0/30.
    let outside = flowlane_e2e::netns::Netns::new("mqx");
    let host_end = flowlane_e2e::host::LinkGuard::fresh("mqh");
    flowlane_e2e::process::sh(&[
        "ip",
        "link",
        "add",
        host_end.name(),
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        outside.name(),
    ])
    .expect_ok("outside veth");
    flowlane_e2e::process::sh(&["ip", "addr", "add", "10.201.9.1/30", "dev", host_end.name()])
        .expect_ok("addr");
    flowlane_e2e::process::sh(&["ip", "link", "set", host_end.name(), "up"]).expect_ok("up");
    outside
        .ip(&["addr", "add", "10.201.9.2/30", "dev", "eth0"])
        .expect_ok("addr");
    outside.ip(&["link", "set", "eth0", "up"]).expect_ok("up");
    outside
        .ip(&["route", "add", "default", "via", "10.201.9.1"])
        .expect_ok("route");

    let pod = Pod::new("masq");
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    let mut del = conf.clone();
    del["prevResult"] = raw.clone();
    let guard = flowlane_e2e::cni::DelOnDrop::new(net.pod_call("DEL", &pod, &del));
    let res = expect_valid(v, &raw);
    let pod_ip = res.ipv4().unwrap().address;
    let rules = filter_rules();
    assert!(
        rules.contains(&pod_ip.to_string()) || rules.contains("10.201.8.0/24"),
        "no masquerade rule for {pod_ip}:\n{rules}"
    );
    let rep = traffic::tcp_echo(
        &outside,
        "10.201.9.2".parse().unwrap(),
        7603,
        &pod.netns,
        64 << 10,
    )
    .expect("pod reaches the outside network");
    assert_eq!(rep.echoed_hash, rep.sent_hash);
    assert_eq!(
        rep.peer,
        "10.201.9.1".parse::<IpAddr>().unwrap(),
        "the outside sees the node's address, not the pod's"
    );
    net.pod_call("DEL", &pod, &del).run().expect_ok();
    guard.disarm();
    let rules = filter_rules();
    assert!(
        !rules.contains(&pod_ip.to_string()),
        "masquerade rule for {pod_ip} survived DEL:\n{rules}"
    );
    net.assert_clean(&[&pod.id]);
}

#[test]
fn check_detects_drift_from_the_result() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = TestNet::new("drift", &["10.201.23.0/24"]);
    let ok = |pod: &Pod, raw: &serde_json::Value| net.check(pod, v, raw).expect_ok();
    let fails = |label: &str, pod: &Pod, raw: &serde_json::Value| {
        let out = net.check(pod, v, raw);
        assert!(!out.success(), "{label}: CHECK passed:\n{}", out.stdout);
        let e = out.error();
        assert!(e.code != 0, "{label}");
    };
    let mut pods = Vec::new();

    // Address removed from the pod's interface.
    let pod = Pod::new("drift");
    let raw = net.add(&pod, v);
    ok(&pod, &raw);
    let cidr = expect_valid(v, &raw).ipv4().unwrap().cidr();
    pod.netns
        .ip(&["addr", "del", &cidr, "dev", "eth0"])
        .expect_ok("addr del");
    fails("address removed", &pod, &raw);
    pods.push((pod, raw));

    // Default route removed.
    let pod = Pod::new("drift");
    let raw = net.add(&pod, v);
    pod.netns
        .ip(&["route", "del", "default"])
        .expect_ok("route del");
    fails("default route removed", &pod, &raw);
    pods.push((pod, raw));

    // prevResult claims another address than the pod has.
    let pod = Pod::new("drift");
    let raw = net.add(&pod, v);
    let mut other = raw.clone();
    other["ips"][0]["address"] = serde_json::json!("10.201.23.250/24");
    fails("prevResult with another address", &pod, &other);
    ok(&pod, &raw);
    pods.push((pod, raw));

    // Interface brought down.
    let pod = Pod::new("drift");
    let raw = net.add(&pod, v);
    pod.netns
        .ip(&["link", "set", "eth0", "down"])
        .expect_ok("link down");
    let out = net.check(&pod, v, &raw);
    // Not every plugin checks the link state; when it answers, it answers well-formed.
    if !out.success() {
        out.error();
    }
    pods.push((pod, raw));

    let ids: Vec<String> = pods.iter().map(|(p, _)| p.id.clone()).collect();
    for (pod, raw) in &pods {
        net.del(pod, v, Some(raw)).expect_ok();
    }
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    net.assert_clean(&ids);
}

#[test]
fn layer2_only_without_ipam() {
    let _turn = crate::turn::take(module_path!());
    // As with the reference bridge, no `ipam` means an L2-only attachment.
    let v = version_latest();
    let net = TestNet::new("l2", &["10.201.24.0/24"]);
    let mut conf = net.conf(v);
    conf.as_object_mut().unwrap().remove("ipam");
    conf["isGateway"] = serde_json::json!(false);
    conf["isDefaultGateway"] = serde_json::json!(false);
    let pod = Pod::new("l2");
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    let res = expect_valid(v, &raw);
    assert!(res.ips.is_empty(), "no addresses without IPAM: {raw:#}");
    let eth0 = pod.netns.link("eth0").expect("eth0 exists");
    assert!(eth0.cidrs().is_empty(), "{eth0:?}");
    assert_eq!(flowlane_e2e::host::bridge_ports(&net.name).len(), 1);
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del).run().expect_ok();
    net.assert_clean(&[&pod.id]);
}

#[test]
fn daemon_notification_is_best_effort() {
    let _turn = crate::turn::take(module_path!());
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    if PluginUnderTest::from_env() == PluginUnderTest::Reference {
        return; // flowlane's own feature
    }
    let v = version_latest();
    let net = TestNet::new("ntfy", &["10.201.25.0/24"]);
    // A "daemon" that accepts and never answers: ADD must still complete.
    let sock = net.dir.join("mute.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            held.push(c); // keep it open, say nothing
        }
    });
    let mut conf = net.conf(v);
    conf["daemonSocket"] = serde_json::json!(sock.display().to_string());
    let pod = Pod::new("ntfy");
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    expect_valid(v, &raw);
    assert!(
        accepted.load(Ordering::SeqCst) >= 1,
        "the plugin tried to notify the daemon"
    );
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del).run().expect_ok();

    // daemonSocket that is a regular file, or missing: no effect on ADD.
    for path in [net.dir.join("plain"), net.dir.join("missing.sock")] {
        if path.ends_with("plain") {
            std::fs::write(&path, b"not a socket").unwrap();
        }
        let mut conf = net.conf(v);
        conf["daemonSocket"] = serde_json::json!(path.display().to_string());
        let pod = Pod::new("ntfy");
        let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
        let mut del = conf.clone();
        del["prevResult"] = raw;
        net.pod_call("DEL", &pod, &del).run().expect_ok();
        net.assert_clean(&[&pod.id]);
    }
}

#[test]
fn ipv6_only_network() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = TestNet::new("v6", &["fd00:201:26::/64"]);
    let a = Pod::new("v6a");
    let b = Pod::new("v6b");
    let ra = expect_valid(v, &net.add(&a, v));
    let rb = expect_valid(v, &net.add(&b, v));
    assert!(ra.ipv4().is_none() && ra.ipv6().is_some(), "{:#}", ra.raw);
    assert_wired(&a, &ra);
    let b6 = rb.ipv6().unwrap().address;
    assert!(traffic::ping(&a.netns, b6, 20), "ping6 {b6}");
    let rep = traffic::tcp_echo(&b.netns, b6, 7604, &a.netns, 256 << 10).expect("tcp over v6");
    assert_eq!(rep.echoed_hash, rep.sent_hash);
    net.del(&a, v, Some(&ra.raw)).expect_ok();
    net.del(&b, v, Some(&rb.raw)).expect_ok();
    net.assert_clean(&[&a.id, &b.id]);
}

#[test]
fn range_bounds_gateway_and_multi_range_sets_are_honoured() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = TestNet::new("rng", &["10.201.27.0/24"]);
    let mut conf = net.conf(v);
    // First range: one address (.100); then a disjoint range of the same
    // subnet (a bridge carries one IPv4 gateway, as with the reference bridge).
    conf["ipam"]["ranges"] = serde_json::json!([[
        {"subnet": "10.201.27.0/24", "rangeStart": "10.201.27.100", "rangeEnd": "10.201.27.100", "gateway": "10.201.27.254"},
        {"subnet": "10.201.27.0/24", "rangeStart": "10.201.27.150", "rangeEnd": "10.201.27.160", "gateway": "10.201.27.254"}
    ]]);
    let a = Pod::new("rnga");
    let b = Pod::new("rngb");
    let ra_raw = net.pod_call("ADD", &a, &conf).run().expect_json();
    let rb_raw = net.pod_call("ADD", &b, &conf).run().expect_json();
    let ra = expect_valid(v, &ra_raw);
    let rb = expect_valid(v, &rb_raw);
    let ia = ra.ipv4().unwrap();
    assert_eq!(ia.cidr(), "10.201.27.100/24");
    assert_eq!(ia.gateway, Some("10.201.27.254".parse().unwrap()));
    let ib = rb.ipv4().unwrap();
    let last: u8 = ib
        .address
        .to_string()
        .rsplit('.')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        ib.cidr().starts_with("10.201.27.") && (150..=160).contains(&last),
        "second pod from the second range: {}",
        ib.cidr()
    );
    let br = flowlane_e2e::host::link(&net.name).expect("bridge");
    assert!(
        br.cidrs().contains(&"10.201.27.254/24".to_string()),
        "{br:?}"
    );
    let routes = a.netns.routes(4);
    assert!(
        routes
            .iter()
            .any(|r| r["dst"] == "default" && r["gateway"] == "10.201.27.254"),
        "{routes:#?}"
    );
    for (p, r) in [(&a, ra_raw), (&b, rb_raw)] {
        let mut d = conf.clone();
        d["prevResult"] = r;
        net.pod_call("DEL", p, &d).run().expect_ok();
    }
    net.assert_clean(&[&a.id, &b.id]);
}

#[test]
fn one_container_on_two_networks() {
    let _turn = crate::turn::take(module_path!());
    // Multus-style: eth0 on one network, net1 on another; each attachment
    // has its own lease and registry entry, and DEL of one keeps the other.
    let v = version_latest();
    let n1 = TestNet::new("mn1", &["10.201.29.0/24"]);
    let n2 = TestNet::new("mn2", &["10.201.30.0/24"]);
    let mut pod = Pod::new("mn");
    let r1 = n1.add(&pod, v);
    pod.ifname = "net1".into();
    // Only the first network provides the default route.
    let mut c2 = n2.conf(v);
    c2["isDefaultGateway"] = serde_json::json!(false);
    let r2 = n2.pod_call("ADD", &pod, &c2).run().expect_json();
    assert!(pod.netns.link("eth0").is_some() && pod.netns.link("net1").is_some());
    let res2 = expect_valid(v, &r2);
    let net1 = pod.netns.link("net1").unwrap();
    assert!(net1.cidrs().contains(&res2.ipv4().unwrap().cidr()));
    if n1.plugin == PluginUnderTest::Flowlane {
        assert_eq!(n1.registry_entries().len(), 1);
        assert_eq!(n2.registry_entries()[0].ifname, "net1");
    }
    let mut d2 = c2.clone();
    d2["prevResult"] = r2;
    n2.pod_call("DEL", &pod, &d2).run().expect_ok();
    assert!(pod.netns.link("net1").is_none());
    assert!(
        pod.netns.link("eth0").is_some(),
        "the other attachment survives"
    );
    assert_eq!(n1.leases().len(), 1);
    n2.assert_clean(&[&pod.id]);
    pod.ifname = "eth0".into();
    n1.check(&pod, v, &r1).expect_ok();
    n1.del(&pod, v, Some(&r1)).expect_ok();
    n1.assert_clean(&[&pod.id]);
}

#[test]
fn repeated_add_without_del_never_leaks_a_second_lease() {
    let _turn = crate::turn::take(module_path!());
    // A runtime must not ADD twice, but a crash-looping one may: the second
    // ADD fails or returns the same attachment; one DEL then cleans up all.
    let v = version_latest();
    let net = TestNet::new("twice", &["10.201.31.0/24"]);
    let pod = Pod::new("twice");
    let first = net.add(&pod, v);
    let again = net.pod_call("ADD", &pod, &net.conf(v)).run();
    if again.success() {
        let a = expect_valid(v, &again.json());
        let f = expect_valid(v, &first);
        assert_eq!(a.ips, f.ips, "a repeated ADD returns the same addresses");
    } else {
        again.error();
    }
    assert_eq!(net.leases().len(), 1, "one lease for one attachment");
    assert_eq!(flowlane_e2e::host::bridge_ports(&net.name).len(), 1);
    net.del(&pod, v, Some(&first)).expect_ok();
    net.assert_clean(&[&pod.id]);
}

#[test]
fn plugin_runs_inside_a_node_namespace() {
    let _turn = crate::turn::take(module_path!());
    // The one-machine cluster runs each node's plugin inside the node's netns:
    // the bridge and the host-side veths live there, not on the machine.
    let v = version_latest();
    let net = TestNet::new("node", &["10.201.33.0/24"]);
    let node = flowlane_e2e::netns::Netns::new("nodex");
    let a = Pod::new("nodea");
    let b = Pod::new("nodeb");
    let add = |p: &Pod| {
        net.pod_call("ADD", p, &net.conf(v))
            .in_netns(node.name())
            .run()
            .expect_json()
    };
    let (ra, rb) = (add(&a), add(&b));
    assert!(
        flowlane_e2e::host::link(&net.name).is_none(),
        "bridge leaked onto the host"
    );
    let br = node.link(&net.name).expect("bridge inside the node");
    assert!(br.cidrs().contains(&"10.201.33.1/24".to_string()), "{br:?}");
    let b4 = expect_valid(v, &rb).ipv4().unwrap().address;
    let rep =
        traffic::tcp_echo(&b.netns, b4, 7605, &a.netns, 256 << 10).expect("tcp within the node");
    assert_eq!(rep.echoed_hash, rep.sent_hash);
    for (p, r) in [(&a, ra), (&b, rb)] {
        net.pod_call("DEL", p, &net.conf_with_prev(v, &r))
            .in_netns(node.name())
            .run()
            .expect_ok();
    }
    let ports = node.ip(&["-j", "link", "show", "master", &net.name]).stdout;
    assert!(
        flowlane_e2e::host::parse_links(&ports).is_empty(),
        "veths left in the node: {ports}"
    );
    assert!(net.leases().is_empty());
    assert!(net.registry_entries().is_empty() || net.plugin == PluginUnderTest::Reference);
}

#[test]
fn cni_1_1_route_attributes_are_honoured() {
    let _turn = crate::turn::take(module_path!());
    // CNI 1.1.0 routes carry mtu, advmss, priority, table and scope: the
    // result reports them and the pod's routes have them.
    if PluginUnderTest::from_env() == PluginUnderTest::Reference {
        return; // Debian's plugins speak at most 1.0.0
    }
    let v = "1.1.0";
    let net = TestNet::new("rt11", &["10.201.34.0/24"]);
    let mut conf = net.conf(v);
    conf["ipam"]["routes"] = serde_json::json!([
        {"dst": "192.0.2.0/24", "mtu": 1300, "advmss": 1200, "priority": 55},
        {"dst": "198.51.100.0/24", "table": 100}
    ]);
    let pod = Pod::new("rt11");
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    expect_valid(v, &raw);
    let routes = raw["routes"].as_array().cloned().unwrap_or_default();
    let r1 = routes
        .iter()
        .find(|r| r["dst"] == "192.0.2.0/24")
        .unwrap_or_else(|| panic!("route missing from result: {raw:#}"));
    assert_eq!(r1["mtu"], 1300, "{raw:#}");
    assert_eq!(r1["advmss"], 1200, "{raw:#}");
    assert_eq!(r1["priority"], 55, "{raw:#}");
    let r2 = routes
        .iter()
        .find(|r| r["dst"] == "198.51.100.0/24")
        .unwrap();
    assert_eq!(r2["table"], 100, "{raw:#}");
    let main = pod
        .netns
        .ip(&["-j", "-d", "route", "show", "192.0.2.0/24"])
        .expect_ok("ip route")
        .stdout;
    let main: serde_json::Value = serde_json::from_str(main.trim()).unwrap();
    let m = &main[0];
    assert_eq!(m["metric"], 55, "{main:#}");
    assert_eq!(m["metrics"][0]["mtu"], 1300, "{main:#}");
    assert_eq!(m["metrics"][0]["advmss"], 1200, "{main:#}");
    let t100 = pod
        .netns
        .ip(&["-j", "route", "show", "table", "100"])
        .expect_ok("ip route")
        .stdout;
    assert!(
        t100.contains("198.51.100.0/24"),
        "route in table 100: {t100}"
    );
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del).run().expect_ok();
    net.assert_clean(&[&pod.id]);
}

#[test]
fn dns_settings_are_passed_into_the_result() {
    let _turn = crate::turn::take(module_path!());
    // As the reference bridge does: the network's `dns` appears in the result
    // (the runtime writes the pod's resolv.conf from it).
    let v = version_latest();
    let net = TestNet::new("dns", &["10.201.35.0/24"]);
    let mut conf = net.conf(v);
    let dns = serde_json::json!({
        "nameservers": ["10.201.35.53"], "domain": "flt.example", "search": ["flt.example"], "options": ["ndots:2"]
    });
    conf["dns"] = dns.clone();
    let pod = Pod::new("dns");
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    for k in ["nameservers", "domain", "search", "options"] {
        assert_eq!(raw["dns"][k], dns[k], "dns.{k} in {raw:#}");
    }
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del).run().expect_ok();
    net.assert_clean(&[&pod.id]);
}

/// A network whose bridge already exists with a foreign address of the family.
fn net_with_foreign_bridge_address(tag: &str, subnet: &str, foreign: &str) -> TestNet {
    let net = TestNet::new(tag, &[subnet]);
    let sh = flowlane_e2e::process::sh;
    sh(&["ip", "link", "add", &net.name, "type", "bridge"]).expect_ok("bridge");
    sh(&["ip", "addr", "add", foreign, "dev", &net.name]).expect_ok("addr");
    net
}

#[test]
fn foreign_bridge_address_is_refused_without_force_address() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = net_with_foreign_bridge_address("frgn", "10.201.36.0/24", "10.201.36.77/24");
    let pod = Pod::new("frgn");
    let out = net.pod_call("ADD", &pod, &net.conf(v)).run();
    let e = out.error();
    assert!(
        e.code == code::INVALID_CONFIG || e.code >= 100,
        "code {}: {}",
        e.code,
        e.msg
    );
    let links: Vec<String> = pod.netns.links().into_iter().map(|l| l.ifname).collect();
    assert_eq!(links, vec!["lo"], "refused ADD left links");
    let br = flowlane_e2e::host::link(&net.name).unwrap();
    assert_eq!(
        br.cidrs(),
        vec!["10.201.36.77/24".to_string()],
        "address untouched"
    );
    net.assert_clean(&[&pod.id]);
}

#[test]
fn force_address_replaces_a_foreign_bridge_address() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = net_with_foreign_bridge_address("force", "10.201.38.0/24", "10.201.38.77/24");
    let pod = Pod::new("force");
    let mut conf = net.conf(v);
    conf["forceAddress"] = serde_json::json!(true);
    let raw = net.pod_call("ADD", &pod, &conf).run().expect_json();
    let br = flowlane_e2e::host::link(&net.name).unwrap();
    assert_eq!(
        br.cidrs(),
        vec!["10.201.38.1/24".to_string()],
        "forceAddress replaced it"
    );
    let gw = expect_valid(v, &raw).ipv4().unwrap().gateway.unwrap();
    assert!(
        traffic::ping(&pod.netns, gw, 5),
        "the pod reaches its gateway"
    );
    let mut del = conf.clone();
    del["prevResult"] = raw;
    net.pod_call("DEL", &pod, &del).run().expect_ok();
    net.assert_clean(&[&pod.id]);
}

#[test]
fn without_is_gateway_the_bridge_has_no_address() {
    let _turn = crate::turn::take(module_path!());
    let v = version_latest();
    let net = TestNet::new("nogw", &["10.201.37.0/24"]);
    let mut conf = net.conf(v);
    conf["isGateway"] = serde_json::json!(false);
    conf["isDefaultGateway"] = serde_json::json!(false);
    let a = Pod::new("nogwa");
    let b = Pod::new("nogwb");
    let ra = net.pod_call("ADD", &a, &conf).run().expect_json();
    let rb = net.pod_call("ADD", &b, &conf).run().expect_json();
    let br = flowlane_e2e::host::link(&net.name).unwrap();
    assert!(br.cidrs().is_empty(), "no gateway address: {br:?}");
    assert!(!a.netns.routes(4).iter().any(|r| r["dst"] == "default"));
    // Pods still reach each other on the L2 segment.
    let b4 = expect_valid(v, &rb).ipv4().unwrap().address;
    assert!(traffic::ping(&a.netns, b4, 10));
    for (p, r) in [(&a, ra), (&b, rb)] {
        let mut d = conf.clone();
        d["prevResult"] = r;
        net.pod_call("DEL", p, &d).run().expect_ok();
    }
    net.assert_clean(&[&a.id, &b.id]);
}
