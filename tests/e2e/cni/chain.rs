//! flowlane as the first plugin of a conflist followed by Debian's reference
//! `tuning`, `portmap` and `bandwidth`, run as libcni runs a chain: each
//! plugin gets the previous result as prevResult; DEL in reverse order.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use serde_json::json;

use flowlane_e2e::binaries::{PluginUnderTest, REFERENCE_CNI_DIR};
use flowlane_e2e::cni::{Chain, ChainAttachment, Pod, TestNet};
use flowlane_e2e::process::sh;
use flowlane_e2e::result::expect_valid;

const HOST_PORT: u16 = 18201;
const MAC: &str = "c2:01:20:01:02:03";

fn nat_rules() -> String {
    sh(&["iptables", "-w", "-t", "nat", "-S"])
        .expect_ok("iptables -S")
        .stdout
}

#[test]
fn flowlane_then_tuning_portmap_bandwidth() {
    let _turn = crate::turn::take(module_path!());
    let net = TestNet::new("chn", &["10.201.60.0/24"]);
    let pod = Pod::new("chn");
    let own_dir = net.plugin.binary().parent().unwrap().display().to_string();
    let mut first = net.conf("1.0.0");
    first.as_object_mut().unwrap().remove("cniVersion");
    first.as_object_mut().unwrap().remove("name");
    let chain = Chain {
        name: net.name.clone(),
        version: "1.0.0".into(),
        cni_path: format!("{own_dir}:{REFERENCE_CNI_DIR}"),
        plugins: vec![
            first,
            json!({"type": "tuning", "mac": MAC,
                   "sysctl": {"net.ipv4.conf.eth0.accept_local": "1"}}),
            json!({"type": "portmap", "capabilities": {"portMappings": true},
                   "runtimeConfig": {"portMappings": [
                       {"hostPort": HOST_PORT, "containerPort": 8080, "protocol": "tcp"}]}}),
            json!({"type": "bandwidth", "capabilities": {"bandwidth": true},
                   "runtimeConfig": {"bandwidth": {
                       "ingressRate": 800_000_000u64, "ingressBurst": 8_000_000u64,
                       "egressRate": 800_000_000u64, "egressBurst": 8_000_000u64}}}),
        ],
    };
    let ifb_names = || -> Vec<String> {
        flowlane_e2e::host::links()
            .into_iter()
            .map(|l| l.ifname)
            .filter(|n| n.starts_with("bwp"))
            .collect()
    };
    let ifbs_before = ifb_names();
    let attachment = ChainAttachment::add(&chain, &pod);
    let raw = attachment.result().clone();
    let res = expect_valid("1.0.0", &raw);
    let pod_ip = res.ipv4().expect("pod ip").address;
    let gw = res.ipv4().unwrap().gateway.expect("gateway");

    // tuning: MAC and sysctl applied in the pod, and reported in the result.
    let eth0 = pod.netns.link("eth0").expect("eth0");
    assert_eq!(eth0.address, MAC);
    assert_eq!(res.sandbox_iface(&pod.netns.path_str()).unwrap().mac, MAC);
    assert_eq!(pod.netns.sysctl("net.ipv4.conf.eth0.accept_local"), "1");

    // bandwidth: found the host veth through prevResult; tbf on it, and an
    // ifb device for egress.
    let host_veths = flowlane_e2e::host::bridge_ports(&net.name);
    assert_eq!(host_veths.len(), 1);
    let veth = &host_veths[0].ifname;
    assert!(
        res.interfaces
            .iter()
            .any(|i| &i.name == veth && i.sandbox.is_none()),
        "result lists the host veth {veth}: {raw:#}"
    );
    let qdisc = sh(&["tc", "qdisc", "show", "dev", veth]).stdout;
    assert!(
        qdisc.contains("tbf") || qdisc.contains("ingress"),
        "bandwidth qdisc on {veth}: {qdisc}"
    );
    let ifbs: Vec<String> = ifb_names()
        .into_iter()
        .filter(|n| !ifbs_before.contains(n))
        .collect();
    assert_eq!(
        ifbs.len(),
        1,
        "bandwidth created one ifb for egress: {ifbs:?}"
    );

    // portmap: the DNAT rule is there and works (host -> gateway:HOST_PORT -> pod:8080).
    let rules = nat_rules();
    let to = format!("--to-destination {pod_ip}:8080");
    assert!(
        rules.contains(&to),
        "DNAT rule to {pod_ip}:8080 missing:\n{rules}"
    );
    assert!(
        rules.contains(&pod.id),
        "portmap rule names the container:\n{rules}"
    );
    let server = pod.netns.spawn(move || -> std::io::Result<Vec<u8>> {
        let l = TcpListener::bind(SocketAddr::new(pod_ip, 8080))?;
        let (mut c, _) = l.accept()?;
        c.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut got = Vec::new();
        c.read_to_end(&mut got)?;
        c.write_all(b"pong")?;
        Ok(got)
    });
    let reply = flowlane_e2e::wait::for_some(Duration::from_secs(30), || {
        let mut c =
            TcpStream::connect_timeout(&SocketAddr::new(gw, HOST_PORT), Duration::from_secs(5))
                .ok()?;
        c.write_all(b"ping through portmap").ok()?;
        c.shutdown(std::net::Shutdown::Write).ok()?;
        c.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
        let mut r = Vec::new();
        c.read_to_end(&mut r).ok()?;
        Some(r)
    })
    .expect("connect through the hostPort");
    assert_eq!(reply, b"pong");
    assert_eq!(server.join().unwrap().unwrap(), b"ping through portmap");

    // CHECK through the chain with the final result. Debian's portmap 1.1.1
    // fails its own CHECK on an IPv4-only pod (it looks for an IPv6 DNAT
    // chain it never created), so its answer is not asserted.
    for (i, out) in chain.check(&pod, &raw).into_iter().enumerate() {
        if chain.plugins[i]["type"] != "portmap" {
            out.expect_ok();
        }
    }

    attachment.detach();
    assert!(!nat_rules().contains(&pod.id), "portmap rule survived DEL");
    for ifb in &ifbs {
        assert!(
            flowlane_e2e::host::link(ifb).is_none(),
            "ifb {ifb} survived DEL"
        );
    }
    assert!(pod.netns.link("eth0").is_none());
    // containerd's second DEL: no netns, no prevResult.
    chain.del_without_netns(&pod);
    if net.plugin == PluginUnderTest::Flowlane {
        assert!(net.registry_entries().is_empty());
    }
    net.assert_clean(&[&pod.id]);
}
